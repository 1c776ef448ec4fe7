"""The distillation pass's per-chunk elementwise work in Triton kernels, on the float32 products of both heads
(cuBLAS makes them): the torch stages of ``ops/distill_chunked.py`` read every [c, V] element some forty times,
these read the two products once each: twice for the KL kinds, three times for jsd.

    statistics(raw_s, raw_t, inv_temp, div, ...) -> [STAT_ROWS, c] float64, this vocabulary shard's statistics
        (both heads' max and sum, the student's entropy sum, the KL kinds' cross sum: their divergence)
    sums(raw_s, raw_t, inv_temp, rows, div, ...) -> jsd's (D, A) [c] partial sums over this shard
    dlogits(raw_s, raw_t, inv_temp, rows, D, A, token_w, div, ..., out) -> out [c, V] = token_w * dD/draw_s

The formulas are ``ops/divergence_terms.py``'s, written out element by element (the tests hold the kernels to
it); the logit transformation is ``HeadTransform``'s (scale, then softcap * tanh(. / softcap), then 1 / T).
Each kernel's grid is (rows, column spans of SPAN columns): the spans depend on V only, so a token's numbers do
not depend on the batch. The spans' partial statistics are combined in torch ([c, spans] float64 numbers).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..divergence_terms import STAT_ROWS, Divergence, HeadTransform, RowTerms
from .common import INTERPRETING, on_device

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
                  s_scale, s_cap, t_scale, t_cap, KIND: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr,
                  BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # per (row, span), divergence_terms' part statistics (float64 [6, rows, spans]): each head's max m and
    # L = sum exp(z - m), the student's X = sum exp(z - m) (z - m), the KL kinds' cross sum relative to both
    # maxima. Online over the span's blocks: the sums follow the running maxima; the elementwise terms are
    # float32, their sums float64 (float32 sums lose a few ulps of a divergence of ~20 nats).
    row = tl.program_id(0).to(tl.int64)
    span_id = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    start = span_id * (STEPS * BLOCK)
    zero = tl.cast(0.0, tl.float64)
    m_s = -float("inf")
    m_t = -float("inf")
    l_s = zero
    x_s = zero
    l_t = zero
    cross = zero
    for step in range(STEPS):     # a compile-time trip count: the interpreter refuses a run-time bound
        cols = start + step * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        zs = _logits(tl.load(s_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, s_scale, s_cap, S_CAP)
        zt = _logits(tl.load(t_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, t_scale, t_cap, T_CAP)
        new_s = tl.maximum(m_s, tl.max(tl.where(ok, zs, -float("inf")), axis=0))
        new_t = tl.maximum(m_t, tl.max(tl.where(ok, zt, -float("inf")), axis=0))
        # the sums so far moved onto the new maxima (a span's first block: nothing to move)
        d_s = tl.where(l_s > 0, m_s - new_s, 0.0)
        d_t = tl.where(l_t > 0, m_t - new_t, 0.0)
        a_s = tl.exp(d_s).to(tl.float64)
        a_t = tl.exp(d_t).to(tl.float64)
        x_s = a_s * (x_s + l_s * d_s.to(tl.float64))
        if KIND == 0:
            cross = a_t * (cross + l_t * (d_t - d_s).to(tl.float64))
        elif KIND == 1:
            cross = a_s * (cross + l_s * (d_s - d_t).to(tl.float64))
        l_s = a_s * l_s
        l_t = a_t * l_t
        m_s = new_s
        m_t = new_t
        xs = tl.where(ok, zs - m_s, 0.0)
        xt = tl.where(ok, zt - m_t, 0.0)
        es = tl.where(ok, tl.exp(xs), 0.0)
        et = tl.where(ok, tl.exp(xt), 0.0)
        l_s += tl.sum(es.to(tl.float64), axis=0)
        x_s += tl.sum((es * xs).to(tl.float64), axis=0)
        l_t += tl.sum(et.to(tl.float64), axis=0)
        if KIND == 0:
            cross += tl.sum((et * (xt - xs)).to(tl.float64), axis=0)
        elif KIND == 1:
            cross += tl.sum((es * (xs - xt)).to(tl.float64), axis=0)
    base = out_ptr + row * n_spans + span_id
    plane = n_rows * n_spans
    tl.store(base, m_s.to(tl.float64))
    tl.store(base + plane, l_s)
    tl.store(base + 2 * plane, x_s)
    tl.store(base + 3 * plane, m_t.to(tl.float64))
    tl.store(base + 4 * plane, l_t)
    tl.store(base + 5 * plane, cross)


@triton.jit
def _log_mixture(ls, lt, log_1mb, log_b):
    a = ls + log_1mb
    b = lt + log_b
    top = tl.maximum(a, b)
    return top + tl.log(tl.exp(a - top) + tl.exp(b - top))


@triton.jit
def _row_logprobs(s_ptr, t_ptr, row, stride, cols, ok, inv_t, m_s, g_s, m_t, g_t, s_scale, s_cap, t_scale, t_cap,
                  S_CAP: tl.constexpr, T_CAP: tl.constexpr):
    # both heads' log-probs (z - m) - g (divergence_terms: never z - lse)
    zs = _logits(tl.load(s_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, s_scale, s_cap, S_CAP)
    zt = _logits(tl.load(t_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, t_scale, t_cap, T_CAP)
    return (zs - m_s) - g_s, (zt - m_t) - g_t


@triton.jit
def _sums_kernel(s_ptr, t_ptr, stride, inv_t_ptr, m_s_ptr, g_s_ptr, m_t_ptr, g_t_ptr, out_ptr, n_rows, n_spans, V,
                 s_scale, s_cap, t_scale, t_cap, beta, log_1mb, log_b,
                 S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # jsd, per (row, span): its sum D over the span's columns and A = sum p_s (ls - lm), float64
    row = tl.program_id(0).to(tl.int64)
    span_id = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    m_s = tl.load(m_s_ptr + row)
    g_s = tl.load(g_s_ptr + row)
    m_t = tl.load(m_t_ptr + row)
    g_t = tl.load(g_t_ptr + row)
    start = span_id * (STEPS * BLOCK)
    d = tl.cast(0.0, tl.float64)
    a = tl.cast(0.0, tl.float64)
    for step in range(STEPS):     # a compile-time trip count: the interpreter refuses a run-time bound
        cols = start + step * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        ls, lt = _row_logprobs(s_ptr, t_ptr, row, stride, cols, ok, inv_t, m_s, g_s, m_t, g_t, s_scale, s_cap,
                               t_scale, t_cap, S_CAP, T_CAP)
        lm = _log_mixture(ls, lt, log_1mb, log_b)
        part = tl.where(ok, tl.exp(ls) * (ls - lm), 0.0)
        a += tl.sum(part.to(tl.float64), axis=0)
        term = beta * (tl.exp(lt) * (lt - lm)) + (1.0 - beta) * part
        d += tl.sum(tl.where(ok, term, 0.0).to(tl.float64), axis=0)
    tl.store(out_ptr + row * n_spans + span_id, d)
    tl.store(out_ptr + n_rows * n_spans + row * n_spans + span_id, a)


@triton.jit
def _dlogits_kernel(s_ptr, t_ptr, stride, inv_t_ptr, m_s_ptr, g_s_ptr, m_t_ptr, g_t_ptr, coef_ptr, w_ptr, out_ptr,
                    out_stride, V, s_scale, s_cap, t_scale, t_cap, beta, log_1mb, log_b, KIND: tl.constexpr,
                    S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    # out = token_w * dD/draw_s: dD/dz_s (divergence_terms.student_dlogits) times dz_s/draw_s (inv_t, the
    # softcap's 1 - tanh^2, the scale). coef: reverse_kl's g_t - g_s - D (ls - lt - D = (x_s - x_t) + coef),
    # jsd's A
    row = tl.program_id(0).to(tl.int64)
    span_id = tl.program_id(1)
    inv_t = tl.load(inv_t_ptr + row)
    m_s = tl.load(m_s_ptr + row)
    g_s = tl.load(g_s_ptr + row)
    m_t = tl.load(m_t_ptr + row)
    g_t = tl.load(g_t_ptr + row)
    coef = tl.load(coef_ptr + row)
    factor = tl.load(w_ptr + row) * inv_t * s_scale
    start = span_id * (STEPS * BLOCK)
    for step in range(STEPS):     # a compile-time trip count: the interpreter refuses a run-time bound
        cols = start + step * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        raw = tl.load(s_ptr + row * stride + cols, mask=ok, other=0.0) * s_scale
        if S_CAP:
            th = 2.0 * tl.sigmoid(2.0 * raw / s_cap) - 1.0
            xs = s_cap * th * inv_t - m_s
        else:
            xs = raw * inv_t - m_s
        xt = _logits(tl.load(t_ptr + row * stride + cols, mask=ok, other=0.0), inv_t, t_scale, t_cap, T_CAP) - m_t
        ps = tl.exp(xs - g_s)
        if KIND == 0:
            g = ps - tl.exp(xt - g_t)
        elif KIND == 1:
            g = ps * ((xs - xt) + coef)
        else:
            ls = xs - g_s
            g = (1.0 - beta) * ps * (ls - _log_mixture(ls, xt - g_t, log_1mb, log_b) - coef)
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


def statistics(raw_s: Tensor, raw_t: Tensor, inv_temp: Tensor, div: Divergence, student: HeadTransform,
               teacher: HeadTransform) -> Tensor:
    """This vocabulary shard's statistics [STAT_ROWS, c] float64 (``divergence_terms``: both heads' max and
    sum, the student's entropy sum, the KL kinds' cross sum) from the float32 products [c, V] (same strides)."""
    c, v = raw_s.shape
    span, n_spans = _spans(v)
    out = torch.empty((STAT_ROWS, c, n_spans), dtype=torch.float64, device=raw_s.device)
    with on_device(raw_s):
        _stats_kernel[(c, n_spans)](raw_s, raw_t, raw_s.stride(0), inv_temp, out, c, n_spans, v,
                                    KIND=KINDS[div.kind], BLOCK=BLOCK, STEPS=span // BLOCK, **_heads(student, teacher))
    return div.combine_parts(out)


def _rows(rows: RowTerms) -> tuple:
    return tuple(t.contiguous() for t in (rows.m_s, rows.g_s, rows.m_t, rows.g_t))


def sums(raw_s: Tensor, raw_t: Tensor, inv_temp: Tensor, rows: RowTerms, div: Divergence, student: HeadTransform,
         teacher: HeadTransform) -> tuple[Tensor, Tensor]:
    """jsd's (D, A) float64 [c]: the divergence's and its KL(p_s || m) sums over this shard's columns."""
    c, v = raw_s.shape
    span, n_spans = _spans(v)
    out = torch.empty((2, c, n_spans), dtype=torch.float64, device=raw_s.device)
    args = _divergence_args(div)
    del args["KIND"]
    with on_device(raw_s):
        _sums_kernel[(c, n_spans)](raw_s, raw_t, raw_s.stride(0), inv_temp, *_rows(rows), out, c, n_spans, v,
                                   BLOCK=BLOCK, STEPS=span // BLOCK, **_heads(student, teacher), **args)
    total = out.sum(dim=2)
    return total[0], total[1]


def dlogits(raw_s: Tensor, raw_t: Tensor, inv_temp: Tensor, rows: RowTerms, d: Tensor, a: Optional[Tensor],
            token_w: Tensor, div: Divergence, student: HeadTransform, teacher: HeadTransform,
            out: Tensor) -> Tensor:
    """out [c, V] (any float dtype) = token_w * dD/draw_s, from the rows' numbers, the divergence d and jsd's
    A (float64 [c])."""
    c, v = raw_s.shape
    span, n_spans = _spans(v)
    if div.kind == "reverse_kl":
        coef = (rows.g_t.double() - rows.g_s.double() - d).float()
    elif div.kind == "jsd":
        coef = a.float()
    else:
        coef = rows.g_s        # not read
    with on_device(raw_s):
        _dlogits_kernel[(c, n_spans)](raw_s, raw_t, raw_s.stride(0), inv_temp, *_rows(rows), coef.contiguous(), token_w,
                                      out, out.stride(0), v, BLOCK=BLOCK, STEPS=span // BLOCK,
                                      **_heads(student, teacher), **_divergence_args(div))
    return out
