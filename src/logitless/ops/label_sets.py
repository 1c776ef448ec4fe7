"""The torch maths of k vocabulary ids per token (a teacher's top-k, the student at those ids): their logits
from a gathered product, the one-hot part of their gradient, and the vocabulary pass that selects a top-k or
sums the mass outside a given set of ids without cancellation.

Why the one-hot part stands apart: with G = sum_k g_k, the log-softmax gradient of k log-probs is
    dz_j = sum_k g_k (onehot(id_k)_j - p_j) = (sum_k g_k onehot(id_k)_j) - G p_j,
so any backend of ``contract.py`` run with *no* label and g_lp = G gives the p part (over every column, in its
own tiles), and the one-hot part touches k columns per token: it is a small gathered product here,
W[ids] [n, k, H] against the token's hidden state (d_hidden) and an index_add into d_weight's rows. With a
softcap the one-hot coefficient carries the cap's derivative at the label's own logit, (1 - tanh^2(raw / c)),
and the temperature, as the dense part does (``maths.apply_softcap_derivative``). Under tensor parallelism a
rank adds only the ids its shard holds (-1 marks the others): its d_hidden is partial and is all-reduced with
the backend's, its d_weight rows are its own.

The tail (the mass outside a set S of k ids): log P_tail = lse_tail - lse with lse_tail the logsumexp of the
columns outside S, summed directly over them relative to *their own* running max (so that a tail far below
the top-k, e.g. log P_tail = -120, neither underflows nor is rounded away), never as log(1 - sum_S p) (which
loses everything when the set holds 1 - 1e-9 of the mass in float32). Its gradient is
    d log P_tail / d z_j = [j not in S] exp(z_j - lse_tail) - p_j,
bounded by 1: the backward (``tail_backward.py``) forms it term by term, never as a difference of two terms of
size p_j / P_tail at the k ids.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from .maths import ieee_fp32, logits_from_products, mm_fp32

# elements of one gathered [rows, k, H] block of weight rows (float32 after the upcast): bounds the workspace
GATHER_ELEMENTS = 1 << 22


def _row_blocks(n: int, k: int, h: int):
    step = max(1, GATHER_ELEMENTS // max(1, k * h))
    for start in range(0, n, step):
        yield start, min(start + step, n)


def _gathered_rows(weight: Tensor, ids: Tensor) -> Tensor:
    """float32 weight[ids] [r, k, H] (rows of -1 ids read row 0; callers zero their coefficients)."""
    return weight.index_select(0, ids.clamp(min=0).reshape(-1)).view(ids.shape + (weight.shape[1],)).float()


def set_products(hidden: Tensor, weight: Tensor, ids: Tensor) -> Tensor:
    """raw [n, k] float32 = <weight[ids], hidden> per token, 0 where ids == -1 (ids: rows of this weight)."""
    raw = torch.zeros(ids.shape, dtype=torch.float32, device=hidden.device)
    for start, stop in _row_blocks(ids.shape[0], ids.shape[1], hidden.shape[1]):
        w = _gathered_rows(weight, ids[start:stop])
        h = hidden[start:stop].float().unsqueeze(2)
        raw[start:stop] = _bmm(w, h)
    return torch.where(ids >= 0, raw, torch.zeros_like(raw))


def _bmm(w: Tensor, h: Tensor) -> Tensor:
    """float32 [r, a, b] @ [r, b, 1] -> [r, a], IEEE float32 under a global TF32 switch."""
    with ieee_fp32(w):
        return torch.bmm(w, h).squeeze(2)


def set_logits(hidden: Tensor, weight: Tensor, ids: Tensor, inv_temp: Tensor, softcap: Optional[float],
               products=None) -> tuple[Tensor, Tensor]:
    """(z [n, k], raw [n, k]): the (softcapped, tempered) logits of the ids and their raw products (from
    ``products``, default ``set_products``: the triton backend passes its kernel's)."""
    raw = (products or set_products)(hidden, weight, ids)
    z, _ = logits_from_products(raw.clone(), inv_temp, softcap)
    return z, raw


def onehot_coefficients(coef: Tensor, raw: Tensor, inv_temp: Tensor, softcap: Optional[float],
                        ids: Tensor) -> Tensor:
    """dlogits at the ids: coef [n, k] (the d loss / d z of each id's one-hot part) times 1 / temperature and,
    with a softcap, the cap's derivative at that id's raw product; 0 where ids == -1."""
    c = coef * inv_temp.unsqueeze(1)
    if softcap is not None:
        t = torch.tanh(raw / softcap)
        c = c * (1.0 - t * t)
    return torch.where(ids >= 0, c, torch.zeros_like(c))


def add_onehot_dh(dh: Tensor, weight: Tensor, ids: Tensor, c: Tensor) -> None:
    """dh [r, H] float32 += sum_k c[:, k] * weight[ids[:, k]], in blocks of bounded workspace."""
    for start, stop in _row_blocks(ids.shape[0], ids.shape[1], weight.shape[1]):
        w = _gathered_rows(weight, ids[start:stop])
        dh[start:stop] += _bmm(w.transpose(1, 2), c[start:stop].unsqueeze(2))


def add_onehot_dw(dw: Tensor, hidden: Tensor, ids: Tensor, c: Tensor, rows: Optional[Tensor] = None,
                  host_read: bool = True) -> None:
    """dw [V_local, H] += c[i, k] * hidden[rows[i]] at row ids[i, k], for ids >= 0 (``rows`` None: hidden[i]).
    The pairs are sorted by id and
    taken in blocks; each block's rows are summed in float32 and added to dw once (one rounding per block
    for a half-precision dw). host_read=False: the same sums without reading a value on the host
    (``_add_onehot_dw_static``)."""
    if not host_read:
        _add_onehot_dw_static(dw, hidden, ids, c, rows)
        return
    keep = (ids >= 0) & (c != 0)
    pair_rows, pair_cols = keep.nonzero(as_tuple=True)
    if pair_rows.numel() == 0:
        return
    pair_ids = ids[pair_rows, pair_cols]
    order = torch.argsort(pair_ids)
    pair_c = c[pair_rows, pair_cols][order]
    pair_rows, pair_ids = pair_rows[order], pair_ids[order]
    if rows is not None:
        pair_rows = rows[pair_rows]
    h = hidden.shape[1]
    step = max(1, GATHER_ELEMENTS // h)
    for start in range(0, pair_ids.numel(), step):
        stop = min(start + step, pair_ids.numel())
        rows_b, ids_b = pair_rows[start:stop], pair_ids[start:stop]
        uniq, inverse = torch.unique_consecutive(ids_b, return_inverse=True)
        contrib = hidden.index_select(0, rows_b).float() * pair_c[start:stop].unsqueeze(1)
        acc = torch.zeros((uniq.numel(), h), dtype=torch.float32, device=dw.device).index_add_(0, inverse, contrib)
        dw.index_copy_(0, uniq, (dw.index_select(0, uniq).float() + acc).to(dw.dtype))


def _add_onehot_dw_static(dw: Tensor, hidden: Tensor, ids: Tensor, c: Tensor, rows: Optional[Tensor]) -> None:
    """``add_onehot_dw`` with every size fixed by the shapes (CUDA-graph capture: no nonzero, no unique): all
    n * k pairs, sorted by id (the dropped ones, id < 0 or c == 0, last with a zero coefficient), in blocks; a
    block's pairs of one id are one segment (a running count of the id changes), summed in float32 into the
    block's [pairs, H] accumulator and added to dw at the segment's id with an accumulating index_put (its
    unused slots add 0 at row 0). A half-precision dw is rounded twice per block and id (the sum, then dw plus
    it) instead of once."""
    n, k = ids.shape
    vocab, h = dw.shape
    keep = (ids >= 0) & (c != 0)
    flat_ids = torch.where(keep, ids, vocab).reshape(-1)           # dropped pairs: past the last row
    order = torch.argsort(flat_ids, stable=True)
    pair_ids = flat_ids[order]
    pair_c = torch.where(keep, c, 0.0).reshape(-1)[order].float()
    pair_rows = torch.div(order, k, rounding_mode="floor")
    if rows is not None:
        pair_rows = rows[pair_rows]
    step = max(1, GATHER_ELEMENTS // h)
    for start in range(0, pair_ids.numel(), step):
        stop = min(start + step, pair_ids.numel())
        ids_b = pair_ids[start:stop]
        seg = torch.zeros(stop - start, dtype=torch.int64, device=dw.device)
        seg[1:] = torch.cumsum(ids_b[1:] != ids_b[:-1], dim=0)
        contrib = hidden.index_select(0, pair_rows[start:stop]).float() * pair_c[start:stop].unsqueeze(1)
        acc = torch.zeros((stop - start, h), dtype=torch.float32, device=dw.device).index_add_(0, seg, contrib)
        seg_ids = torch.full((stop - start,), vocab, dtype=torch.int64, device=dw.device).scatter_(0, seg, ids_b)
        used = seg_ids < vocab
        acc = torch.where(used.unsqueeze(1), acc, 0.0)
        dw.index_put_((torch.where(used, seg_ids, 0),), acc.to(dw.dtype), accumulate=True)


# ------------------------------------------------------------------------------------------ ids for the kernels

# the kernels' "no id": above every column, so that a row's ids sorted ascending keep their holes last
ID_HOLE = 1 << 62


def sorted_distinct(ids: Tensor, values: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """A given set as the kernels take it (``triton/given_set.py``, ``triton/tail_dlogits.py``: each tile finds
    its rows' ids among its columns by a binary search). ids [n, k] int64 (-1: none here). Returns

    - kernel ids [n, k]: each row's distinct ids ascending, then ID_HOLE for every -1 and every repeat;
    - back [n, k] int64: where each entry's id sits among the kernel ids (a hole for -1), so that
      ``out.gather(1, back)`` gives every occurrence, repeats included, its id's result;
    - with ``values`` [n, k]: each distinct id's sum of its occurrences' values at its position (0 at holes).

    Only an unchecked call can repeat an id; no host read. The sums of repeats are a scatter_add (atomic on CUDA:
    their last bit may change from run to run); a distinct id's value is its own."""
    ids = ids.long()            # ID_HOLE is an int64
    n, k = ids.shape
    pos = torch.arange(k, device=ids.device).expand(n, k)
    by_id, order = torch.sort(torch.where(ids < 0, ID_HOLE, ids), dim=1, stable=True)
    repeat = torch.zeros_like(by_id, dtype=torch.bool)
    repeat[:, 1:] = (by_id[:, 1:] == by_id[:, :-1]) & (by_id[:, 1:] != ID_HOLE)
    # repeats become holes and move behind the distinct ids (a second stable sort keeps their order)
    kernel_ids, order2 = torch.sort(torch.where(repeat, ID_HOLE, by_id), dim=1, stable=True)
    to_kernel = torch.empty_like(order2).scatter_(1, order2, pos)        # by_id position -> kernel position
    run_start = torch.cummax(torch.where(repeat, torch.zeros_like(pos), pos), dim=1).values
    to_by_id = torch.empty_like(order).scatter_(1, order, pos)           # entry -> by_id position
    back = to_kernel.gather(1, run_start.gather(1, to_by_id))
    sums = None
    if values is not None:
        run = torch.cumsum((~repeat).to(torch.int64), dim=1) - 1
        total = torch.zeros_like(values).scatter_add_(1, run, values.gather(1, order))
        at_start = torch.where(repeat | (by_id == ID_HOLE), torch.zeros_like(values), total.gather(1, run))
        sums = at_start.gather(1, order2)
    return kernel_ids.contiguous(), back, None if sums is None else sums.contiguous()


# ------------------------------------------------------------------------------------------ the vocabulary pass

class SetPartial(NamedTuple):
    """One token block's statistics over the vocabulary columns a pass has seen (this rank's shard).

    m:    [n] float32, the largest logit seen *outside* the set (-inf before the first such column)
    rest: [n] float32, sum of exp(z_j - m) over the columns outside the set (0 while m is -inf): relative to
          their own max, so that it is >= 1 once a column is seen and never underflows
    vals: [n, k] float32, the set's logits (-inf where the set's id is not among the columns seen)
    ids:  [n, k] int64 global ids of the set (selection: the current top-k candidates, -1 for none yet)
    """
    m: Tensor
    rest: Tensor
    vals: Tensor
    ids: Tensor

    def lse_and_tail(self) -> tuple[Tensor, Tensor]:
        """(lse, tail log-prob) [n]: lse_tail = m + log rest (-inf when no column lies outside the set), lse the
        logsumexp of it and the set's logits, tail = lse_tail - lse: from positive sums, in log space."""
        lse_tail = self.m + torch.log(self.rest)
        lse = torch.logsumexp(torch.cat([self.vals, lse_tail.unsqueeze(1)], 1), dim=1)
        return lse, lse_tail - lse


def _finite(m: Tensor) -> Tensor:
    """m with -inf as 0: the reference to subtract (exp(-inf - 0) = 0, where exp(-inf - -inf) would be NaN)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def add_to_rest(m: Tensor, rest: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """(m, rest) [n] with the columns z [n, c] (-inf for a column not in the rest) added: the new max, the
    old sum rescaled to it, plus sum exp(z - max). The tile z is consumed (in place)."""
    m_new = torch.maximum(m, z.amax(dim=1)) if z.shape[1] else m
    ref = _finite(m_new).unsqueeze(1)
    rest = rest * torch.exp(m - _finite(m_new)) + z.sub_(ref).exp_().sum(dim=1)
    return m_new, rest


def order_by_value_then_id(vals: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """vals, ids [n, c] sorted per row by descending value, equal values by ascending id."""
    by_id = torch.argsort(ids, dim=1, stable=True)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_val = torch.argsort(vals, dim=1, descending=True, stable=True)
    return vals.gather(1, by_val), ids.gather(1, by_val)


def merge_candidates(vals: Tensor, ids: Tensor, k: int, m: Tensor, rest: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The top k of candidates vals / ids [n, c >= k] (ties to the lower id), and (m, rest) [n] with the evicted
    candidates added (``add_to_rest``: they may lie above m, the max of the columns outside the set)."""
    vals, ids = order_by_value_then_id(vals, ids)
    m, rest = add_to_rest(m, rest, vals[:, k:].clone())
    return vals[:, :k].contiguous(), ids[:, :k].contiguous(), m, rest


def _chunk_topk(z: Tensor, k: int, host_read: bool = True) -> tuple[Tensor, Tensor]:
    """The top min(k, C) of a tile z [n, C], ties to the lower column: torch.topk may take any of equal values,
    so rows where the k-th value has an equal left out are re-taken with a stable sort (rare: equal float32
    logits, e.g. a saturated softcap). host_read=False: without reading on the host which rows those are, every
    row's columns are re-taken by the rule (those above its k-th value, then the lowest columns equal to it;
    a few more passes over the tile), in column order (the callers order candidates by value, then id)."""
    kk = min(k, z.shape[1])
    vals, cols = z.topk(kk, dim=1)
    kth = vals[:, -1:]
    if not host_read:
        equal = z == kth
        # (vals > kth).sum() columns lie above the k-th value; the first equal ones fill the rest
        take = (z > kth) | (equal & (equal.cumsum(dim=1, dtype=torch.int32) <= kk - (vals > kth).sum(1, True)))
        # exactly kk columns per row are taken: the kk largest of (C - column) where taken, 0 elsewhere
        span = torch.arange(z.shape[1], 0, -1, dtype=torch.int32, device=z.device)
        cols = torch.where(take, span, 0).topk(kk, dim=1).indices
        return z.gather(1, cols), cols
    crossing = (z == kth).sum(dim=1) > (vals == kth).sum(dim=1)
    if bool(crossing.any()):
        rows = crossing.nonzero().squeeze(1)
        sv, sc = torch.sort(z.index_select(0, rows), dim=1, descending=True, stable=True)
        vals[rows], cols[rows] = sv[:, :kk], sc[:, :kk]
    return vals, cols


def vocab_pass(hidden: Tensor, weight: Tensor, inv_temp: Tensor, softcap: Optional[float], columns: int,
               offset: int, k: int, given: Optional[Tensor] = None, given_local: Optional[Tensor] = None,
               select: int = 0, host_read: bool = True) -> tuple[SetPartial, Optional[tuple[Tensor, Tensor]]]:
    """One pass over this weight's rows in chunks of ``columns``, for hidden [n, H].

    ``given`` [n, k] (global ids) with ``given_local`` (their rows here, -1 elsewhere): the set is those ids;
    their logits come from the same tiles as the rest (so the log-probs and the tail agree) and their columns
    are left out of ``rest``; ``select`` > 0 also selects the top ``select`` logits (returned as (values, global
    ids) [n, select], the second item; None without). ``given`` None: the set is the top-k (global ids =
    offset + row), each chunk's own top-k are left out of its sum and the candidates a merge evicts are added
    back. host_read=False: no value read on the host (``_chunk_topk``)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
    rest = torch.zeros(n, dtype=torch.float32, device=dev)
    if given is not None:
        vals = torch.full(given.shape, float("-inf"), dtype=torch.float32, device=dev)
        ids = given
    else:
        vals = torch.full((n, k), float("-inf"), dtype=torch.float32, device=dev)
        ids = torch.full((n, k), -1, dtype=torch.int64, device=dev)
    sel = None
    if given is not None and select:
        sel = (torch.full((n, select), float("-inf"), dtype=torch.float32, device=dev),
               torch.full((n, select), -1, dtype=torch.int64, device=dev))
    neg_inf = torch.full((), float("-inf"), device=dev)          # a fill, not a copy from the host
    for start in range(0, vocab, columns):
        stop = min(start + columns, vocab)
        z, _ = logits_from_products(mm_fp32(hidden, weight[start:stop].t()), inv_temp, softcap)
        if given is not None:
            if sel is not None:
                cv, cc = _chunk_topk(z, select, host_read)
                sv, si, _, _ = merge_candidates(torch.cat([sel[0], cv], 1),
                                                torch.cat([sel[1], cc + (offset + start)], 1), select, m, rest)
                sel = (sv, si)
            local = given_local - start
            inside = (given_local >= 0) & (local >= 0) & (local < stop - start)
            cols = torch.where(inside, local, torch.zeros_like(local))
            vals = torch.where(inside, z.gather(1, cols), vals)
            # -inf at the set's columns: scatter_add (order-free: -inf + 0 = -inf) so a column 0 that stands in
            # for ids outside this chunk cannot overwrite a set column 0
            z.scatter_add_(1, cols, torch.where(inside, neg_inf, torch.zeros((), device=dev)).expand_as(cols))
            m, rest = add_to_rest(m, rest, z)         # in place: the tile is done
        else:
            cv, cc = _chunk_topk(z, k, host_read)
            z.scatter_(1, cc, neg_inf.expand_as(cc))
            m, rest = add_to_rest(m, rest, z)         # in place: the tile is done
            vals, ids, m, rest = merge_candidates(torch.cat([vals, cv], 1),
                                                  torch.cat([ids, cc + (offset + start)], 1), k, m, rest)
    return SetPartial(m, rest, vals, ids), sel


def combine_partials(parts: list[SetPartial], k: int, select: bool) -> SetPartial:
    """The partials of disjoint vocabulary shards (ranks, in rank order) as one: rests rescaled to the common
    max; a given set's logit is the one its owner found (-inf elsewhere); a selection merges every shard's
    candidates (ties to the lower id) and adds the evicted ones to the rest."""
    m = torch.stack([p.m for p in parts]).amax(dim=0)
    rest = torch.zeros_like(m)
    for p in parts:
        rest = rest + p.rest * torch.exp(p.m - _finite(m))     # a shard with no rest column: m -inf, rest 0
    if not select:
        vals = torch.stack([p.vals for p in parts]).amax(dim=0)
        return SetPartial(m, rest, vals, parts[0].ids)
    vals, ids, m, rest = merge_candidates(torch.cat([p.vals for p in parts], 1),
                                          torch.cat([p.ids for p in parts], 1), k, m, rest)
    return SetPartial(m, rest, vals, ids)
