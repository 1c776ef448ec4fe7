"""Which token each position is scored against, and at which temperature, for a [b, s] batch.

Conventions (the ones transformers uses for attention, so scoring and attention agree):
- padding: ``attention_mask`` [b, s], 0 marks a pad (left or right);
- packed (padding-free) rows: a new sequence starts wherever ``position_ids`` does not step by
  exactly +1 from the previous position (usually a restart at 0), as in
  ``transformers.masking_utils.find_packed_sequence_indices``.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .. import checks


def _check_2d(name: str, value, shape) -> Tensor:
    checks.tensor(value, name)
    if value.dim() != 2 or tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape [batch, seq] = {list(shape)}, got {list(value.shape)}")
    return value


def continues(position_ids: Optional[Tensor], shape) -> Optional[Tensor]:
    """bool [b, s-1]: True where token t+1 continues the sequence of token t (positions step by +1).
    None when there are no position_ids (every row is one sequence). position_ids [b, s] or [1, s]."""
    if position_ids is None:
        return None
    checks.tensor(position_ids, "position_ids")
    if position_ids.dim() != 2 or position_ids.shape[1] != shape[1] or position_ids.shape[0] not in (1, shape[0]):
        raise ValueError(f"position_ids must have shape [batch, seq] = {list(shape)} (or [1, seq]) to find "
                         f"sequence boundaries, got {list(position_ids.shape)}; pass labels explicitly instead")
    step = position_ids[:, 1:] - position_ids[:, :-1]
    return (step == 1).expand(shape[0], shape[1] - 1)


def check_packing_attended(attention_mask, position_ids, shape, cached: bool) -> None:
    """ValueError when ``position_ids`` restart inside a row (padding-free packing, which logitless scores as
    separate sequences) while the model would attend across the restart: transformers reads packing from
    position_ids only without an attention mask and without a cache
    (``masking_utils.find_packed_sequence_indices``); with either, every token attends to the packed sequences
    before it, and the log-probs would be neither the packed sequences' nor the one sequence's. Restarts
    inside padding (left-padded rows' position_ids) are not packing. Other layouts of position_ids (a
    multimodal model's [3, b, s]) say nothing about packing here."""
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or (attention_mask is None and not cached):
        return
    step_ok = continues(position_ids, shape)
    if step_ok is None:
        return
    restarts = ~step_ok
    if attention_mask is not None and not cached:
        mask = _check_2d("attention_mask", attention_mask, shape) != 0
        restarts = restarts & mask[:, :-1] & mask[:, 1:]
    if not bool(restarts.any()):
        return
    given = "a cache (use_cache=True or past_key_values)" if cached else "attention_mask"
    raise ValueError(f"position_ids restart inside a row (packed sequences) and {given} is given: transformers "
                     "then attends across the packed sequences, while logitless scores them apart; for "
                     "padding-free packing pass attention_mask=None and no cache, or give each sequence its own "
                     "row with an attention_mask")


def targets_from_input_ids(input_ids: Tensor, attention_mask: Optional[Tensor], position_ids: Optional[Tensor],
                      ignore_index: int) -> Tensor:
    """int64 [b, s]: labels[t] = input_ids[t+1], or ``ignore_index`` where t is the last position,
    t or t+1 is padding, or t+1 starts another packed sequence."""
    checks.index_tensor(input_ids, "input_ids")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, seq], got {list(input_ids.shape)}")
    shape = input_ids.shape
    keep = torch.ones(shape[0], max(shape[1] - 1, 0), dtype=torch.bool, device=input_ids.device)
    if attention_mask is not None:
        mask = _check_2d("attention_mask", attention_mask, shape)
        if mask.is_floating_point():
            raise TypeError("attention_mask must be a 0/1 integer or bool [batch, seq] mask to derive labels; "
                            f"got {mask.dtype}. Pass labels explicitly with a custom mask.")
        mask = mask != 0
        keep &= mask[:, :-1] & mask[:, 1:]
    step_ok = continues(position_ids, shape)
    if step_ok is not None:
        keep &= step_ok
    labels = torch.full(shape, ignore_index, dtype=torch.long, device=input_ids.device)
    labels[:, :-1] = torch.where(keep, input_ids[:, 1:].long(), labels[:, :-1])
    return labels


def targets_from_unshifted_labels(labels: Tensor, position_ids: Optional[Tensor], ignore_index: int) -> Tensor:
    """Unshifted labels (transformers' ``labels=`` convention, label[t] is token t itself) to
    per-position targets: out[t] = labels[t+1], never across a packed-sequence boundary."""
    out = torch.full_like(labels, ignore_index, dtype=torch.long)
    nxt = labels[:, 1:].long()
    step_ok = continues(position_ids, labels.shape)
    if step_ok is not None:
        nxt = torch.where(step_ok, nxt, torch.full_like(nxt, ignore_index))
    out[:, :-1] = nxt
    return out


def check_labels(labels, shape) -> Tensor:
    return checks.index_tensor(_check_2d("labels", labels, shape), "labels")


def per_token_temperature(temperature: Union[float, Tensor], shape, position_ids: Optional[Tensor],
                          device: torch.device) -> Union[float, Tensor]:
    """A positive float, or float32 [b, s]. Tensor forms: 0-d; [b] or [b, 1] per sequence (row);
    [b, s] per token; and for one packed row ([1, s]), [n] with one value per packed sequence."""
    t = checks.temperature(temperature, device=device, max_dim=2)
    if isinstance(t, Tensor):
        b, s = shape
        if t.dim() == 0:
            t = t.expand(b, s)
        elif t.dim() == 1 and t.shape[0] == b:
            t = t[:, None].expand(b, s)
        elif t.dim() == 1 and b == 1 and position_ids is not None:
            step_ok = continues(position_ids, shape)
            segment = torch.cat([step_ok.new_zeros(1, 1, dtype=torch.long), (~step_ok).long().cumsum(1)], 1)
            n = int(segment[0, -1]) + 1
            if t.shape[0] != n:
                raise ValueError(f"temperature has {t.shape[0]} values but the packed row holds {n} sequences")
            t = t[segment]
        elif t.dim() == 2 and t.shape[0] == b and t.shape[1] in (1, s):
            t = t.expand(b, s)
        else:
            raise ValueError(f"temperature of shape {list(temperature.shape)} fits neither a scalar, [batch]="
                             f"[{b}], [batch, 1] nor [batch, seq]=[{b}, {s}]")
    return t


def packed_cu_seqlens(position_ids: Optional[Tensor], shape) -> Optional[Tensor]:
    """int64 [k + 1] boundaries of the packed sequences of one padding-free row ([1, s] with
    ``position_ids`` restarting per sequence), or None when the batch is not such a row (then each row
    is one sequence)."""
    if position_ids is None or shape[0] != 1 or shape[1] < 2:
        return None
    step_ok = continues(position_ids, shape)[0]
    starts = (~step_ok).nonzero().squeeze(1) + 1
    if starts.numel() == 0:
        return None
    edges = [starts.new_zeros(1), starts, starts.new_full((1,), shape[1])]
    return torch.cat(edges).long()
