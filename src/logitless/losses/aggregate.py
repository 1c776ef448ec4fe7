"""Per-token weights of the loss aggregations (verl's ``agg_loss`` modes), fixed before the pass.

Every supported aggregation is sum_i w_i f_i with weights that depend only on which tokens are scored,
never on the values: that is what lets the fused pass form gradients chunk by chunk. With n_tok the
number of scored tokens, a sequence's length len_s its number of scored tokens, and n_seq the number of
sequences with at least one scored token (verl 0.9 excludes fully masked sequences):

    token-mean                w = 1 / n_tok
    token-sum                 w = 1
    seq-mean-token-mean       w = 1 / (n_seq * len_s)
    seq-mean-token-sum        w = 1 / n_seq
    seq-mean-token-sum-norm   w = 1 / (n_seq * horizon)

horizon is the size of the sequence axis for labels of two or more dimensions (verl's
``loss_mask.shape[-1]``) and, for packed 1-D labels with ``cu_seqlens``, the longest packed sequence (the
width the batch would have padded to; to normalise by another constant, scale the loss). With no scored
token every weight is 0 and the loss is 0 (not NaN).

A sequence is a row (the last axis) of labels with two or more dimensions; 1-D labels are packed
sequences delimited by ``cu_seqlens`` (int [k + 1], 0 = cu[0] <= ... <= cu[k] = len(labels)). Losses
whose gradient couples a sequence's tokens through their values (sequence-level ratios as in GSPO) are
no such sum: compute them from ``fused_logprobs`` with your own loss.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import checks

LOSS_AGGS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SEQUENCE_AGGS = LOSS_AGGS[2:]


def check_loss_agg(loss_agg) -> str:
    if not isinstance(loss_agg, str):
        raise TypeError(f"loss_agg must be a str, got {type(loss_agg).__name__}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r} (sequence-level ratios, GSPO's, "
                         "are ratio_level='sequence' with any of them; another aggregation: logitless.fused_logprobs "
                         "and your own loss on its outputs)")
    return loss_agg


def check_cu_seqlens(cu_seqlens, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(int64 [k + 1] sequence boundaries of packed 1-D labels, a 0-d bool tensor: their values are
    valid). The layout is checked here; the values are the caller's to check, in its one host
    synchronisation (``cu_seqlens_error`` gives the message)."""
    cu = checks.index_tensor(cu_seqlens, "cu_seqlens")
    if labels.dim() != 1:
        raise ValueError(f"cu_seqlens is for packed 1-D labels; labels have shape {tuple(labels.shape)}, whose "
                         "rows are the sequences already")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries [0, ..., n], got shape {tuple(cu.shape)}")
    if cu.device != labels.device:
        raise ValueError(f"cu_seqlens is on {cu.device}, labels on {labels.device}")
    cu = cu.long()
    ok = (cu[0] == 0) & (cu[-1] == labels.numel()) & (cu[1:] >= cu[:-1]).all()
    return cu, ok


def cu_seqlens_error(cu: Tensor, n: int) -> ValueError:
    return ValueError(f"cu_seqlens must start at 0, never decrease and end at len(labels) = {n}, "
                      f"got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")


def check_agg_layout(labels: Tensor, loss_agg: str, cu_seqlens: Optional[Tensor]) -> None:
    """ValueError when ``loss_agg`` needs sequences that labels (and cu_seqlens) do not delimit."""
    if loss_agg in SEQUENCE_AGGS:
        if labels.dim() == 0:
            raise ValueError(f"loss_agg={loss_agg!r} needs sequences; labels are a single token")
        if labels.dim() == 1 and cu_seqlens is None:
            raise ValueError(f"loss_agg={loss_agg!r} needs sequences: give labels [b, s] (a sequence per row) or "
                             "cu_seqlens for packed 1-D labels")


def token_weights(valid: Tensor, loss_agg: str, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """float64 weights of the labels' shape (0 where not valid) for ``loss_agg``.

    valid: bool [...], the scored tokens, in the labels' layout. cu_seqlens: checked int64 boundaries
    for 1-D labels, needed by the sequence aggregations there (ValueError otherwise)."""
    v = valid.double()
    if loss_agg == "token-sum":
        return v
    if loss_agg == "token-mean":
        return v / v.sum().clamp_min(1.0)
    check_agg_layout(valid, loss_agg, cu_seqlens)
    if cu_seqlens is not None:
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        # output_size: the lengths sum to len(labels) (checked); without it the size is read on the host
        seq_of = torch.repeat_interleave(torch.arange(lengths.numel(), device=valid.device), lengths,
                                         output_size=valid.numel())
        per_seq = torch.zeros(lengths.numel(), dtype=torch.float64, device=valid.device).index_add_(0, seq_of, v)
        tokens_in_seq = per_seq[seq_of]
        horizon = lengths.max().clamp_min(1).double()
    else:
        per_seq = v.sum(dim=-1)
        tokens_in_seq = per_seq.unsqueeze(-1).expand_as(v)
        horizon = float(valid.shape[-1])
    n_seq = (per_seq > 0).sum().double().clamp_min(1.0)
    if loss_agg == "seq-mean-token-mean":
        return v / (n_seq * tokens_in_seq.clamp_min(1.0))
    if loss_agg == "seq-mean-token-sum":
        return v / n_seq
    return v / (n_seq * horizon)
