"""The fused policy loss under verl's Ulysses sequence parallelism (FSDP engine, ``ulysses_sequence_parallel_size``
> 1, remove-padding).

verl slices each packed micro-batch along the sequence across the sp group: every rank's head sees the hidden
states of its slice ([n / sp] rows of the padded packed sequence), and verl all-gathers the per-token outputs
before its loss (``gather_outputs_and_unpad``, whose backward multiplies by sp before taking the rank's slice,
so that FSDP's average over the ranks gives the whole sequence's gradient). The fused loss needs whole
sequences (the sequence aggregations, the sequence-level ratios, geo_mean) and the whole micro-batch (clip_cov,
kl_cov), so the head's rows are all-gathered first, with verl's own ``Gather`` (the same backward), and every
rank computes the micro-batch's fused loss: its d_hidden reaches the rank's slice times sp, as verl's log-probs'
gradient does, and its d_weight is the whole micro-batch's on every rank, which FSDP's average keeps. The head
then returns the rank's slice of the log-probs and entropies, which verl gathers as usual.

The loss leaves the model through the rank's own slice of the gathered log-probs (``carrier``): one element the
rank owns, divided by sp (the gather's backward multiplies it back), so each rank backpropagates its fused loss
exactly once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Shard:
    """This rank's slice [start, stop) of the gathered rows, and the sp group's size."""
    start: int
    stop: int
    size: int


def group():
    """verl's Ulysses sp group while the engine runs its model (None outside, or of size 1)."""
    from verl.utils.ulysses import get_ulysses_sequence_parallel_group, get_ulysses_sequence_parallel_world_size
    grp = get_ulysses_sequence_parallel_group()
    return grp if grp is not None and get_ulysses_sequence_parallel_world_size(grp) > 1 else None


def gather(hidden: torch.Tensor, labels: torch.Tensor, grp) -> tuple[torch.Tensor, torch.Tensor, Shard]:
    """(hidden [n, H], labels [n], this rank's Shard) from the rank's slices hidden [n / sp, H] (gradient:
    verl's Gather, times sp on the rank's slice) and labels [n / sp] (no gradient)."""
    import torch.distributed as dist
    from verl.utils.ulysses import Gather
    size, rank = dist.get_world_size(grp), dist.get_rank(grp)
    local = hidden.shape[0]
    full = Gather.apply(grp, hidden, 0, True)
    parts = [torch.empty_like(labels) for _ in range(size)]
    dist.all_gather(parts, labels.contiguous(), group=grp)
    return full, torch.cat(parts), Shard(rank * local, (rank + 1) * local, size)


def empty_rank(total: int, size: int, bucket_pad: int = 0) -> Optional[str]:
    """Why a packed micro-batch of ``total`` tokens cannot run fused over ``size`` sp ranks (a rank whose slice
    holds only padding has no output element to carry its loss), else None. bucket_pad: the engine's padding
    to its length bucket (``pad_to_length``), added before the sp padding."""
    local = -(-(total + bucket_pad) // size)
    if (size - 1) * local >= total:
        return (f"ulysses_sequence_parallel_size={size} with a micro-batch of {total} packed tokens"
                f"{f' padded to {total + bucket_pad}' if bucket_pad else ''} (the last rank's slice is padding "
                "only)")
    return None
