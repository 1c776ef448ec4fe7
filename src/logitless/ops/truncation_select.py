"""Which ids a sampler's truncation keeps, decided from a token's most probable candidates.

The order is vLLM's v1 sampler (``vllm/v1/sample/sampler.py``: temperature, then the min-p logits processor, then
``ops/topk_topp_sampler.apply_top_k_top_p``), on z = logits / temperature with p = softmax(z):
  1. min_p: drop p_i < min_p * max_j p_j;
  2. top_k: drop z_i below the k-th largest survivor (ties at the k-th value kept; fewer than k survivors keep all);
  3. top_p: over the survivors renormalised, sorted ascending, drop where the cumulative sum is <= 1 - top_p (the
     most probable one always kept). In descending order: a token is kept iff the renormalised mass before it is
     < top_p.
Tie rule: the candidates come sorted by descending value, equal values by ascending id, and top-p cuts in that
order (vLLM's sort leaves the order of equal logits unspecified). Comparisons are made in float64 on the float32
log-probs; a token within rounding of a threshold may fall the other way than in the sampler's float32.

``decide`` sees only the first C candidates of each token. Where the kept set may reach past them (a min-p or top-k
boundary at or beyond the C-th candidate, a nucleus that the C candidates do not fill) the token is *undecided*, and
the caller asks again with more candidates (at most the whole vocabulary, where every token is decided).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class RowSettings(NamedTuple):
    """One value per token: top_k int64 (-1: off), top_p float64 (1.0: off), min_p float64 (0.0: off)."""
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor

    def off(self, vocab: int) -> Tensor:
        """[N] bool: tokens whose settings keep the whole vocabulary."""
        return ((self.top_k < 0) | (self.top_k >= vocab)) & (self.top_p >= 1.0) & (self.min_p <= 0.0)

    def rows(self, index: Tensor) -> "RowSettings":
        return RowSettings(*(t.index_select(0, index) for t in self))


class Decision(NamedTuple):
    """keep [r, C] bool (the kept candidates, meaningful where decided), decided [r] bool."""
    keep: Tensor
    decided: Tensor


def decide(logprobs: Tensor, tail: Tensor, vocab: int, s: RowSettings, complete=None) -> Decision:
    """The kept candidates of r tokens from their C most probable ids' log-probs ``logprobs`` [r, C] (descending,
    normalised over the whole vocabulary) and ``tail`` [r] (the log of the mass outside them, -inf when C == vocab),
    C <= vocab (C == vocab: every id seen, every token decided). Tokens
    whose settings are all off (``RowSettings.off``) keep the whole vocabulary: the caller's, not passed here.
    complete: None (a token has seen every id iff C >= vocab), or [r] bool per token, for candidates padded with
    -inf past each token's own (C may then exceed vocab while a token has seen fewer ids)."""
    lp = logprobs.double()
    r, c = lp.shape
    if complete is None:
        complete = c >= vocab
    last = lp[:, -1]
    # 1. min_p: p_i >= min_p * p_max, in logs (log 0 = -inf keeps all)
    minp_on = s.min_p > 0.0
    threshold = lp[:, 0] + torch.log(s.min_p)
    keep = lp >= threshold.unsqueeze(1)
    minp_closed = minp_on & (complete | (last < threshold))      # every min-p survivor is a candidate
    survivors = keep.sum(dim=1)
    # 2. top_k on the survivors: the survivors are the leading candidates, so the k-th survivor is candidate k
    topk_on = (s.top_k > 0) & (s.top_k < vocab)
    k = s.top_k.clamp(min=1, max=c)
    kth = lp.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
    binds = topk_on & (s.top_k <= c) & ~(minp_closed & (survivors <= s.top_k))
    keep &= ~binds.unsqueeze(1) | (lp >= kth.unsqueeze(1))
    topk_closed = binds & (complete | (last < kth))
    closed = minp_closed | topk_closed | complete
    # a set still open is the whole vocabulary (mass 1) only when neither setting is on
    known = closed | (~minp_on & ~topk_on)
    # 3. top_p over the survivors, renormalised by their mass (1 for the whole vocabulary)
    # the whole vocabulary's mass as the candidates' and the tail's (1 up to the rounding of the float32 log-probs'
    # common normaliser, which would move a nucleus boundary by that much: 1e-6 of mass at top_p 0.999)
    lp_kept = lp.masked_fill(~keep, float("-inf"))
    whole = torch.logsumexp(torch.cat([lp, tail.double().unsqueeze(1)], dim=1), dim=1)
    log_mass = torch.where(closed, torch.logsumexp(lp_kept, dim=1), whole)
    q = torch.exp(lp_kept - log_mass.unsqueeze(1))
    before = torch.cumsum(q, dim=1) - q
    topp_on = s.top_p < 1.0
    keep &= ~topp_on.unsqueeze(1) | (before < s.top_p.unsqueeze(1))
    # an open nucleus is decided once the candidates' mass reaches top_p (some candidate is cut)
    cut = before[:, -1] >= s.top_p
    return Decision(keep, known & (~topp_on | closed | cut))
