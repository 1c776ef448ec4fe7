"""The fused full-vocabulary distillation pass in pure torch (any device): the "chunked" and "reference"
backends of ``fused_distillation_loss``.

The policy pass's skeleton (``policy_parts.py``) with two heads: per chunk of c scored tokens, the float32
logits [c, V] of both heads (two GEMMs), the statistics (both log-normalisers and the student's entropy;
combined across the vocab-parallel group), the per-token divergence and its derivative with respect to the
student's logits (``divergence_terms.py``), weighted by the token's loss weight, and from them d_hidden and
d_weight (two GEMMs). The gradient is formed in the same pass as the value: nothing is recomputed, four GEMMs
in all. The chunk plan is the policy pass's (``policy_chunked.max_chunk_rows``: LOGITLESS_CHUNK_ELEMENTS
float32 logits a chunk, at least MIN_ROWS tokens); "reference" takes every token in one chunk.

    distill_pass(student, teacher, inv_temp [n], token_w [n], divergence, dh, dw, tp=None, rows_per_chunk=None)
        -> (divergence [n], student entropy [n]) float32

student / teacher: ``Head`` (hidden [n, H_s|H_t], this rank's weight rows [V_local, H], its ``HeadTransform``);
both weights hold the same vocabulary rows. dh ([n, H_s], hidden's dtype, float32 under tensor parallelism:
reduced by the caller) and dw (the student weight's shape and dtype) are the caller's buffers or None; the pass
writes every element of those given. The loss is sum_i token_w[i] * divergence[i] (the caller sums it).
"""
from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .divergence_terms import M_S, M_T, Divergence, HeadTransform
from .maths import accumulate_product, mm_fp32, tf32_products
from .policy_chunked import max_chunk_rows
from .policy_parts import product_into
from .precision import GradOperands, Operands

if TYPE_CHECKING:
    from ..parallel import VocabParallel


class Head(NamedTuple):
    hidden: Tensor
    weight: Tensor
    transform: HeadTransform
    # a float32 head's precision operands (``precision.make_operands``; None: the operands themselves)
    operands: Optional[Operands] = None


def _products(head: Head, start: int, stop: int) -> Tensor:
    """The float32 products [stop - start, V] of the head's rows start:stop: hidden @ weight.T, or its
    precision's statistics operands (the split's bfloat16 [., kH] parts; TF32-rounded operands in TF32 dots)."""
    ops = head.operands
    if ops is None:
        return mm_fp32(head.hidden[start:stop], head.weight.t())
    with tf32_products(ops.tf32):
        return mm_fp32(ops.hidden[start:stop], ops.weight.t())


def _gradient_products(go: GradOperands, dz: Tensor, h_rows, dh: Optional[Tensor], acc: Optional[Tensor],
                       first: bool) -> None:
    """A chunk's d_hidden rows (into dh) and d_weight (onto acc) as the sums of a precision's products."""
    if dh is not None:
        for i, (a, b) in enumerate(go.products(dz, go.weight_parts)):
            accumulate_product(dh, a, b, first=i == 0)
    if acc is not None:
        parts = tuple(t[h_rows] for t in go.hidden_parts)
        for i, (a, b) in enumerate(go.products(dz.t(), parts)):
            accumulate_product(acc, a, b, first=first and i == 0)


def _whole(tp: Optional["VocabParallel"], divergence: Divergence, parts: Tensor) -> Tensor:
    """The whole vocabulary's statistics [STAT_ROWS, c] from this shard's (one all-gather of the ranks' float64
    [STAT_ROWS, c], combined in the same order on every rank)."""
    if tp is None or tp.world_size == 1:
        return parts
    return divergence.combine_parts(tp.gather_rows(parts).permute(1, 2, 0))


def _summed(tp: Optional["VocabParallel"], d: Tensor, a: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """The per-token sums over the whole vocabulary from this shard's (one all-reduce of [1 or 2, c])."""
    if tp is None or tp.world_size == 1:
        return d, a
    both = torch.stack([d] if a is None else [d, a])
    dist.all_reduce(both, group=tp.group)
    return both[0], None if a is None else both[1]


def distill_pass(student: Head, teacher: Head, inv_temp: Tensor, token_w: Tensor, divergence: Divergence,
                 dh: Optional[Tensor], dw: Optional[Tensor], tp: Optional["VocabParallel"] = None,
                 rows_per_chunk: Optional[int] = None, kernels: Optional[ModuleType] = None) -> tuple[Tensor, Tensor]:
    """kernels: None for the torch stages, or a module with the three stages as kernels
    (``ops/triton/distill_chunk.py``: the "triton" backend)."""
    hs, ws = student.hidden, student.weight
    n = hs.shape[0]
    dev = hs.device
    div_out = torch.empty(n, dtype=torch.float32, device=dev)
    ent_out = torch.empty(n, dtype=torch.float32, device=dev)
    with_grad = dh is not None or dw is not None
    # every rank cuts the same chunks (the combines are collectives): the plan is made for the largest shard
    plan_vocab = max(tp.sizes) if tp is not None else ws.shape[0]
    # the policy plan's rows: halved for the torch stages' [c, V] temporaries of two heads, doubled for the
    # kernels' (two float32 products and the dlogits, nothing more)
    plan = max_chunk_rows(n, plan_vocab, hs.dtype, dev)
    step = rows_per_chunk or max(1, min(n, 2 * plan) if kernels is not None else plan // 2)
    acc = dw
    if dw is not None and dw.dtype != torch.float32 and not dw.is_cuda:
        # CPU chunks are small: a float32 accumulator, rounded once (as the policy pass does)
        acc = torch.empty(dw.shape, dtype=torch.float32, device=dev)
    half_gemms = hs.is_cuda and hs.dtype != torch.float32
    # a float32 student's gradient products under a precision other than plain IEEE (the split's parts)
    go = student.operands.grad if student.operands is not None and with_grad else None
    for start in range(0, n, step):
        stop = min(n, start + step)
        it = inv_temp[start:stop]
        h = hs[start:stop]
        raw_s = _products(student, start, stop)
        raw_t = _products(teacher, start, stop)
        stage = _kernel_stages if kernels is not None else _torch_stages
        dz_dtype = go.dl_dtype if go is not None else hs.dtype if half_gemms else torch.float32
        dz = stage(raw_s, raw_t, it, token_w[start:stop], student.transform, teacher.transform, divergence, tp,
                   div_out[start:stop], ent_out[start:stop], with_grad, dz_dtype, kernels)
        if dz is None:
            continue
        if go is not None:
            _gradient_products(go, dz, slice(start, stop), None if dh is None else dh[start:stop], acc, start == 0)
            continue
        if dh is not None:
            product_into(dh[start:stop], dz, ws)
        if acc is not None:
            if acc.dtype == dz.dtype or half_gemms:
                accumulate_product(acc, dz.t(), h, first=start == 0)
            elif start == 0:
                acc.copy_(mm_fp32(dz.t(), h))
            else:
                acc.add_(mm_fp32(dz.t(), h))
    if acc is not None and acc is not dw:
        dw.copy_(acc)
    return div_out, ent_out


def _torch_stages(raw_s, raw_t, it, w, student: HeadTransform, teacher: HeadTransform, divergence: Divergence, tp,
                  div_out, ent_out, with_grad, dz_dtype, kernels=None) -> Optional[Tensor]:
    """One chunk's statistics, divergence and (with_grad) token_w * dD/draw_s in torch, in place on the
    products."""
    zs, tanh_s = student.logits(raw_s, it, keep_tanh=with_grad)
    zt, _ = teacher.logits(raw_t, it)
    parts = divergence.part_statistics(zs, zt)       # zs, zt now hold x = z - (this shard's max)
    rows = divergence.finish(_whole(tp, divergence, parts))
    if tp is not None and tp.world_size > 1:          # x relative to the whole vocabulary's max
        zs.add_((parts[M_S] - rows.m_s).float().unsqueeze(1))
        zt.add_((parts[M_T] - rows.m_t).float().unsqueeze(1))
    ls = zs.sub_(rows.g_s.unsqueeze(1))               # the log-probs (z - m) - g, in place
    lt = zt.sub_(rows.g_t.unsqueeze(1))
    d, a, lm = rows.d, None, None
    if not divergence.one_pass:
        d, a, lm = divergence.partial_sums(ls, lt)
        d, a = _summed(tp, d, a)
    div_out.copy_(d)
    ent_out.copy_(rows.entropy)
    if not with_grad:
        return None
    dz = divergence.student_dlogits(ls, lt, d, a, lm)
    del ls, lt, lm, zs, zt
    return student.chain(dz.mul_(w.unsqueeze(1)), it, tanh_s).to(dz_dtype)


def _kernel_stages(raw_s, raw_t, it, w, student: HeadTransform, teacher: HeadTransform, divergence: Divergence, tp,
                   div_out, ent_out, with_grad, dz_dtype, kernels) -> Optional[Tensor]:
    """The same with the kernels: the statistics pass (the KL kinds' divergence with it), jsd's sums, the
    dlogits; each reads the two products once."""
    parts = kernels.statistics(raw_s, raw_t, it, divergence, student, teacher)
    rows = divergence.finish(_whole(tp, divergence, parts))
    d, a = rows.d, None
    if not divergence.one_pass:
        d, a = kernels.sums(raw_s, raw_t, it, rows, divergence, student, teacher)
        d, a = _summed(tp, d, a)
    div_out.copy_(d)
    ent_out.copy_(rows.entropy)
    if not with_grad:
        return None
    dz = torch.empty(raw_s.shape, dtype=dz_dtype, device=raw_s.device)
    return kernels.dlogits(raw_s, raw_t, it, rows, d, a, w, divergence, student, teacher, dz)


def distill_pass_whole(student: Head, teacher: Head, inv_temp: Tensor, token_w: Tensor, divergence: Divergence,
                       dh: Optional[Tensor], dw: Optional[Tensor],
                       tp: Optional["VocabParallel"] = None) -> tuple[Tensor, Tensor]:
    """The "reference" backend: one chunk of every token (both heads' float32 logits [n, V])."""
    return distill_pass(student, teacher, inv_temp, token_w, divergence, dh, dw, tp=tp,
                        rows_per_chunk=max(1, student.hidden.shape[0]))


def distill_pass_triton(student: Head, teacher: Head, inv_temp: Tensor, token_w: Tensor, divergence: Divergence,
                        dh: Optional[Tensor], dw: Optional[Tensor],
                        tp: Optional["VocabParallel"] = None) -> tuple[Tensor, Tensor]:
    """The "triton" backend: cuBLAS products, the three elementwise stages as Triton kernels."""
    from .triton import distill_chunk
    return distill_pass(student, teacher, inv_temp, token_w, divergence, dh, dw, tp=tp, kernels=distill_chunk)


def distill_pass_for(backend_name: str):
    """The pass of the backend called ``backend_name`` ("reference", "chunked" or "triton")."""
    if backend_name == "triton":
        return distill_pass_triton
    return distill_pass_whole if backend_name == "reference" else distill_pass
