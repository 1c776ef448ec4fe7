"""Packing for Megatron's THD layout, padding for TP x CP (x FP8), and the zigzag CP split.

Packed layout: the sequences one after another in one row of T tokens, each padded at its end to
a multiple of ``align`` (pads are token 0, position p continues counting, label ``ignore_index``).
``cu_seqlens_padded`` [n + 1] int32 holds the padded boundaries; attention uses them for q and kv,
so a sequence's trailing pads see only that sequence and, causally, no real token sees them.

Context parallelism with load balancing ("zigzag"): each padded sequence is cut into 2 * cp equal
chunks and rank r keeps chunks r and 2 * cp - 1 - r, so every rank gets the same causal work.
Labels are built on the global packed sequence *before* the split (rolling a shard would give its
last token the wrong label).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from .. import checks
from ..parallel import next_token_labels


def pad_multiple(tp_size: int = 1, cp_size: int = 1, fp8_align: Optional[int] = None) -> int:
    """The multiple every packed sequence is padded to.

    - TP: sequence parallelism splits the tokens evenly over the TP ranks -> multiple of tp.
    - CP: zigzag cuts each sequence into 2 * cp chunks -> multiple of 2 * cp (cp > 1).
    - FP8 (``fp8_align``, 16, or 32 for MXFP8): each CP rank's token count enters the FP8 GEMMs,
      which need it aligned -> a multiple of fp8_align * cp.
    """
    checks.integer(tp_size, "tp_size", minimum=1)
    checks.integer(cp_size, "cp_size", minimum=1)
    align = tp_size * cp_size * (2 if cp_size > 1 else 1)
    if fp8_align is not None:
        checks.integer(fp8_align, "fp8_align", minimum=1)
        align = math.lcm(align, fp8_align * cp_size)
    return align


@dataclass
class PackedBatch:
    """Sequences packed for THD. Shapes: T total padded tokens, n sequences.

    tokens [T] int64; positions [T] int64 (restart at 0 per sequence); labels [T] int64
    (next token of the same sequence, ``ignore_index`` at each sequence's last real token and at
    pads); lengths / padded_lengths [n] int64; cu_seqlens / cu_seqlens_padded [n + 1] int32;
    max_seqlen_padded the longest padded sequence.
    """
    tokens: Tensor
    positions: Tensor
    labels: Tensor
    lengths: Tensor
    padded_lengths: Tensor
    cu_seqlens: Tensor
    cu_seqlens_padded: Tensor
    max_seqlen_padded: int
    align: int

    @property
    def total(self) -> int:
        return int(self.tokens.shape[0])

    def real_mask(self) -> Tensor:
        """[T] bool, True at real (non-pad) tokens."""
        return self.local_index() < self.lengths.repeat_interleave(self.padded_lengths)

    def local_index(self) -> Tensor:
        """[T] int64: each token's index inside its own padded sequence."""
        starts = self.cu_seqlens_padded[:-1].long().repeat_interleave(self.padded_lengths)
        return torch.arange(self.total, device=self.tokens.device) - starts


def _cumsum0(x: Tensor) -> Tensor:
    return torch.cat([x.new_zeros(1), x.cumsum(0)]).to(torch.int32)


def _build(tokens_list: Sequence[Tensor], lengths: Tensor, align: int, ignore_index: int) -> PackedBatch:
    align = checks.integer(align, "align", minimum=1)     # each sequence padded to a multiple of it
    ignore_index = checks.ignore_index(ignore_index)
    padded = (lengths + align - 1) // align * align
    padded = torch.where(lengths == 0, torch.full_like(padded, align), padded)  # keep every sequence
    dev = lengths.device
    total = int(padded.sum())
    tokens = torch.zeros(total, dtype=torch.int64, device=dev)
    cu_padded = _cumsum0(padded)
    for i, t in enumerate(tokens_list):
        start = int(cu_padded[i])
        tokens[start:start + t.numel()] = t.to(torch.int64)
    batch = PackedBatch(tokens, None, None, lengths, padded, _cumsum0(lengths), cu_padded,
                        int(padded.max()) if padded.numel() else 0, align)
    idx = batch.local_index()
    batch.positions = idx
    labels = next_token_labels(tokens, ignore_index=ignore_index)
    # the last real token of each sequence (and every pad) has no next token in its sequence
    batch.labels = torch.where(idx + 1 < lengths.repeat_interleave(padded), labels,
                               torch.full_like(labels, ignore_index))
    return batch


def pack_sequences(sequences: Sequence[Tensor], align: int = 1, ignore_index: int = -100) -> PackedBatch:
    """Pack a list of 1-D integer token tensors (ragged lengths, at least one)."""
    if not isinstance(sequences, (list, tuple)) or not sequences:
        raise TypeError("sequences must be a non-empty list of 1-D token tensors")
    for i, s in enumerate(sequences):
        if not isinstance(s, Tensor) or s.dim() != 1 or s.is_floating_point() or s.dtype == torch.bool:
            raise TypeError(f"sequences[{i}] must be a 1-D integer tensor, got "
                            f"{getattr(s, 'dtype', type(s).__name__)} {tuple(getattr(s, 'shape', ()))}")
    dev = sequences[0].device
    lengths = torch.tensor([s.numel() for s in sequences], dtype=torch.int64, device=dev)
    return _build(sequences, lengths, align, ignore_index)


def check_padded(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Validate a padded batch; returns attention_mask as bool [b, s] (True = real token)."""
    checks.tensor(input_ids, "input_ids")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [b, s] tensor, got shape {tuple(input_ids.shape)}")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    if attention_mask.is_floating_point():
        raise TypeError(f"attention_mask must be bool or integer (1 = token, 0 = pad), got {attention_mask.dtype}")
    return attention_mask.to(device=input_ids.device).bool()


def pack_padded(input_ids: Tensor, attention_mask: Tensor, align: int = 1,
                ignore_index: int = -100) -> PackedBatch:
    """Pack the real tokens (attention_mask true; any pattern, e.g. left-padded prompts followed
    by right-padded responses) of each row of ``input_ids`` [b, s], in order."""
    mask = check_padded(input_ids, attention_mask)
    rows = [input_ids[i][mask[i]] for i in range(input_ids.shape[0])]
    return _build(rows, mask.sum(1), align, ignore_index)


def pack_like(values: Tensor, mask: Tensor, batch: PackedBatch, fill=0) -> Tensor:
    """Place per-token ``values`` [b, s, ...] (real tokens where ``mask``) into the packed layout
    [T, ...] of ``batch`` (pads get ``fill``)."""
    dest = packed_index(mask, batch)
    out = values.new_full((batch.total,) + tuple(values.shape[2:]), fill)
    out[dest[mask]] = values[mask]
    return out


def packed_index(mask: Tensor, batch: PackedBatch) -> Tensor:
    """[b, s] int64: where each real token of the padded batch sits in the packed layout
    (meaningless where mask is False)."""
    mask = mask.bool()
    starts = batch.cu_seqlens_padded[:-1].long().unsqueeze(1)
    return starts + mask.long().cumsum(1) - 1


def unpack_to_padded(values: Tensor, mask: Tensor, batch: PackedBatch, fill: float = 0.0) -> Tensor:
    """Inverse of packing: values [T, ...] -> [b, s, ...] (``fill`` at pads). Differentiable."""
    mask = mask.bool()
    dest = packed_index(mask, batch).clamp(min=0)
    picked = values[dest]
    m = mask.view(mask.shape + (1,) * (values.dim() - 1))
    return torch.where(m, picked, torch.full_like(picked, fill))


def unpack_to_list(values: Tensor, batch: PackedBatch) -> list[Tensor]:
    """values [T, ...] -> one [length_i, ...] tensor per sequence (pads dropped). Differentiable."""
    out = []
    for i in range(batch.lengths.numel()):
        start = int(batch.cu_seqlens_padded[i])
        out.append(values[start:start + int(batch.lengths[i])])
    return out


def zigzag_index(cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int) -> Tensor:
    """[T / cp] int64: positions in the packed layout that CP rank ``cp_rank`` holds, in its order
    (per sequence: chunk cp_rank, then chunk 2 * cp - 1 - cp_rank, of 2 * cp equal chunks)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must lie in [0, {cp_size}), got {cp_rank}")
    cu = cu_seqlens_padded.long().tolist()
    parts = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        n = end - start
        if n % (2 * cp_size):
            raise ValueError(f"a packed sequence of {n} tokens cannot be split into 2 * cp = {2 * cp_size} "
                             "equal chunks: pad with pad_multiple(cp_size=...)")
        c = n // (2 * cp_size)
        for k in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + k * c, start + (k + 1) * c))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=cu_seqlens_padded.device)
    return torch.cat(parts).to(cu_seqlens_padded.device)


def zigzag_split(x: Tensor, cu_seqlens_padded: Tensor, cp_size: int, cp_rank: int, dim: int = 0) -> Tensor:
    """This CP rank's part of packed ``x`` (packed along ``dim``); identity for cp_size 1."""
    if cp_size == 1:
        return x
    return x.index_select(dim, zigzag_index(cu_seqlens_padded, cp_size, cp_rank).to(x.device))


def zigzag_merge(parts: Sequence[Tensor], cu_seqlens_padded: Tensor, dim: int = 0) -> Tensor:
    """Inverse of ``zigzag_split``: every CP rank's part (in rank order) -> the packed tensor.
    Differentiable w.r.t. every part."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    index = torch.cat([zigzag_index(cu_seqlens_padded, cp_size, r) for r in range(cp_size)])
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel(), device=index.device)
    return torch.cat(list(parts), dim=dim).index_select(dim, inverse.to(parts[0].device))
