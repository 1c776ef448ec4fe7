"""The distillation pass's per-chunk elementwise work in three Triton kernels, on the float32 products of both
heads (cuBLAS makes them): the torch stages of ``ops/distill_chunked.py`` read every [c, V] element some forty
times, these three read the two products once each.

    statistics(raw_s, raw_t, inv_temp, student, teacher) -> (lse_s, ent_s, lse_t) [c], this vocabulary shard's
    sums(raw_s, raw_t, inv_temp, lse_s, lse_t, ...)       -> (D, A) [c] partial sums over this shard
    dlogits(raw_s, raw_t, inv_temp, lse_s, lse_t, D, A, token_w, out) -> out [c, V] = token_w * dD/draw_s

The formulas are ``ops/divergence_terms.py``'s, written out element by element (the tests hold the kernels to
it); the logit transformation is ``HeadTransform``'s (scale, then softcap * tanh(. / softcap), then 1 / T).
Each kernel's grid is (rows, column spans of SPAN columns): the spans depend on V only, so a token's numbers do
not depend on the batch. The spans' partial statistics are combined in torch ([c, spans] numbers).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..divergence_terms import Divergence, HeadTransform
from .common import INTERPRETING

BLOCK = 256 if INTERPRETING else 1024
SPAN = 2048 if INTERPRETING else 8192            # a multiple of BLOCK
KINDS = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}


@triton.jit
def _logits(raw, inv_t, scale, cap, HAS_CAP: tl.constexpr):
    z = raw * scale
    if HAS_CAP:
        z = cap * (2.0 * tl.sigmoid(2.0 * z / cap) - 1.0)    # cap * tanh(z / cap)
    return z * inv_t


@triton.jit
def _stats_kernel(s_ptr, t_ptr, stride, inv_t_ptr, out_ptr, n_rows, n_spans, V,
                  s_scale, s_cap, t_scale, t_cap, S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr,
                  STEPS: tl.constexpr):
    # per (row, span): the student's max m, sum l = sum exp(z - m), x = sum exp(z - m) (z - m); the teacher's
    # max and sum. Online over the span's blocks; x is kept relative to the running max (no cancellation).
    row = tl.program_id(0).to(tl.int64)
    span_id = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    start = span_id * (STEPS * BLOCK)
    m_s = -float("inf")
    l_s = 0.0
    x_s = 0.0
    m_t = -float("inf")
    l_t = 0.0
    for step in range(STEPS):     # a compile-time trip count: the interpreter refuses a run-time bound
        cols = start + step * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        zs = _logits(tl.load(s_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, s_scale, s_cap, S_CAP)
        zt = _logits(tl.load(t_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, t_scale, t_cap, T_CAP)
        zs = tl.where(ok, zs, -float("inf"))
        zt = tl.where(ok, zt, -float("inf"))
        new_s = tl.maximum(m_s, tl.max(zs, axis=0))
        new_t = tl.maximum(m_t, tl.max(zt, axis=0))
        # the old sums rescaled to the new max (a span's first block: nothing to rescale)
        alpha = tl.where(l_s > 0, tl.exp(m_s - new_s), 0.0)
        x_s = alpha * (x_s + l_s * tl.where(l_s > 0, m_s - new_s, 0.0))
        l_s = alpha * l_s
        es = tl.where(ok, tl.exp(zs - new_s), 0.0)
        l_s += tl.sum(es, axis=0)
        x_s += tl.sum(es * tl.where(ok, zs - new_s, 0.0), axis=0)
        m_s = new_s
        l_t = tl.where(l_t > 0, tl.exp(m_t - new_t), 0.0) * l_t + tl.sum(tl.where(ok, tl.exp(zt - new_t), 0.0),
                                                                           axis=0)
        m_t = new_t
    base = out_ptr + row * n_spans + span_id
    plane = n_rows * n_spans
    tl.store(base, m_s)
    tl.store(base + plane, l_s)
    tl.store(base + 2 * plane, x_s)
    tl.store(base + 3 * plane, m_t)
    tl.store(base + 4 * plane, l_t)


@triton.jit
def _log_mixture(ls, lt, log_1mb, log_b):
    a = ls + log_1mb
    b = lt + log_b
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _sums_kernel(s_ptr, t_ptr, stride, inv_t_ptr, lse_s_ptr, lse_t_ptr, out_ptr, n_rows, n_spans, V,
                 s_scale, s_cap, t_scale, t_cap, beta, log_1mb, log_b, KIND: tl.constexpr,
                 S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # per (row, span): the divergence's sum D over the span's columns, and for jsd A = sum p_s (ls - lm)
    row = tl.program_id(0).to(tl.int64)
    span_id = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    start = span_id * (STEPS * BLOCK)
    d = 0.0
    a = 0.0
    for step in range(STEPS):     # a compile-time trip count: the interpreter refuses a run-time bound
        cols = start + step * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        ls = _logits(tl.load(s_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, s_scale, s_cap, S_CAP) - lse_s
        lt = _logits(tl.load(t_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, t_scale, t_cap, T_CAP) - lse_t
        if KIND == 0:
            term = tl.exp(lt) * (lt - ls)
        elif KIND == 1:
            term = tl.exp(ls) * (ls - lt)
        else:
            lm = _log_mixture(ls, lt, log_1mb, log_b)
            part = tl.exp(ls) * (ls - lm)
            a += tl.sum(tl.where(ok, part, 0.0), axis=0)
            term = beta * (tl.exp(lt) * (lt - lm)) + (1.0 - beta) * part
        d += tl.sum(tl.where(ok, term, 0.0), axis=0)
    tl.store(out_ptr + row * n_spans + span_id, d)
    tl.store(out_ptr + n_rows * n_spans + row * n_spans + span_id, a)


@triton.jit
def _dlogits_kernel(s_ptr, t_ptr, stride, inv_t_ptr, lse_s_ptr, lse_t_ptr, d_ptr, a_ptr, w_ptr, out_ptr,
                    out_stride, V, s_scale, s_cap, t_scale, t_cap, beta, log_1mb, log_b, KIND: tl.constexpr,
                    S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # out = token_w * dD/draw_s: dD/dz_s (divergence_terms.student_dlogits) times dz_s/draw_s (inv_t, the
    # softcap's 1 - tanh^2, the scale)
    row = tl.program_id(0).to(tl.int64)
    span_id = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    lse_s = tl.load(lse_s_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    d = tl.load(d_ptr + row)
    a = tl.load(a_ptr + row)
    factor = tl.load(w_ptr + row) * inv_t * s_scale
    start = span_id * (STEPS * BLOCK)
    for step in range(STEPS):     # a compile-time trip count: the interpreter refuses a run-time bound
        cols = start + step * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        raw = tl.load(s_ptr + row * stride + cols, mask=ok, other=0.0) * s_scale
        if S_CAP:
            th = 2.0 * tl.sigmoid(2.0 * raw / s_cap) - 1.0
            ls = s_cap * th * inv_t - lse_s
        else:
            ls = raw * inv_t - lse_s
        lt = _logits(tl.load(t_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, t_scale, t_cap, T_CAP) - lse_t
        ps = tl.exp(ls)
        if KIND == 0:
            g = ps - tl.exp(lt)
        elif KIND == 1:
            g = ps * (ls - lt - d)
        else:
            g = (1.0 - beta) * ps * (ls - _log_mixture(ls, lt, log_1mb, log_b) - a)
        g = g * factor
        if S_CAP:
            g = g * (1.0 - th * th)
        tl.store(out_ptr + row * out_stride + cols, g.to(out_ptr.dtype.element_ty), mask=ok)


def _spans(v: int) -> tuple[int, int]:
    span = SPAN if v > SPAN else triton.cdiv(v, BLOCK) * BLOCK
    return span, triton.cdiv(v, span)


def _heads(student: HeadTransform, teacher: HeadTransform) -> dict:
    return dict(s_scale=float(student.scale), s_cap=float(student.softcap or 1.0), t_scale=float(teacher.scale),
                t_cap=float(teacher.softcap or 1.0), S_CAP=student.softcap is not None,
                T_CAP=teacher.softcap is not None)


def _divergence_args(div: Divergence) -> dict:
    beta = div.beta if div.beta is not None else 0.5
    return dict(beta=float(beta), log_1mb=math.log1p(-beta), log_b=math.log(beta), KIND=KINDS[div.kind])


def statistics(raw_s: Tensor, raw_t: Tensor, inv_temp: Tensor, student: HeadTransform,
               teacher: HeadTransform) -> tuple[Tensor, Tensor, Tensor]:
    """(lse_s, ent_s, lse_t) float32 [c] of this vocabulary shard, from the float32 products [c, V] (same
    strides)."""
    c, v = raw_s.shape
    span, n_spans = _spans(v)
    out = torch.empty((5, c, n_spans), dtype=torch.float32, device=raw_s.device)
    _stats_kernel[(c, n_spans)](raw_s, raw_t, raw_s.stride(0), inv_temp, out, c, n_spans, v,
                                BLOCK=BLOCK, STEPS=span // BLOCK, **_heads(student, teacher))
    m_s, l_s, x_s, m_t, l_t = out
    lse_j = m_s + torch.log(l_s)                       # each span's log-normaliser and entropy
    ent_j = torch.log(l_s) - x_s / l_s
    lse_s = torch.logsumexp(lse_j, dim=1)
    w = torch.exp(lse_j - lse_s.unsqueeze(1))          # the spans' shares: the entropy of a mixture
    ent = (w * (ent_j + (lse_s.unsqueeze(1) - lse_j))).sum(dim=1)
    lse_t = torch.logsumexp(m_t + torch.log(l_t), dim=1)
    return lse_s, ent, lse_t


def sums(raw_s: Tensor, raw_t: Tensor, inv_temp: Tensor, lse_s: Tensor, lse_t: Tensor, div: Divergence,
         student: HeadTransform, teacher: HeadTransform) -> tuple[Tensor, Tensor]:
    """(D, A) float32 [c]: the divergence's and jsd's KL(p_s || m) sums over this shard's columns."""
    c, v = raw_s.shape
    span, n_spans = _spans(v)
    out = torch.empty((2, c, n_spans), dtype=torch.float32, device=raw_s.device)
    _sums_kernel[(c, n_spans)](raw_s, raw_t, raw_s.stride(0), inv_temp, lse_s.contiguous(), lse_t.contiguous(), out,
                               c, n_spans, v, BLOCK=BLOCK, STEPS=span // BLOCK, **_heads(student, teacher),
                               **_divergence_args(div))
    total = out.sum(dim=2)
    return total[0], total[1]


def dlogits(raw_s: Tensor, raw_t: Tensor, inv_temp: Tensor, lse_s: Tensor, lse_t: Tensor, d: Tensor, a: Tensor,
            token_w: Tensor, div: Divergence, student: HeadTransform, teacher: HeadTransform,
            out: Tensor) -> Tensor:
    """out [c, V] (any float dtype) = token_w * dD/draw_s."""
    c, v = raw_s.shape
    span, n_spans = _spans(v)
    _dlogits_kernel[(c, n_spans)](raw_s, raw_t, raw_s.stride(0), inv_temp, lse_s.contiguous(), lse_t.contiguous(),
                                  d.contiguous(), a.contiguous(), token_w, out, out.stride(0), v, BLOCK=BLOCK,
                                  STEPS=span // BLOCK,
                                  **_heads(student, teacher), **_divergence_args(div))
    return out
