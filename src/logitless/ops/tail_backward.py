"""The gradient of an op with a tail output (k ids' log-probs and the log-mass outside them), on every backend:
one torch pass over the vocabulary columns, as the forward's (``label_sets.vocab_pass``).

With lse the logsumexp over every column and lse_tail the one over the columns outside the k ids S,
    d log p_k / d z_j     = onehot(id_k)_j - p_j
    d log P_tail / d z_j  = [j not in S] exp(z_j - lse_tail) - p_j,
so for upstream gradients g_k (the ids) and g_tail (the tail), with G = sum_k g_k + g_tail,
    dz_j = g_k                                  - G p_j    at j = id_k
    dz_j = g_tail exp(z_j - lse_tail)           - G p_j    outside S.
Every term is bounded (exp(z_j - lse_tail) <= 1 outside S): nothing is a difference of two terms of size
p_j / P_tail, which is what the backends' dense form (-G' p_j over every column, corrected at the k ids) would
need, and which float32 cannot resolve once P_tail is small (1e-7 relative of p_j / P_tail: unbounded).
The logits are recomputed from the statistics operands the forward summed (the precision's), the gradient
products are float32 (IEEE) of hidden and weight themselves: the op's record says "ieee" (half operands:
"native", float32 accumulation).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .maths import apply_softcap_derivative, logits_from_products, mm_fp32, tf32_products


def _rows(x: Tensor, rows: Optional[Tensor], start: int, stop: int) -> Tensor:
    return x[start:stop] if rows is None else x.index_select(0, rows[start:stop])


def grads(hidden: Tensor, weight: Tensor, h_s: Tensor, w_s: Tensor, tf32: bool, local: Tensor, inv_temp: Tensor,
          lse: Tensor, tail: Tensor, g_lp: Tensor, g_tail: Optional[Tensor], rows: Optional[Tensor],
          softcap: Optional[float], need_dh: bool, need_dw: bool, step: int, columns: int,
          finish: Callable[[Tensor], Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(d_hidden hidden.dtype [N, H] or None, d_weight weight.dtype [V, H] or None).

    local [n, k]: the ids' rows in this weight (-1: ignored, or another rank's); inv_temp, lse, tail [n] and
    g_lp [n, k], g_tail [n] (None: the tail gets no gradient) of the kept rows (``rows``, or all N); lse and tail
    are global (every rank's columns). h_s / w_s: the statistics operands (their product is the forward's
    logits; TF32 products when ``tf32``). ``finish``: the tensor-parallel all-reduce of the float32 d_hidden,
    called once on every rank."""
    n_all, n, vocab = hidden.shape[0], local.shape[0], weight.shape[0]
    dev = hidden.device
    dh = torch.zeros((n_all, hidden.shape[1]), dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_dw else None
    g_t = g_tail if g_tail is not None else torch.zeros_like(lse)
    G = g_lp.sum(dim=1) + g_t
    # lse_tail = log P_tail + lse; +inf where no column lies outside S (k = V): its term is then exp(-inf) = 0
    lse_tail = torch.where(torch.isfinite(tail), tail + lse, torch.full_like(lse, float("inf")))
    neg_inf = torch.full((), float("-inf"), device=dev)
    zero = torch.zeros((), device=dev)
    for start in range(0, n, max(1, step)):
        stop = min(start + max(1, step), n)
        hb_s, hb = _rows(h_s, rows, start, stop), _rows(hidden, rows, start, stop)
        it, loc = inv_temp[start:stop], local[start:stop]
        Gb, gt, gk = G[start:stop].unsqueeze(1), g_t[start:stop].unsqueeze(1), g_lp[start:stop]
        lse_b, lse_t = lse[start:stop].unsqueeze(1), lse_tail[start:stop].unsqueeze(1)
        dh_b = torch.zeros((stop - start, hidden.shape[1]), dtype=torch.float32, device=dev) if need_dh else None
        for c0 in range(0, vocab, columns):
            c1 = min(c0 + columns, vocab)
            with tf32_products(tf32):
                raw = mm_fp32(hb_s, w_s[c0:c1].t())
            z, t = logits_from_products(raw, it, softcap, keep_tanh=True)
            rel = loc - c0
            inside = (loc >= 0) & (rel >= 0) & (rel < c1 - c0)
            cols = torch.where(inside, rel, torch.zeros_like(rel))
            dz = torch.exp(z - lse_b).mul_(-Gb)
            # the tail's term outside S: the set's columns at -inf first (scatter_add: order-free, a column 0
            # standing in for ids outside this tile adds 0), so exp never sees z_j - lse_tail > 0
            z.scatter_add_(1, cols, torch.where(inside, neg_inf, zero).expand_as(cols))
            dz.add_(z.sub_(lse_t).exp_().mul_(gt))
            dz.scatter_add_(1, cols, torch.where(inside, gk, zero))
            dlogits = apply_softcap_derivative(dz.mul_(it.unsqueeze(1)), t)
            with tf32_products(False):
                if need_dh:
                    dh_b += mm_fp32(dlogits, weight[c0:c1])
                if need_dw:
                    dw[c0:c1] += mm_fp32(dlogits.t(), hb)
        if need_dh:
            if rows is None:
                dh[start:stop] = dh_b
            else:
                dh.index_copy_(0, rows[start:stop], dh_b)
    if need_dh:
        dh = finish(dh).to(hidden.dtype)
    return dh, (dw.to(weight.dtype) if need_dw else None)
