"""The torch maths every backend shares: float32-accumulating products, the (softcapped) tempered
logits, the label's logit and the backward formula of ``contract.py`` applied to a logits tile."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Optional

import torch
from torch import Tensor

# Set inside ``tf32_products``: float32 products may take TF32 dots (precision "tf32", whose operands are
# already rounded to TF32, so the products are exact either way). Read by ``ieee_fp32`` and by the Triton
# kernels' dot switches (``triton/common.dot_flags``).
_TF32 = contextvars.ContextVar("logitless_tf32_products", default=False)


@contextlib.contextmanager
def tf32_products(enabled: bool = True) -> Iterator[None]:
    """Inside the block (when ``enabled``), float32 products run as TF32 dots: cuBLAS with TF32 allowed and
    the Triton kernels' dots in TF32. For operands already rounded to TF32 only (``precision.round_tf32``)."""
    token = _TF32.set(bool(enabled))
    try:
        yield
    finally:
        _TF32.reset(token)


def tf32_enabled() -> bool:
    return _TF32.get()


# Set inside ``split_in_kernel``: the Triton kernels' float32 operands are split into bfloat16 parts in registers
# (``triton/tile.logits_tile``), the products of the mode below; 0 outside (the operands' own dots).
SPLIT_CODES = {"bf16x1": 1, "bf16x2": 2, "bf16x2w": 3, "bf16x3": 4}
_SPLIT = contextvars.ContextVar("logitless_split_in_kernel", default=0)


@contextlib.contextmanager
def split_in_kernel(mode: Optional[str]) -> Iterator[None]:
    """Inside the block (mode one of ``SPLIT_CODES``; None: no change), the Triton kernels that recompute logits
    from float32 operands split each loaded tile into bfloat16 parts and run ``mode``'s products on the tensor
    cores: no split copy of the operands in memory (``ops/precision.py``)."""
    token = _SPLIT.set(SPLIT_CODES[mode] if mode is not None else _SPLIT.get())
    try:
        yield
    finally:
        _SPLIT.reset(token)


def split_code() -> int:
    return _SPLIT.get()


@contextlib.contextmanager
def ieee_fp32(t: Tensor) -> Iterator[None]:
    """Float32 products on ``t``'s device in IEEE float32 inside the block: a trainer's global TF32 switch
    would cost ~3e-4 relative error. Restores the switch after. Inside ``tf32_products`` it allows TF32 instead."""
    want = _TF32.get()
    saved = torch.backends.cuda.matmul.allow_tf32 if t.is_cuda else want
    if saved != want:
        torch.backends.cuda.matmul.allow_tf32 = want
    try:
        yield
    finally:
        if saved != want:
            torch.backends.cuda.matmul.allow_tf32 = saved


def no_autocast(t: Tensor):
    """Autocast off for ``t``'s device type inside the block: the fused ops' float32 products and statistics
    must not be cast to half precision by a caller's ``torch.autocast`` (their operands were already cast at
    the entry, as F.linear would be: ``logitless.api.autocast_operands``)."""
    if t.device.type not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, enabled=False)


# The autograd dispatch keys a custom op's implementation runs without (torch.library runs it below autograd)
_AUTOGRAD_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.ADInplaceOrView)
for _key in (torch._C.DispatchKey.AutogradCPU, torch._C.DispatchKey.AutogradCUDA, torch._C.DispatchKey.AutogradOther):
    _AUTOGRAD_KEYS = _AUTOGRAD_KEYS | torch._C.DispatchKeySet(_key)


@contextlib.contextmanager
def autograd_inside_custom_op() -> Iterator[None]:
    """Autograd recording back on inside the block, inside a custom op's implementation (which torch runs
    below autograd) for the op's own small derivatives taken with torch.autograd (the policy loss's per-token
    terms). torch.func would do it too, but fails under the dispatch mode that compiled code runs custom ops
    in on their first call. Grad mode is enabled; inference_mode still forbids it (callers do not need it
    there: no gradient is formed)."""
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude - _AUTOGRAD_KEYS), torch.enable_grad():
        yield


def mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with float32 accumulation *and* a float32 result, whatever the input dtype.

    A plain bf16 matmul rounds its result to bf16, which costs ~0.08 in log-prob; on CUDA
    ``torch.mm(..., out_dtype=float32)`` keeps the fast tensor-core path, elsewhere we upcast.
    """
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        with ieee_fp32(a):
            return a @ b
    if a.is_cuda:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            pass
    return a.float() @ b.float()


def accumulate_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (float32) += a @ b with float32 accumulation, in place. On CUDA, half-precision a and b go
    straight into cuBLAS with a float32 C (no [acc]-sized temporary); float32 a and b stay IEEE float32
    even under a global TF32 switch, as in ``mm_fp32``."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        with ieee_fp32(a):
            acc.addmm_(a, b)
        return
    if a.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            pass
    acc += mm_fp32(a, b)


def logits_from_products(raw: Tensor, inv_temp: Tensor, softcap: Optional[float],
                         keep_tanh: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """The float32 logits z [N, C] of the module docstring from raw = hidden @ weight.T [N, C] (float32,
    overwritten in place), and, with keep_tanh and a softcap, t = tanh(raw / softcap) for the backward
    (a second [N, C] tensor; else None).

    Softcapped logits are t * (softcap * inv_temp): one rounded product per element, as in the Triton
    kernels, so the row max of z is the max of t times that factor and zy <= max <= lse hold exactly."""
    if softcap is None:
        return raw.mul_(inv_temp.unsqueeze(1)), None
    t = raw.div_(softcap).tanh_()
    scale = (inv_temp * softcap).unsqueeze(1)
    if keep_tanh:
        return t * scale, t
    return t.mul_(scale), None


def apply_softcap_derivative(dlogits: Tensor, t: Optional[Tensor]) -> Tensor:
    """dlogits *= 1 - t^2 in place (d tanh(x) / dx), consuming ``t``; unchanged when t is None."""
    if t is None:
        return dlogits
    return dlogits.mul_(t.square_().neg_().add_(1.0))


def label_logits(z: Tensor, labels: Tensor) -> Tensor:
    """z[i, labels[i]] for rows with a label here, 0.0 where labels[i] == -1."""
    has = labels >= 0
    zy = z.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(has, zy, torch.zeros_like(zy))


# Elements of one row block of the CPU's elementwise passes over a [rows, V] float32 tile: a block and its
# scratch (2 x 1 MiB) stay in the cores' L2 caches from one pass to the next, so the statistics and the
# dlogits each cost about one read and one write of the tile from memory, not one per operation (the CPU
# policy pass and the chunked backward; benchmarks/DESIGN.md). On CUDA a tile is one block (each operation
# a kernel over the whole tile).
BLOCK_ELEMENTS = 1 << 18


def row_blocks(c: int, vocab: int, device: torch.device) -> list[tuple[int, int]]:
    """[start, stop) row ranges of a [c, vocab] float32 tile for ``dlogits_in_blocks`` and the like."""
    step = c if device.type != "cpu" else max(1, min(c, BLOCK_ELEMENTS // max(vocab, 1)))
    return [(r, min(r + step, c)) for r in range(0, c, step)]


@contextlib.contextmanager
def one_thread_on_cpu(device: torch.device) -> Iterator[None]:
    """torch's intra-op threads set to 1 inside the block on CPU (restored after): the row blocks' small
    operations run in the calling thread. Split across threads, each of the thousands of them a step ends
    in a join that, on a machine busy with other work, waits for a descheduled thread: measured on 2 loaded
    cores, the policy pass 2.3-2.7x the 4-GEMM floor with 2 threads, 0.78-0.93x with the blocks on one
    (the GEMMs keep every thread); on an idle machine a block costs about 20 us more (benchmarks/DESIGN.md)."""
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def block_scratch(rows: int, cols: int, device: torch.device) -> Tensor:
    """float32 scratch for a block of ``row_blocks`` of any tile of at most [rows, cols]."""
    first = row_blocks(rows, cols, device)[0][1] * cols
    size = first if device.type != "cpu" else max(first, min(BLOCK_ELEMENTS, rows * cols))
    return torch.empty(size, dtype=torch.float32, device=device)


def dlogits_in_blocks(x: Tensor, labels: Tensor, inv_temp: Tensor, log_s: Tensor, ent: Optional[Tensor],
                      g_lp: Tensor, g_ent: Optional[Tensor], scratch: Tensor, blocks,
                      prescale: Optional[Tensor] = None) -> Tensor:
    """The dlogits of ``contract.py`` in place of x = z - m [c, V] (float32 logits less any per-row shift m),
    block by block (``row_blocks``; scratch: float32, at least a block); with ``prescale`` [c], x holds the
    products and each block is first multiplied by it (the logits z = raw * inv_temp, m = 0, in the same
    operation order as ``logits_from_products`` then this). log_s = lse - m (the global lse:
    under tensor parallelism the other shards' mass is in it). ``labels`` index columns of this tile (-1 or out
    of range: no label here). With x' = x - log_s = log p and p = exp(x'),

        dlogits = p * (b * x' + a) + inv_temp * g_lp at the label,  b = -inv_temp * g_ent,
        a = -inv_temp * (g_lp + g_ent * ent)   (b = 0 without an entropy term)."""
    vocab = x.shape[1]
    if g_ent is None:
        a, b = -inv_temp * g_lp, None
    else:
        a, b = -inv_temp * (g_lp + g_ent * ent), (-inv_temp * g_ent).unsqueeze(1)
    a = a.unsqueeze(1)
    with one_thread_on_cpu(x.device):
        for r0, r1 in blocks:
            xb = x[r0:r1]
            if prescale is not None:
                xb.mul_(prescale[r0:r1].unsqueeze(1))
            xb.sub_(log_s[r0:r1].unsqueeze(1))
            p = torch.exp(xb, out=scratch[:(r1 - r0) * vocab].view(r1 - r0, vocab))
            if b is None:
                torch.mul(p, a[r0:r1], out=xb)
            else:
                xb.mul_(b[r0:r1]).add_(a[r0:r1]).mul_(p)    # (addcmul with two broadcast rows is not vectorised)
    # + inv_temp * g_lp at the label, as a scatter of zeros where the row has no label here: no host
    # synchronisation (a nonzero() would stall the stream and break CUDA-graph capture)
    has = (labels >= 0) & (labels < vocab)
    cols = torch.where(has, labels, torch.zeros_like(labels)).unsqueeze(1)
    return x.scatter_add_(1, cols, torch.where(has, inv_temp * g_lp, torch.zeros_like(g_lp)).unsqueeze(1))


def dlogits_from_logits(z: Tensor, labels: Tensor, inv_temp: Tensor, lse: Tensor, ent: Optional[Tensor],
                        g_lp: Tensor, g_ent: Optional[Tensor]) -> Tensor:
    """The backward formula of the module docstring, in place on the float32 logits tile ``z``.

    ``labels`` index columns of this tile (-1 or out of range: no label here).
    """
    x = z.sub_(lse.unsqueeze(1))          # log p, in place
    p = x.exp()
    if g_ent is not None:
        # dz = -p * (g_lp + g_ent * (x + ent)), plus g_lp at the label
        x.add_(ent.unsqueeze(1)).mul_(g_ent.unsqueeze(1)).add_(g_lp.unsqueeze(1)).mul_(p).neg_()
        dz = x
    else:
        dz = p.mul_(-g_lp.unsqueeze(1))
    # + g_lp at the label, as a scatter of zeros where the row has no label here: no host synchronisation
    # (a nonzero() would stall the stream and break CUDA-graph capture)
    has = (labels >= 0) & (labels < dz.shape[1])
    cols = torch.where(has, labels, torch.zeros_like(labels)).unsqueeze(1)
    dz.scatter_add_(1, cols, torch.where(has, g_lp, torch.zeros_like(g_lp)).unsqueeze(1))
    return dz.mul_(inv_temp.unsqueeze(1))


def product_into(out: Tensor, a: Tensor, b: Tensor) -> None:
    """out = a @ b, accumulated in float32 and rounded once to out.dtype (which may be float32 for
    half-precision a, b: a float32 gradient from bfloat16 parts, or the tensor-parallel d_hidden, reduced
    across ranks before its rounding). Float32 products are IEEE float32 (``ieee_fp32``)."""
    if a.dtype == b.dtype == out.dtype and (a.is_cuda or a.dtype == torch.float32):
        with ieee_fp32(a):
            torch.mm(a, b, out=out)
    elif a.is_cuda and a.dtype == b.dtype and out.dtype == torch.float32:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        except (RuntimeError, TypeError):
            out.copy_(mm_fp32(a, b))
    else:
        out.copy_(mm_fp32(a, b))


def accumulate_product(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc = a @ b when ``first``, else acc += a @ b, in place, with float32 accumulation inside each
    product. On CUDA this is cuBLAS with beta = 1 on the acc buffer itself (no [acc]-sized temporary):
    a half-precision ``acc`` is rounded once per call, a float32 one (``out_dtype``) not at all."""
    if first:
        product_into(acc, a, b)
        return
    if a.dtype == b.dtype and (a.is_cuda or a.dtype == torch.float32):
        if acc.dtype == a.dtype:
            with ieee_fp32(a):
                acc.addmm_(a, b)
            return
        if acc.dtype == torch.float32:
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                return
            except (RuntimeError, TypeError):
                pass
    acc.add_(mm_fp32(a, b))
