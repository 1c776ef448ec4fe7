"""Float64 ground truth for truncated log-probs (issue 43), written from vLLM v1's sampler, not from the library:
the full logits (reference64.logits64), the kept set K chosen on them in float64 in vLLM's order, and the
log-probs, entropy and log kept mass of softmax restricted to K, with torch.autograd for the gradients (K fixed).

vLLM's order (v1: MinPLogitsProcessor, then ops/topk_topp_sampler.py apply_top_k_top_p_pytorch), on z = the
tempered logits:
  min_p  drop softmax(z)_i < min_p * max_j softmax(z)_j                               (0: off)
  top_k  drop z_i < the k-th largest z among min_p's survivors; ties at it are kept;
         fewer than k survivors keeps them all                                        (-1: off)
  top_p  over the survivors renormalised, in the order (z descending, id ascending): a token is kept iff the
         mass of the tokens before it is < p (so the most probable is always kept)    (1: off)
Every step keeps a prefix of that order, so K is always the first |K| tokens of it.

The op computes in float32: its kept set may differ from float64's where a decision lies within float32 rounding
of its boundary. ``decided`` marks the rows where none does, [count_lo, count_hi] the sizes float32 may choose
where one does; tests compare kept sets on decided rows and, on every row, the op's values with float64 on the
op's own set size (``on_op_count64``)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from reference64 import logits64

NEG_INF = float("-inf")


class Truncated64(NamedTuple):
    """Per token of labels' shape (kept: [..., V]); zeros / False on ignored rows."""
    kept: torch.Tensor          # bool [..., V]: the kept set K
    logprobs: torch.Tensor      # float64: z_y - logsumexp(z over K) (also for y outside K)
    entropy: torch.Tensor       # float64: entropy of softmax(z) restricted to K and renormalised
    inside: torch.Tensor        # bool: y in K
    kept_count: torch.Tensor    # int64: |K|
    kept_logprob: torch.Tensor  # float64: log of K's mass under the full softmax (not differentiated)
    decided: torch.Tensor       # bool: float32 rounding can move no token of the row across K's boundary
    count_lo: torch.Tensor      # int64: the smallest |K| a float32 computation may choose (count_range64)
    count_hi: torch.Tensor      # int64: the largest


def per_row(value, shape, dtype) -> torch.Tensor:
    """A setting (a number or a tensor broadcastable to ``shape``) as one value per row, flattened."""
    if torch.is_tensor(value):
        return torch.broadcast_to(value, shape).reshape(-1).to(dtype)
    return torch.full((int(torch.Size(shape).numel()),), value, dtype=dtype)


def order64(z: torch.Tensor) -> torch.Tensor:
    """Each row's ids in the order (z descending, id ascending): a stable descending sort."""
    return torch.sort(z, dim=-1, descending=True, stable=True).indices


def _min_p_log_gap(z, min_p):
    """log softmax(z)_i - log max_j softmax(z)_j - log(min_p): min_p drops the tokens where it is < 0."""
    logp = torch.log_softmax(z, dim=-1)
    return logp - logp.amax(-1, keepdim=True) - torch.log(min_p).unsqueeze(-1)


def _mass_before(z, keep):
    """(order, mass of the tokens before each one in that order): the survivors ``keep`` renormalised, ordered by
    (z descending, id ascending), dropped tokens last; the exclusive cumulative sum, summed forwards."""
    zs = z.masked_fill(~keep, NEG_INF)
    order = order64(zs)
    q = torch.softmax(zs, dim=-1).gather(-1, order)
    before = torch.cat([torch.zeros_like(q[:, :1]), torch.cumsum(q, dim=-1)[:, :-1]], dim=-1)
    return order, before


def _survivors(z, top_k, min_p, tie_slack=None):
    """min_p's survivors, then top_k's among them (vLLM's first two steps). tie_slack [N]: keep the values within
    it below the k-th too (those float32 may round to a tie with it)."""
    v = z.shape[-1]
    keep = ~(_min_p_log_gap(z, min_p) < 0)          # min_p = 0: log(0) = -inf, nothing is below it
    ranked = z.masked_fill(~keep, NEG_INF).sort(dim=-1, descending=True).values
    kth = ranked.gather(-1, (top_k.clamp(1, v) - 1).unsqueeze(-1))   # -inf when fewer than k survive
    if tie_slack is not None:
        kth = kth - tie_slack.unsqueeze(-1)
    return keep & ~(((top_k > 0) & (top_k < v)).unsqueeze(-1) & (z < kth))


def _kept_by_top_p(z, survivors, top_p):
    order, before = _mass_before(z, survivors)
    kept = (before < top_p.unsqueeze(-1)) | (top_p >= 1).unsqueeze(-1)
    return torch.zeros_like(survivors).scatter(-1, order, kept)


def kept_mask64(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                tie_slack=None) -> torch.Tensor:
    """The kept set [N, V] bool of float64 logits z [N, V] under per-row settings top_k [N] int64 (-1 off),
    top_p [N] float64 (1 off), min_p [N] float64 (0 off), in vLLM's order (module docstring). tie_slack: see
    ``_survivors`` (count_range64 only)."""
    z = z.detach()
    survivors = _survivors(z, top_k, min_p, tie_slack)
    return survivors & _kept_by_top_p(z, survivors, top_p)


def z_gap64(z, keep):
    """Per row: the distance in z between the kept set's lowest value and the nearest dropped value below it, or
    between the dropped set's highest value and the nearest kept value above it; inf when nothing is dropped.
    Within float32 rounding of the logits the op may see those two in the other order (a near tie across the
    boundary; an exact tie split by the id rule is none: float32 holds the tie too)."""
    z = z.detach()
    lowest_kept = z.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)
    highest_dropped = z.masked_fill(keep, NEG_INF).amax(-1, keepdim=True)
    below = z.masked_fill(keep | (z >= lowest_kept), NEG_INF).amax(-1)
    above = z.masked_fill(~keep | (z <= highest_dropped), float("inf")).amin(-1)
    gap = torch.minimum(lowest_kept[:, 0] - below, above - highest_dropped[:, 0])
    return torch.where(keep.all(-1), float("inf"), gap)


def float32_eps(z):
    """Per row: how far float32 logits may lie from float64's, with room: 2e-6 of the row's largest |z|, at least
    2e-5 (IEEE float32 logits of H 96 measured within 6e-7 of it)."""
    return (2e-6 * z.detach().abs().amax(-1)).clamp_min(2e-5)


def count_range64(z, top_k, top_p, min_p, eps):
    """Per row: (lo, hi), the kept-set sizes of the thresholds moved by float32 rounding (eps [N] in z and in
    renormalised mass: each probability is within ~eps of float64's relatively, so a mass before a token within
    eps): min_p's log-threshold by -+eps, top_p by -+eps, and (hi) top_k keeping the values within eps below the
    k-th, which float32 may round to a tie with it (a softcap's saturated logits do). Any size the float32 op may
    choose; with top_p the nucleus of the widened survivors may be smaller, so each bound is the extreme of both."""
    def count(sign, slack):
        m = torch.where(min_p > 0, min_p * torch.exp(sign * eps), min_p)
        p = torch.where(top_p < 1, top_p - sign * eps, top_p).clamp_min(1e-300)
        return kept_mask64(z, top_k, p, m, slack).sum(-1)
    counts = torch.stack([count(1.0, None), count(-1.0, None), count(1.0, eps), count(-1.0, eps)])
    return counts.amin(0), counts.amax(0)


def prefix_kept64(z: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The first counts[i] tokens of row i in the order (z descending, id ascending), as a mask [N, V]: the kept
    set of that size (every kept set is such a prefix)."""
    order = order64(z.detach())
    ranks = torch.arange(z.shape[-1], device=z.device).expand_as(order)
    return torch.zeros_like(order, dtype=torch.bool).scatter(-1, order, ranks < counts.unsqueeze(-1))


def ids_of(kept: torch.Tensor, shuffle: bool = False) -> torch.Tensor:
    """A kept mask [..., V] as ids [..., max |K|]: ascending with -1 padding last, or (shuffle) each row's ids and
    padding in a random order."""
    v = kept.shape[-1]
    width = max(int(kept.sum(-1).max()), 1) if kept.numel() else 1
    ids = torch.where(kept, torch.arange(v, device=kept.device), v).sort(dim=-1).values[..., :width]
    ids = torch.where(ids == v, -1, ids)
    if shuffle:
        ids = ids.gather(-1, torch.argsort(torch.rand(ids.shape, device=ids.device), dim=-1))
    return ids


def restricted64(z, labels, kept, ignore_index=-100):
    """(logprobs, entropy, inside, kept_count, kept_logprob) of float64 logits z [N, V] (differentiable) over the
    kept set ``kept`` [N, V] (held fixed), labels [N]; ignored rows 0 / False / 0."""
    valid = labels != ignore_index
    kept = kept & valid.unsqueeze(-1)
    computed = kept | ~valid.unsqueeze(-1)             # ignored rows: any finite stand-in, zeroed below
    y = torch.where(valid, labels, 0).long().unsqueeze(-1)
    lse = torch.logsumexp(z.masked_fill(~computed, NEG_INF), dim=-1)
    logq = (z - lse.unsqueeze(-1)).masked_fill(~computed, 0.0)
    entropy = -(logq.exp() * computed * logq).sum(-1)
    logprobs = z.gather(-1, y).squeeze(-1) - lse
    kept_logprob = (lse - torch.logsumexp(z, dim=-1)).detach()
    zero = torch.zeros_like(logprobs)
    return (torch.where(valid, logprobs, zero), torch.where(valid, entropy, zero),
            kept.gather(-1, y).squeeze(-1) & valid, kept.sum(-1), torch.where(valid, kept_logprob, zero.detach()))


def _shaped(kept, values, shape, decided=None, lo=None, hi=None):
    """Truncated64 in labels' shape; without a decision (the replay form, a given size) decided everywhere and
    the range the size itself."""
    lp, ent, inside, count, kept_lp = values
    if decided is None:
        decided, lo, hi = torch.ones_like(inside), count, count
    return Truncated64(kept.reshape(*shape, kept.shape[-1]), *(t.reshape(shape) for t in (
        lp, ent, inside, count, kept_lp, decided, lo, hi)))


def truncated64(hidden, weight, labels, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0,
                softcap: Optional[float] = None, ignore_index=-100) -> Truncated64:
    """Truncated64 of softmax(z), z = the float64 logits of hidden [..., H] and weight [V, H] (softcap, then
    temperature, as reference64.logits64), truncated in vLLM's order with per-token settings (numbers or tensors
    broadcastable to labels.shape). Differentiable w.r.t. hidden and weight if they require grad (K fixed)."""
    shape = labels.shape
    z = logits64(hidden, weight, shape, temperature, softcap).reshape(-1, weight.shape[0])
    k = per_row(top_k, shape, torch.int64)
    p = per_row(top_p, shape, torch.float64)
    m = per_row(min_p, shape, torch.float64)
    flat = labels.reshape(-1)
    valid = flat != ignore_index
    kept = kept_mask64(z, k, p, m) & valid.unsqueeze(-1)
    eps = float32_eps(z)
    lo, hi = (c * valid for c in count_range64(z.detach(), k, p, m, eps))
    decided = (lo == hi) & (z_gap64(z, kept) > eps)
    return _shaped(kept, restricted64(z, flat, kept, ignore_index), shape, decided, lo, hi)


def kept_from_ids(kept_ids: torch.Tensor, v: int) -> torch.Tensor:
    """Replay ids [N, K] (-1 padding) as a mask [N, V]."""
    ids = kept_ids.long()
    mask = torch.zeros(ids.shape[0], v + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter(-1, torch.where(ids < 0, v, ids), True)[:, :v]


def replayed64(hidden, weight, labels, kept_ids, *, temperature=1.0, softcap=None, ignore_index=-100) -> Truncated64:
    """Truncated64 over the given kept sets: kept_ids [..., K] global ids, -1 padding (the replay form).
    ``decided`` is True everywhere (no decision is made)."""
    shape = labels.shape
    z = logits64(hidden, weight, shape, temperature, softcap).reshape(-1, weight.shape[0])
    flat = labels.reshape(-1)
    kept = kept_from_ids(kept_ids.reshape(flat.numel(), -1), weight.shape[0]) & (flat != ignore_index).unsqueeze(-1)
    return _shaped(kept, restricted64(z, flat, kept, ignore_index), shape)


def on_op_count64(hidden, weight, labels, counts, *, temperature=1.0, softcap=None, ignore_index=-100):
    """Truncated64 over the first counts[...] tokens of float64's order (``prefix_kept64``): the float64 values of
    the kept set whose size the op chose (equal to truncated64's wherever the sizes agree)."""
    shape = labels.shape
    z = logits64(hidden, weight, shape, temperature, softcap).reshape(-1, weight.shape[0])
    flat = labels.reshape(-1)
    kept = prefix_kept64(z, counts.reshape(-1)) & (flat != ignore_index).unsqueeze(-1)
    return _shaped(kept, restricted64(z, flat, kept, ignore_index), shape)


def truth64(hidden, weight, labels, *, temperature=1.0, ignore_index=-100, top_k=None, top_p=None, min_p=None,
            kept_ids=None) -> Truncated64:
    """``truncated64`` or (with kept_ids) ``replayed64`` from ``Truncation``'s keywords (None: off), for the tests of
    the losses and integrations."""
    if kept_ids is not None:
        return replayed64(hidden, weight, labels, kept_ids, temperature=temperature, ignore_index=ignore_index)
    return truncated64(hidden, weight, labels, temperature=temperature, ignore_index=ignore_index,
                       top_k=-1 if top_k is None else top_k, top_p=1.0 if top_p is None else top_p,
                       min_p=0.0 if min_p is None else min_p)


def row_kept_mask64(z: torch.Tensor, top_k=None, top_p=None, min_p=None) -> torch.Tensor:
    """``kept_mask64`` of one row of logits z [V] with ``Truncation``'s keywords (numbers or None: off)."""
    def one(value, off, dtype):
        return torch.tensor([off if value is None else value], dtype=dtype)
    return kept_mask64(z.unsqueeze(0), one(top_k, -1, torch.int64), one(top_p, 1.0, torch.float64),
                       one(min_p, 0.0, torch.float64))[0]
