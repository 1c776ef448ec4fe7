"""How float32 operands are multiplied: the precisions, the operands each makes, and the gradient products.

Half-precision operands (bfloat16, float16) have one path: their products are exact, accumulated in float32.
Float32 operands choose (``precision``):

- "ieee": IEEE float32 products (today's float32 path: exact to float32, but float32 FMA, no tensor cores).
- "bf16x3": each operand as a sum of two bfloat16 parts, x = x_hi + x_lo (x_hi = x rounded to bfloat16,
  x_lo = the rest rounded to bfloat16: 16 bits of mantissa together), and the three products
  h_hi w_lo + h_lo w_hi + h_hi w_hi with float32 accumulation (the dropped h_lo w_lo is ~2^-16 relative).
  The three products are ONE bfloat16 GEMM of three times the depth: along K,
      h3 = [h_hi | h_lo | h_hi]  [N, 3H]      w3 = [w_lo | w_hi | w_hi]  [V, 3H]      h3 @ w3.T = the sum
  so every half-precision kernel (the forward statistics, the policy pass, their Hopper Gluon kernel) runs it
  unchanged, on the tensor cores, at ~3x the bfloat16 GEMM. Default for float32 operands on CUDA.
  The small products come first along K and (hi, hi) last: the K loop adds each tile onto a float32
  accumulator, and tensor-core accumulation truncates relative to the accumulator. With (hi, hi) first, every
  correction tile would be added onto a logit-sized accumulator and lose ~ulp(logit) each (biased, so it grows
  with the depth: bf16x6 was no better than bf16x3); last, the corrections sum while the accumulator is small.
- "bf16x6": three bfloat16 parts (24 bits: all of float32's mantissa) and the six products x_i y_j with
  i + j <= 2, the same way, smallest first: [N, 6H] and [V, 6H].
- "tf32": the operands rounded to TF32 (10-bit mantissa) and multiplied with TF32 tensor-core dots (on the
  CPU and in triton's interpreter: float32 products of the rounded values, the same numbers).

Default ("auto"): "bf16x3" for float32 operands on CUDA; "ieee" elsewhere (the CPU's float32 BLAS is native and
exact; a split would be slower there). Every precision runs on every device and backend (CI runs them on CPU).

The gradients (``grad_precision``): the two products d_hidden = dlogits @ W and d_weight = dlogits.T @ h.
- "bf16": dlogits rounded to bfloat16 times the operands' bfloat16 part x_hi, on the tensor cores: the error
  of a bfloat16 head's gradients (~2e-3 relative). Default for the split and TF32 precisions.
- "bf16x3" / "bf16x6": dlogits kept float32 and split like the operands, and the split's products with the
  operands' parts: float32-exact gradients (three or six bfloat16 GEMMs per product).
- "ieee": float32 dlogits, IEEE float32 products (default for "ieee").
The statistics the backward recomputes (p = exp(z - lse)) always use the statistics' precision.

Memory: the split operands are made inside the op, in its forward and again in its backward (never saved
between them): bf16x3 holds [V, 3H] + [N, 3H] bfloat16 while it runs (1.5x a float32 weight's bytes),
bf16x6 [V, 6H] + [N, 6H] (3x), tf32 a rounded float32 copy of each operand (and, for "bf16" gradients,
a bfloat16 copy). Split gradients keep the dlogits workspace in float32 (twice the bfloat16 one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor

from .. import knobs

PRECISIONS = ("auto", "split", "bf16x3", "bf16x6", "tf32", "ieee")
GRAD_PRECISIONS = ("auto", "bf16", "bf16x3", "bf16x6", "ieee")
# what a caller may claim of its float32 operands (``bf16_exact``): which of them hold bfloat16 values only
BF16_EXACT = ("hidden", "weight", "both")

# parts of each operand, and the products (part of the left operand, part of the right) of each split, in
# their order along K: smallest first, (hi, hi) last (see the module's docstring: the accumulation's rounding).
# "bf16x2" / "bf16x2w": the two products left when hidden / weight is bfloat16-exact (its low part is 0);
# "bf16x1": both are, one bfloat16 product (exact). All three give bf16x3's numbers for such operands.
_SPLITS = {"bf16x1": (1, ((0, 0),)),
           "bf16x2": (2, ((0, 1), (0, 0))),
           "bf16x2w": (2, ((1, 0), (0, 0))),
           "bf16x3": (2, ((0, 1), (1, 0), (0, 0))),
           "bf16x6": (3, ((2, 0), (1, 1), (0, 2), (1, 0), (0, 1), (0, 0)))}
# the adaptive split ("split") by (hidden bfloat16-exact, weight bfloat16-exact)
_ADAPTIVE = {(True, True): "bf16x1", (True, False): "bf16x2", (False, True): "bf16x2w", (False, False): "bf16x3"}
SPLIT = "split"


def resolve(precision: Optional[str], grad_precision: Optional[str], dtype: torch.dtype,
            device: torch.device, bf16_exact: Optional[str] = None) -> tuple[str, str]:
    """(statistics precision, gradient precision) for operands of ``dtype`` on ``device``: what the op is
    asked to run. Half-precision operands give ("native", "native"). The adaptive split is "split", or
    "split:<bf16_exact>" with the caller's claim: the op decides its products (``choose``). TypeError for a
    non-string, ValueError for an unknown name, a precision asked for half-precision operands (it would
    have no effect), or ``bf16_exact`` with half-precision operands or a precision other than the split's
    ("auto" / "split"; under "auto" on the CPU, IEEE float32, the claim is only verified)."""
    precision = _name(precision, "precision", PRECISIONS)
    grad_precision = _name(grad_precision, "grad_precision", GRAD_PRECISIONS)
    if bf16_exact is not None:
        if not isinstance(bf16_exact, str):
            raise TypeError(f"bf16_exact must be a str or None, got {type(bf16_exact).__name__}")
        if bf16_exact not in BF16_EXACT:
            raise ValueError(f"bf16_exact must be one of {BF16_EXACT} or None, got {bf16_exact!r}")
        if dtype != torch.float32:
            raise ValueError(f"bf16_exact={bf16_exact!r} has no effect on {dtype} operands: it tells which float32 "
                             f"operands hold bfloat16 values; leave it None")
        if precision not in ("auto", SPLIT):
            raise ValueError(f"bf16_exact={bf16_exact!r} has no effect with precision={precision!r}, which fixes "
                             f"the products; it applies to the adaptive split (precision None, 'auto' or 'split')")
    if dtype != torch.float32:
        for value, arg in ((precision, "precision"), (grad_precision, "grad_precision")):
            if value != "auto":
                raise ValueError(f"{arg}={value!r} has no effect on {dtype} operands: it chooses how float32 "
                                 f"operands are multiplied (half-precision products are exact); leave it "
                                 f"None or 'auto'")
        return "native", "native"
    if precision == "auto":
        precision = SPLIT if device.type == "cuda" else "ieee"
    if grad_precision == "auto":
        grad_precision = "ieee" if precision == "ieee" else "bf16"
    if bf16_exact is not None:
        # the claim travels in the precision's name (every op takes that string): verified by ``choose``
        precision = f"{precision}:{bf16_exact}"
    return precision, grad_precision


def choose(precision: str, hidden: Tensor, weight: Tensor, check_inputs: bool, group=None
           ) -> tuple[str, Optional[Tensor]]:
    """(the precision that runs, poison) for an op asked for ``precision`` (as ``resolve`` returns it).

    The adaptive split ("split[:claim]") runs as few bfloat16 products as the operands allow: "bf16x1" when
    hidden and weight both hold bfloat16 values only, "bf16x2" ("bf16x2w") when hidden (the weight) does,
    "bf16x3" otherwise. With ``check_inputs`` the operands are tested on the device (``bf16_exact_all``) and
    read on the host once (under tensor parallelism the flags are all-reduced first, so every rank of
    ``group`` runs the same products); a claim the test refutes is a ValueError. Without (no host read: CUDA
    graphs) the claim decides (no claim: "bf16x3") and is tested on the device: ``poison`` is then a float32
    0-d tensor, 0 where the claim holds and NaN where it does not, which the op adds to its outputs (and to
    its upstream gradients), so a false claim never gives a wrong number silently. "ieee:claim" (the CPU's
    default with a claim) runs "ieee", the claim verified alike. Anything else: (precision, None)."""
    base, _, claim = precision.partition(":")
    if base not in (SPLIT, "ieee") or (base == "ieee" and not claim):
        return precision, None
    claim_h, claim_w = claim in ("hidden", "both"), claim in ("weight", "both")
    flags = torch.stack([bf16_exact_all(hidden), bf16_exact_all(weight)]) if check_inputs or claim else None
    if check_inputs:
        if group is not None:
            import torch.distributed as dist
            flags = flags.to(torch.int32)
            dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        h_ok, w_ok = (bool(v) for v in flags.tolist())
        if (claim_h and not h_ok) or (claim_w and not w_ok):
            which = " and ".join(name for name, c, ok in (("hidden", claim_h, h_ok), ("weight", claim_w, w_ok))
                                 if c and not ok)
            raise ValueError(f"bf16_exact={claim!r}: {which} holds float32 values that bfloat16 cannot represent "
                             f"(a low 16-bit mantissa part is set); pass bf16_exact=None to let the op decide")
        return (_ADAPTIVE[(h_ok, w_ok)] if base == SPLIT else base), None
    mode = _ADAPTIVE[(claim_h, claim_w)] if base == SPLIT else base
    if not claim:
        return mode, None
    ok = flags[0] if claim == "hidden" else flags[1] if claim == "weight" else flags.all()
    poison = torch.where(ok, 0.0, float("nan")).to(torch.float32)
    return mode, poison


def public_name(precision: str) -> str:
    """The name ``last_precision()`` gives a precision that ran ("bf16x2w": "bf16x2")."""
    return "bf16x2" if precision == "bf16x2w" else precision


def bf16_exact_all(x: Tensor) -> Tensor:
    """0-d bool tensor on x's device (no host read): every element of the float32 x [R, C] is a bfloat16 value
    (the low 16 bits of its pattern are 0). One read of x; no temporary of x's size (a triton kernel on CUDA,
    row blocks elsewhere)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1]) if x.dim() > 0 else x.reshape(1, 1)
    if x.is_cuda:
        from .triton.exact import bf16_exact_all as kernel  # lazy: no triton on the CPU path
        return kernel(x)
    bits = x.view(torch.int32)
    rows = max(1, (1 << 22) // max(1, x.shape[1]))
    low = torch.zeros((), dtype=torch.int32, device=x.device)
    if x.numel():
        for start in range(0, x.shape[0], rows):
            low = low | (bits[start:start + rows] & 0xFFFF).amax()
    return low == 0


def _name(value, arg: str, names: tuple) -> str:
    if value is None:
        return "auto"
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a str or None, got {type(value).__name__}")
    if value not in names:
        raise ValueError(f"{arg} must be one of {names} or None, got {value!r}")
    return value


def split_parts(x: Tensor, parts: int) -> list[Tensor]:
    """x (float32) as ``parts`` bfloat16 tensors whose float32 sum is x to ~2^-(8 * parts) relative: each part
    is what the earlier parts leave, rounded to bfloat16."""
    out = []
    rest = x.float()
    for i in range(parts):
        part = rest.to(torch.bfloat16)
        out.append(part)
        if i + 1 < parts:
            rest = rest - part.float()
    return out


def split_concat_reference(x: Tensor, blocks: tuple) -> Tensor:
    """[rows, len(blocks) * H] bfloat16 whose block b of columns is ``split_parts(x, ...)[blocks[b]]``: a split
    operand, the parts concatenated along K. The definition the CUDA kernel (``ops.triton.split``) matches."""
    h = x.shape[1]
    parts = split_parts(x, max(blocks) + 1)
    out = torch.empty((x.shape[0], len(blocks) * h), dtype=torch.bfloat16, device=x.device)
    for b, i in enumerate(blocks):
        out[:, b * h:(b + 1) * h] = parts[i]
    return out


def split_concat(x: Tensor, blocks: tuple) -> Tensor:
    """``split_concat_reference`` in one pass over x on CUDA (a triton kernel: the torch path reads and writes
    the float32 operand several times, in the forward and again in the backward); the reference elsewhere."""
    if x.is_cuda:
        from .triton.split import split_concat as kernel  # lazy: no triton on the CPU path
        return kernel(x, blocks)
    return split_concat_reference(x, blocks)


def round_tf32(x: Tensor) -> Tensor:
    """x (float32) rounded to TF32's 10-bit mantissa (to nearest, ties away from zero, as the hardware's
    conversion), a float32 tensor: its products with TF32 dots are exact."""
    bits = x.float().contiguous().view(torch.int32)
    rounded = (bits + (1 << 12)) & ~((1 << 13) - 1)
    finite = torch.isfinite(x)
    return torch.where(finite, rounded.view(torch.float32), x.float())


# the most bytes of a weight block's bfloat16 parts that a product over the whole vocabulary makes at once
# (``GradOperands.weight_blocks``): 128 MiB, 16384 rows at H 4096, a product deep enough for the tensor cores
WEIGHT_BLOCK_BYTES = 128 << 20


@dataclass(frozen=True)
class GradOperands:
    """The two gradient products of a backend: d_hidden = sum over ``pairs`` (i, j) of dl_i @ weight_parts[j],
    d_weight = sum of dl_i.T @ hidden_parts[j], where dl_i are the parts of the dlogits (``dl_parts`` bfloat16
    parts of float32 dlogits; with one, the dlogits as the backend wrote them, in ``dl_dtype``).

    hidden_parts [N, H] and weight_parts [V, H] (views into the split operands, or the operands themselves);
    dl_dtype: the dtype the backend writes its dlogits in; out_dtype: the d_weight dtype (the weight's)."""
    hidden_parts: tuple
    weight_parts: tuple
    pairs: tuple
    dl_parts: int
    dl_dtype: torch.dtype
    out_dtype: torch.dtype
    # > 0: weight_parts is (the float32 weight,), split into this many parts per block of rows when used
    # (``weight_rows``): no [V, H] copy of its parts (the in-kernel split's backward)
    split_weight_rows: int = 0

    @staticmethod
    def plain(hidden: Tensor, weight: Tensor, dl_dtype: Optional[torch.dtype] = None) -> "GradOperands":
        """The products of the operands themselves with the dlogits in ``dl_dtype`` (default hidden's)."""
        return GradOperands((hidden,), (weight,), ((0, 0),), 1, dl_dtype or hidden.dtype, weight.dtype)

    def rows(self, index) -> "GradOperands":
        """The same products for hidden's rows ``index`` (a slice, or an int64 tensor of rows)."""
        pick = (lambda t: t[index]) if isinstance(index, slice) else (lambda t: t.index_select(0, index))
        return GradOperands(tuple(pick(t) for t in self.hidden_parts), self.weight_parts, self.pairs, self.dl_parts,
                            self.dl_dtype, self.out_dtype, self.split_weight_rows)

    def weight_rows(self, start: int, stop: int) -> list:
        """The weight's parts, rows start..stop (views, or that block split now)."""
        if self.split_weight_rows:
            return split_parts(self.weight_parts[0][start:stop], self.split_weight_rows)
        return [w[start:stop] for w in self.weight_parts]

    def weight_blocks(self, vocab: int) -> list:
        """(start, stop) row blocks of the weight for a product over its whole vocabulary (the policy pass's
        d_hidden = dlogits @ weight): one block when the parts exist, else blocks whose split parts are at most
        ``WEIGHT_BLOCK_BYTES`` (made one block at a time by ``weight_rows``: no [V, H] copy)."""
        if not self.split_weight_rows:
            return [(0, vocab)]
        rows = max(1, WEIGHT_BLOCK_BYTES // (2 * self.split_weight_rows * max(1, self.hidden_size)))
        return [(start, min(start + rows, vocab)) for start in range(0, vocab, rows)]

    @property
    def hidden_size(self) -> int:
        return self.weight_parts[0].shape[1]

    def products(self, dl: Tensor, operand_parts) -> Iterator[tuple[Tensor, Tensor]]:
        """(a, b) whose products a @ b sum to dlogits @ operand: ``dl`` [*, C] the dlogits (or their transpose),
        ``operand_parts`` the right operands' parts ([C, *] each)."""
        if self.dl_parts == 1:
            dls = [dl if dl.dtype == self.dl_dtype else dl.to(self.dl_dtype)]
        else:
            dls = split_parts(dl, self.dl_parts)
        for i, j in self.pairs:
            yield dls[i], operand_parts[j]


@dataclass(frozen=True)
class Operands:
    """What a backend multiplies for one call: the statistics operands (the logits are hidden @ weight.T;
    bfloat16 [N, kH] / [V, kH] for a split), whether their dots are TF32 (``tf32``), and the gradient products
    (``grad``)."""
    hidden: Tensor
    weight: Tensor
    grad: GradOperands
    tf32: bool = False
    split: Optional[str] = None   # the products the kernels split in registers (``maths.split_in_kernel``)


def make_operands(hidden: Tensor, weight: Tensor, precision: str, grad_precision: str,
                  with_grad: bool = True) -> Optional[Operands]:
    """The operands of ``precision`` / ``grad_precision`` (as ``resolve`` returns them) for hidden [N, H] and
    weight [V, H]; None for the operands themselves ("native", or "ieee" with "ieee" gradients): the backends'
    own path. with_grad=False: only the statistics operands are used (the gradient parts are views anyway)."""
    if precision.startswith(SPLIT):
        raise ValueError(f"make_operands: {precision!r} is decided per call first (``choose``)")
    if precision in ("native", "ieee") and grad_precision in ("native", "ieee"):
        return None
    if precision in _SPLITS:
        parts, pairs = _SPLITS[precision]
        h_stats = split_concat(hidden, tuple(i for i, _ in pairs))
        w_stats = split_concat(weight, tuple(j for _, j in pairs))
        h = hidden.shape[1]
        # views of the concatenation: block b of K holds parts pairs[b]; part i's view is the first block that
        # holds it (the dict keeps the last assignment, hence reversed). A part no block holds (the zero low
        # part of a bfloat16-exact operand in "bf16x2"): the views stop before it
        h_views = {i: h_stats[:, b * h:(b + 1) * h] for b, (i, _) in reversed(list(enumerate(pairs)))}
        w_views = {j: w_stats[:, b * h:(b + 1) * h] for b, (_, j) in reversed(list(enumerate(pairs)))}
        h_views = _leading(h_views, parts)
        w_views = _leading(w_views, parts)
        tf32 = False
    elif precision == "tf32":
        h_stats, w_stats = round_tf32(hidden), round_tf32(weight)
        h_views = w_views = None
        tf32 = True
    else:   # "ieee" statistics with another gradient precision
        h_stats, w_stats = hidden, weight
        h_views = w_views = None
        tf32 = False
    grad = _grad_operands(hidden, weight, grad_precision, h_views, w_views) if with_grad else \
        GradOperands.plain(hidden, weight)
    return Operands(h_stats, w_stats, grad, tf32)


# the products a backend's kernels can split in registers from the float32 operands (``kernel_operands``); bf16x1
# keeps its bfloat16 copies, the bfloat16 path's own kernels and tiles (its statistics bit for bit)
IN_KERNEL = ("bf16x2", "bf16x2w", "bf16x3")


def splits_in_kernel(backend: str) -> bool:
    """Whether ``backend``'s kernels split the float32 operands of ``IN_KERNEL`` in registers: the triton backend's,
    unless LOGITLESS_SPLIT_IN_KERNEL=0 (the concatenated copies then, ``make_operands``; for benchmarks)."""
    return backend == "triton" and knobs.split_in_kernel()


def kernel_operands(hidden: Tensor, weight: Tensor, precision: str, grad_precision: str,
                    with_grad: bool = True) -> Operands:
    """The operands of ``precision`` (one of ``IN_KERNEL``) for a backend whose kernels split float32 tiles in
    registers: the statistics operands are hidden and weight themselves (``Operands.split`` names the products),
    and the "bf16" gradient products take the weight's bfloat16 part block by block (``weight_rows``) and
    hidden's once ([N, H] bfloat16): no split copy of the weight. Other gradient precisions: their parts.
    with_grad=False: only the statistics operands are used (no gradient parts are made)."""
    if not with_grad:
        grad = GradOperands.plain(hidden, weight)
    elif grad_precision == "bf16":
        grad = GradOperands((hidden.to(torch.bfloat16),), (weight,), ((0, 0),), 1, torch.bfloat16, weight.dtype,
                            split_weight_rows=1)
    else:
        grad = _grad_operands(hidden, weight, grad_precision, None, None)
    return Operands(hidden, weight, grad, split=precision)


def _leading(views: dict, parts: int) -> tuple:
    """views[0], views[1], ... up to the first part missing (at most ``parts``)."""
    out = []
    for i in range(parts):
        if i not in views:
            break
        out.append(views[i])
    return tuple(out)


def _grad_operands(hidden: Tensor, weight: Tensor, grad_precision: str, h_views, w_views) -> GradOperands:
    if grad_precision == "ieee":
        return GradOperands.plain(hidden, weight, torch.float32)
    parts, pairs = (1, ((0, 0),)) if grad_precision == "bf16" else _SPLITS[grad_precision]
    # the statistics' split already holds the parts (views, no copy) when it has at least as many
    if h_views is not None and len(h_views) >= parts and len(w_views) >= parts:
        h_parts, w_parts = h_views[:parts], w_views[:parts]
    else:
        h_parts, w_parts = tuple(split_parts(hidden, parts)), tuple(split_parts(weight, parts))
    dl_dtype = torch.bfloat16 if grad_precision == "bf16" else torch.float32
    return GradOperands(h_parts, w_parts, pairs, parts if parts > 1 else 1, dl_dtype, weight.dtype)
