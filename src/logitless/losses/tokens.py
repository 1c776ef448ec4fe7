"""The scored tokens of one policy-loss call: per-token inputs broadcast to the labels, the
aggregation weights, and everything flattened in the row order of the hidden states.

Only scored tokens (label != ignore_index) reach a backend; their per-token inputs must be finite
(padding may hold anything, NaN included: it is never read).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .. import checks
from ..api import check_label_range, inv_temperature
from .aggregate import check_cu_seqlens, token_weights
from .policy import PolicyLoss
from .terms import TokenInputs


@dataclass(frozen=True)
class ScoredTokens:
    """The scored tokens of a call, in the row order of ``hidden.reshape(-1, H)``.

    rows: int64 [n] indices of the scored rows among all ``total`` rows (None: every row is scored).
    labels: int64 [n] global token ids. inv_temp: float32 [n]. inputs: float64 per-token inputs [n].
    row_shape: the shape of the rows before flattening (the outputs are returned in it).
    """
    rows: Optional[Tensor]
    total: int
    labels: Tensor
    inv_temp: Tensor
    inputs: TokenInputs
    row_shape: tuple

    @property
    def count(self) -> int:
        return self.labels.numel()

    def scatter(self, values: Tensor) -> Tensor:
        """values [n] of the scored rows -> [total] with zeros elsewhere."""
        if self.rows is None:
            return values
        return values.new_zeros(self.total).index_copy_(0, self.rows, values)


def score_tokens(labels: Tensor, policy: PolicyLoss, *, temperature, ignore_index: int, vocab: int,
                 seq_first: bool = False) -> ScoredTokens:
    """Check and flatten the per-token inputs of ``policy`` for ``labels`` [...] (checked by the caller).

    seq_first: the hidden states are [s, b, H] while labels (and every per-token input, and the
    sequences of the aggregation) are [b, s] (Megatron's layout); rows are then taken in [s, b] order.
    """
    valid = labels != ignore_index
    adv = checks.per_token_tensor(policy.advantages, "advantages", labels)
    old = None if policy.old_logprobs is None else checks.per_token_tensor(policy.old_logprobs, "old_logprobs",
                                                                            labels)
    ref = None if policy.ref_logprobs is None else checks.per_token_tensor(policy.ref_logprobs, "ref_logprobs",
                                                                            labels)
    cu = None if policy.cu_seqlens is None else check_cu_seqlens(policy.cu_seqlens, labels)
    weights = token_weights(valid, policy.loss_agg, cu)
    inv_t = inv_temperature(temperature, labels).view(labels.shape)

    per_token = [labels, valid, inv_t, adv, old, ref, weights]
    if seq_first:
        if labels.dim() != 2:
            raise ValueError(f"labels must be [b, s] here, got shape {tuple(labels.shape)}")
        per_token = [None if t is None else t.t() for t in per_token]
    row_shape = tuple(per_token[0].shape)
    flat = [None if t is None else t.reshape(-1) for t in per_token]
    flat_labels, flat_valid = flat[0].long(), flat[1]
    check_label_range(flat_labels, flat_valid, vocab, ignore_index)

    every = flat_labels.numel() == 0 or bool(flat_valid.all())
    rows = None if every else flat_valid.nonzero().squeeze(1)

    def pick(t, dtype):
        if t is None:
            return None
        t = t if rows is None else t.index_select(0, rows)
        return t.to(dtype)
    adv_s, old_s, ref_s = (pick(t, torch.float64) for t in flat[3:6])
    present = [(n, t) for n, t in (("advantages", adv_s), ("old_logprobs", old_s), ("ref_logprobs", ref_s))
               if t is not None]
    if present and present[0][1].numel():
        finite = torch.stack([torch.isfinite(t).all() for _, t in present])
        if not bool(finite.all()):
            bad = [n for (n, _), ok in zip(present, finite.tolist(), strict=True) if not ok]
            raise ValueError(f"{', '.join(bad)} must be finite at every scored token (label != ignore_index)")
    inputs = TokenInputs(adv_s, old_s, ref_s, pick(flat[6], torch.float64))
    return ScoredTokens(rows=rows, total=flat_labels.numel(), labels=pick(flat_labels, torch.long),
                        inv_temp=pick(flat[2], torch.float32), inputs=inputs, row_shape=row_shape)
