"""The gradient of an op with a tail output (k ids' log-probs and the log-mass outside them): the closed form, its
per-row and per-id coefficients (``terms``: one definition for both passes), and the torch pass of the backends
without a kernel for it (the triton backend forms it in its dlogits kernel, ``triton/tail_dlogits.py``).

With lse the logsumexp over every column and lse_tail the one over the columns outside the k ids S,
    d log p_k / d z_j     = onehot(id_k)_j - p_j
    d log P_tail / d z_j  = [j not in S] exp(z_j - lse_tail) - p_j,
so for upstream gradients g_k (the ids) and g_tail (the tail), with G = sum_k g_k + g_tail,
    dz_j = sum over k with id_k = j of  c_k = g_k - G exp(lp_k)        at the ids
    dz_j = g_tail exp(z_j - lse_tail) - G p_j                          outside S.
Every term is bounded (exp(z_j - lse_tail) <= 1 outside S): nothing is a difference of two terms of size
p_j / P_tail, which is what the backends' dense form (-G' p_j over every column, corrected at the k ids) would
need, and which float32 cannot resolve once P_tail is small (1e-7 relative of p_j / P_tail: unbounded).

At the ids, p is the forward's own log-prob's exponential, exp(lp_k): the gradient of the numbers the forward
returned, whatever order a pass sums the recomputed logits in (at a tiny tail the ids' logits are large, 100 and
more, where float32 summation orders differ by 1e-5 and p_j ~ 1), and of an id repeated within a row too (only
with check_inputs=False: the forward's lse counts it once per occurrence, so its p term is taken per occurrence).
Elsewhere the logits are recomputed from the statistics operands the forward summed (the precision's). This torch
pass forms the gradient products in float32 (IEEE) of hidden and weight themselves: the op's record says "ieee"
(half operands: "native", float32 accumulation); the triton backend's kernel writes dlogits like its plain
backward and runs the op's ``grad_precision`` products (``label_set_function.backward_precision``).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .label_sets import sorted_distinct
from .maths import apply_softcap_derivative, logits_from_products, mm_fp32, tf32_products


class TailTerms(NamedTuple):
    """What the closed form needs per kept row besides lse, the temperature and G (the backends' g_lp).

    ids [n, k] int64: the ids' rows in this weight (-1: an ignored row, or an id another rank holds: no column
    here; ``label_sets.ID_HOLE`` in ``unique_ids``' form, the triton kernel's); at_ids [n, k] float32: each id's
    dz c_k = g_k - G exp(lp_k); g_tail [n] float32, or None when the tail gets no gradient (its term is then 0);
    lse_tail [n] float32: the logsumexp outside the ids (global), +inf where no column lies outside them (k = V:
    exp(z_j - lse_tail) = 0)."""
    ids: Tensor
    at_ids: Tensor
    g_tail: Optional[Tensor]
    lse_tail: Tensor

    def rows(self, start: int, stop: int) -> "TailTerms":
        return TailTerms(self.ids[start:stop], self.at_ids[start:stop],
                         None if self.g_tail is None else self.g_tail[start:stop], self.lse_tail[start:stop])


def terms(local: Tensor, lse: Tensor, tail: Tensor, lp: Tensor, g_lp: Tensor, g_tail: Optional[Tensor]
          ) -> tuple[TailTerms, Tensor]:
    """(TailTerms, G [n]) of the kept rows: local [n, k] (the ids' rows here, -1 elsewhere), lse and tail
    (log P_tail) [n] and the ids' log-probs lp [n, k] as the forward returned them (global), their upstream
    gradients g_lp [n, k] and g_tail [n] or None. Float32 and contiguous, as the kernel indexes them."""
    g_lp = g_lp.float()
    G = g_lp.sum(dim=1) + (g_tail.float() if g_tail is not None else 0.0)
    at_ids = g_lp - G.unsqueeze(1) * lp.float().exp()
    # lse_tail = log P_tail + lse; +inf where no column lies outside S (k = V): its term is then exp(-inf) = 0
    lse_tail = torch.where(torch.isfinite(tail), tail + lse, torch.full_like(lse, float("inf")))
    return (TailTerms(local.contiguous(), at_ids.contiguous(),
                      None if g_tail is None else g_tail.float().contiguous(), lse_tail.float().contiguous()),
            G.contiguous())


def unique_ids(tail: TailTerms) -> TailTerms:
    """``tail`` as the triton dlogits kernel takes it (``label_sets.sorted_distinct``): each row's distinct ids
    ascending, each with the sum of its occurrences' c_k (the dz of its column), then holes (ID_HOLE, c 0) for
    -1 ids and repeats (only an unchecked call can repeat one). The kernel writes each id's c_k in place of the
    column's other terms, one id at a time, with no tile to add repeats in."""
    ids, _, c = sorted_distinct(tail.ids, tail.at_ids)
    return TailTerms(ids, c, tail.g_tail, tail.lse_tail)


def _rows(x: Tensor, rows: Optional[Tensor], start: int, stop: int) -> Tensor:
    return x[start:stop] if rows is None else x.index_select(0, rows[start:stop])


def grads(hidden: Tensor, weight: Tensor, h_s: Tensor, w_s: Tensor, tf32: bool, tail: TailTerms, G: Tensor,
          inv_temp: Tensor, lse: Tensor, rows: Optional[Tensor], softcap: Optional[float], need_dh: bool,
          need_dw: bool, step: int, columns: int, finish: Callable[[Tensor], Tensor]
          ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(d_hidden hidden.dtype [N, H] or None, d_weight weight.dtype [V, H] or None), the torch pass.

    tail, G (``terms``), inv_temp and lse [n] (global) of the kept rows (``rows``, or all N). h_s / w_s: the
    statistics operands (their product is the forward's logits; TF32 products when ``tf32``). ``finish``: the
    tensor-parallel all-reduce of the float32 d_hidden, called once on every rank."""
    local, at_ids, lse_tail = tail.ids, tail.at_ids, tail.lse_tail
    n_all, n, vocab = hidden.shape[0], local.shape[0], weight.shape[0]
    dev = hidden.device
    dh = torch.zeros((n_all, hidden.shape[1]), dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_dw else None
    g_t = tail.g_tail if tail.g_tail is not None else torch.zeros_like(lse)
    neg_inf = torch.full((), float("-inf"), device=dev)
    zero = torch.zeros((), device=dev)
    for start in range(0, n, max(1, step)):
        stop = min(start + max(1, step), n)
        hb_s, hb = _rows(h_s, rows, start, stop), _rows(hidden, rows, start, stop)
        it, loc = inv_temp[start:stop], local[start:stop]
        Gb, gt, ck = G[start:stop].unsqueeze(1), g_t[start:stop].unsqueeze(1), at_ids[start:stop]
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
            # the ids' columns at -inf first (scatter_add: order-free, a column 0 standing in for ids outside this
            # tile adds 0): neither term outside S is taken there (exp never sees z_j - lse_tail > 0), then c_k
            z.scatter_add_(1, cols, torch.where(inside, neg_inf, zero).expand_as(cols))
            dz = torch.exp(z - lse_b).mul_(-Gb)
            dz.add_(z.sub_(lse_t).exp_().mul_(gt))
            dz.scatter_add_(1, cols, torch.where(inside, ck, zero))
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
