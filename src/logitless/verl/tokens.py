"""Where a verl micro-batch's response tokens sit among the rows the LM head sees.

verl's engine batches are "no padding" TensorDicts: ``input_ids`` a jagged nested tensor [b, j] (prompt
and response of each sequence, no padding), and the per-response tensors (``response_mask``,
``old_log_probs``, ``advantages``, ``ref_log_prob``) padded [b, R]. verl's loss reads the model's
per-position outputs back into that [b, R] layout with ``no_padding_2_padding`` (the output at position p
scores token p + 1). ``ResponseTokens`` inverts that map (running verl's own function on position
numbers, so both agree by construction): per packed position (``total`` = the sum of the sequence
lengths), whether it is scored and its advantage / old / ref log-prob. ``for_rows`` then lays that out
like the hidden states of the model's forward: packed [1, total + pad] (remove-padding; the engine pads
the tail) or padded [b, S] (one row per sequence).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

IGNORE = -100
FIELDS = ("response_mask", "old_log_probs", "advantages", "ref_log_prob", "rollout_is_weights")


@dataclass(frozen=True)
class ResponseTokens:
    """The micro-batch's scored response tokens, by packed position.

    scored: bool [total]; advantages, old_logprobs: float32 [total] (0 where not scored);
    ref_logprobs, rollout_weights: float32 [total] or None (verl's ref_log_prob, rollout_is_weights);
    offsets: int64 [b + 1], the sequences' packed boundaries;
    count / sequences: scored tokens / sequences with one (host ints); width: verl's padded response
    axis (its ``loss_mask.shape[-1]``)."""
    scored: Tensor
    advantages: Tensor
    old_logprobs: Tensor
    ref_logprobs: Optional[Tensor]
    rollout_weights: Optional[Tensor]
    offsets: Tensor
    count: int
    sequences: int
    width: int

    @property
    def total(self) -> int:
        return self.scored.numel()

    @property
    def batch(self) -> int:
        """The micro-batch's sequences (verl's padded batch axis, fully masked ones included)."""
        return self.offsets.numel() - 1


def response_tokens(data, *, with_ref: bool) -> tuple[Optional[ResponseTokens], str]:
    """(ResponseTokens, "") for a verl micro-batch, or (None, why) when its layout is not one verl's loss
    reads the way assumed here."""
    from verl.workers.utils.padding import no_padding_2_padding
    input_ids = data["input_ids"]
    if not getattr(input_ids, "is_nested", False):
        return None, "input_ids is not a nested (no-padding) tensor"
    offsets = input_ids.offsets().long()
    dev = offsets.device
    total = int(offsets[-1])
    names = [n for n in FIELDS if n in data.keys() and (n != "ref_log_prob" or with_ref)]
    if with_ref and "ref_log_prob" not in names:
        return None, "use_kl_loss=True but the batch has no ref_log_prob"
    padded = data.select(*names).to_padded_tensor()
    mask = padded["response_mask"].to(dev).bool()
    # position + 1 of every response slot (0: a slot past the sequence's response), verl's own mapping
    slot = no_padding_2_padding(torch.arange(1, total + 1, dtype=torch.long, device=dev), data).to(dev)
    if slot.shape != mask.shape:
        return None, f"verl's response layout {tuple(slot.shape)} differs from response_mask {tuple(mask.shape)}"
    if bool((mask & (slot == 0)).any()):
        return None, "response_mask marks tokens past the end of a response"
    pos = slot[mask] - 1

    def scatter(name):
        out = torch.zeros(total, dtype=torch.float32, device=dev)
        out[pos] = padded[name].to(dev, torch.float32)[mask]
        return out
    scored = torch.zeros(total, dtype=torch.bool, device=dev)
    scored[pos] = True
    return ResponseTokens(scored=scored, advantages=scatter("advantages"), old_logprobs=scatter("old_log_probs"),
                          ref_logprobs=scatter("ref_log_prob") if with_ref else None,
                          rollout_weights=scatter("rollout_is_weights") if "rollout_is_weights" in names else None,
                          offsets=offsets,
                          count=int(pos.numel()), sequences=int(mask.any(dim=-1).sum()),
                          width=int(mask.shape[-1])), ""


@dataclass(frozen=True)
class Rows:
    """Per-token inputs in the layout of the head's rows: labels with IGNORE where not scored; 1-D [n] with
    the sequences' boundaries ``cu_seqlens`` when packed, [b, S] (a row per sequence, cu_seqlens None)
    when padded."""
    labels: Tensor
    advantages: Tensor
    old_logprobs: Tensor
    ref_logprobs: Optional[Tensor]
    rollout_weights: Optional[Tensor]
    cu_seqlens: Optional[Tensor]

    @property
    def sequences(self) -> int:
        """The sequences these rows delimit for the fused loss: cu_seqlens' segments (the packed tail
        padding one of them) or the rows of labels."""
        return self.cu_seqlens.numel() - 1 if self.cu_seqlens is not None else self.labels.shape[0]


def for_rows(tokens: ResponseTokens, labels: Tensor) -> Rows:
    """The inputs laid out like ``labels``, the model's next-token labels: [1, n] packed with
    n >= total (the engine's tail padding, never scored; returned 1-D [n]) or [b, S] with a row per
    sequence (S >= the longest). ValueError for any other shape."""
    dev = labels.device
    b = tokens.offsets.numel() - 1

    def move(t):
        return None if t is None else t.to(dev, non_blocking=True)
    if labels.dim() == 2 and labels.shape[0] == 1 and labels.shape[1] >= tokens.total:
        # packed: one row of every sequence back to back, then the engine's padding (never scored)
        n = labels.shape[1]
        pad = n - tokens.total

        def lay(t, fill):
            if t is None:
                return None
            t = move(t)
            return torch.cat([t, t.new_full((pad,), fill)]) if pad else t
        scored = lay(tokens.scored, False)
        cu = tokens.offsets if not pad else torch.cat([tokens.offsets, tokens.offsets.new_tensor([n])])
        return Rows(torch.where(scored, labels.reshape(-1), IGNORE), lay(tokens.advantages, 0.0),
                    lay(tokens.old_logprobs, 0.0), lay(tokens.ref_logprobs, 0.0), lay(tokens.rollout_weights, 0.0),
                    move(cu))
    lengths = tokens.offsets.diff()
    if labels.dim() == 2 and labels.shape[0] == b and labels.shape[1] >= int(lengths.max()):
        s = labels.shape[1]

        def lay(t, fill):
            if t is None:
                return None
            nested = torch.nested.nested_tensor_from_jagged(t, tokens.offsets)
            return move(torch.nested.to_padded_tensor(nested, fill, output_size=(b, s)))
        scored = lay(tokens.scored.float(), 0.0).bool()
        return Rows(torch.where(scored, labels, IGNORE), lay(tokens.advantages, 0.0), lay(tokens.old_logprobs, 0.0),
                    lay(tokens.ref_logprobs, 0.0), lay(tokens.rollout_weights, 0.0), None)
    raise ValueError(f"labels of shape {tuple(labels.shape)} match neither the packed layout [1, >= {tokens.total}] "
                     f"nor the padded one [{b}, >= {int(lengths.max())}] of this micro-batch")


def thd_destinations(tokens: ResponseTokens, labels: Tensor, cu_padded: Tensor) -> Tensor:
    """int64 [total] on labels' device: the row of verl's packed THD labels [1, n] that holds each packed
    position (sequence i at rows [cu_padded[i], cu_padded[i] + its length): verl pads each sequence to a multiple
    of the TP size, and the tail). ValueError when labels or cu_padded do not fit the micro-batch."""
    lengths = tokens.offsets.diff()
    b = lengths.numel()
    cu = cu_padded.to("cpu", torch.long)
    if labels.dim() != 2 or labels.shape[0] != 1 or cu.dim() != 1 or cu.numel() != b + 1:
        raise ValueError(f"verl's packed labels {tuple(labels.shape)} and cu_seqlens_q_padded {tuple(cu.shape)} do "
                         f"not describe this micro-batch of {b} sequences")
    n = labels.shape[1]
    if int(cu[-1]) > n or bool((cu.diff() < lengths.cpu()).any()):
        raise ValueError(f"cu_seqlens_q_padded {cu.tolist()} leaves less room than the sequences' lengths "
                         f"{lengths.tolist()} in {n} rows (context parallelism splits them?)")
    # packed position p of sequence i -> row cu[i] + (p - offsets[i])
    shift = torch.repeat_interleave(cu[:-1] - tokens.offsets[:-1].cpu(), lengths.cpu())
    return (torch.arange(tokens.total) + shift).to(labels.device)
