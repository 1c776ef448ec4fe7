"""Vocab-parallel and sequence-parallel maths for tensor-parallel groups.

Vocab parallelism (``fused_logprobs(..., tp_group=group)``): each rank holds a contiguous shard of
the LM head's vocabulary rows, in rank order (rank 0 the first rows). Shards may differ in size.
Every rank computes the per-token statistics of its shard; :class:`VocabParallel` combines them into
the statistics of the whole vocabulary with one collective, so every rank returns the full
log-probs and entropy. In backward each rank produces its shard's d_weight and a partial d_hidden
(the contribution of its vocabulary rows), which is all-reduced unless the caller asks otherwise.

Sequence parallelism: :func:`gather_sequence` / :func:`scatter_sequence` move activations between
sequence-sharded and full layouts with the gradients Megatron's sequence-parallel regions use, and
:func:`next_token_labels` / :func:`next_token_labels_sharded` build next-token labels on the global
sequence (a local ``roll`` would give every shard's last token a wrong label).
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from . import checks

__all__ = ["VocabParallel", "gather_sequence", "scatter_sequence", "next_token_labels",
           "next_token_labels_sharded"]

# dtype codes exchanged once per (group, shard) to catch shards of different dtypes across ranks
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# group -> {(local V, H, dtype, device): shard sizes}. Weak, and the values do not refer to the group:
# a cache that kept the group alive would let its gloo/NCCL threads outlive destroy_process_group
# and abort the process at exit.
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _gather_into(out: Tensor, inp: Tensor, group) -> None:
    """all-gather ``inp`` from every rank into ``out`` ([world * inp.shape[0], ...]), rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_into(out: Tensor, inp: Tensor, group) -> None:
    """sum ``inp`` ([world * out.shape[0], ...]) across ranks; this rank keeps its block in ``out``."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _check_group(group, arg: str = "tp_group") -> tuple[int, int]:
    """(rank, world size) of this process in ``group``, or a clear error."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{arg} was given but torch.distributed is not initialised: call "
                           f"torch.distributed.init_process_group first, or pass {arg}=None")
    if group is dist.GroupMember.NON_GROUP_MEMBER:   # what new_group returns to non-members
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of {arg}")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{arg} must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of {arg}")
    return rank, dist.get_world_size(group)


def _exchange_sizes(group, world: int, weight: Tensor) -> tuple:
    """Every rank's shard size, from one all-gather of (V_local, H, dtype code); ValueError, on every
    rank alike, when the shards disagree in H or dtype."""
    code = _DTYPES.index(weight.dtype) if weight.dtype in _DTYPES else -1
    mine = torch.tensor([weight.shape[0], weight.shape[1], code], dtype=torch.int64, device=weight.device)
    every = torch.empty(world * 3, dtype=torch.int64, device=weight.device)
    _gather_into(every, mine, group)
    sizes, hs, codes = (tuple(int(x) for x in col) for col in every.view(world, 3).t().cpu())
    _same_matrix(hs, codes, "weight shards")
    return sizes


def _same_matrix(hs: tuple, codes: tuple, shards: str) -> None:
    """ValueError, on every rank alike, when the ranks' shards (``shards`` names them) differ in H or dtype code."""
    if len(set(hs)) != 1:
        raise ValueError(f"{shards} differ in hidden size across tp_group: H per rank = {list(hs)}; "
                         "every rank must hold rows of the same [V, H] matrix")
    if len(set(codes)) != 1:
        names = [str(_DTYPES[c]) if c >= 0 else "other" for c in codes]
        raise ValueError(f"{shards} differ in dtype across tp_group: dtype per rank = {names}")


@dataclasses.dataclass(frozen=True)
class VocabParallel:
    """Where this rank's vocabulary shard sits in the global vocabulary, and the two collectives.

    Attributes:
        group: the process group the vocabulary is sharded over.
        rank, world_size: this process's rank in ``group`` and the group's size.
        sizes: rows held by each rank, in rank order (global vocabulary = their concatenation).
        vocab_offset: global id of this rank's first row (sum of the sizes of lower ranks).
        vocab_size: global vocabulary size V.
        reduce: whether :meth:`reduce_grad_hidden` all-reduces (see :meth:`with_reduce`).
    """
    group: object
    rank: int
    world_size: int
    sizes: tuple
    vocab_offset: int
    vocab_size: int
    reduce: bool = True

    @classmethod
    def for_group(cls, group, weight: Tensor) -> "VocabParallel":
        """The layout of ``weight`` (this rank's [V_local, H] shard) over ``group``.

        The first call for a given (group, V_local, H, dtype, device) all-gathers the three numbers
        (V_local, H, dtype) once, which gives every rank its offset and lets every rank raise the same
        ValueError when the shards disagree in H or dtype; later calls are a dictionary look-up. All
        ranks of the group must call it together (it is called by every ``fused_logprobs``), and a
        rank's shard size must not change unless every rank's does.

        Raises RuntimeError when torch.distributed is not initialised, TypeError when ``group`` is
        not a ProcessGroup, ValueError when this process is not in it or the shards disagree.
        """
        rank, world = _check_group(group)
        per_group = _LAYOUTS.setdefault(group, {})
        key = (int(weight.shape[0]), int(weight.shape[1]), weight.dtype, weight.device)
        sizes = per_group.get(key)
        if sizes is None:
            sizes = per_group[key] = _exchange_sizes(group, world, weight)
        return cls(group=group, rank=rank, world_size=world, sizes=sizes,
                   vocab_offset=sum(sizes[:rank]), vocab_size=sum(sizes))

    def check_same_rows(self, weight: Tensor, name: str, ref_name: str) -> None:
        """ValueError on every rank alike unless ``weight`` (another head's shard, e.g. a teacher's) holds as
        many rows as this layout's shard on every rank, with one H and dtype across the group. One all-gather
        of four numbers and a host read on *every* call (not cached: a shard that differs on one rank after a
        first call must still be refused everywhere, not leave the other ranks in a mismatched collective)."""
        code = _DTYPES.index(weight.dtype) if weight.dtype in _DTYPES else -1
        mine = torch.tensor([self.sizes[self.rank], weight.shape[0], weight.shape[1], code], dtype=torch.int64,
                            device=weight.device)
        every = torch.empty(self.world_size * 4, dtype=torch.int64, device=weight.device)
        _gather_into(every, mine, self.group)
        ref, rows, hs, codes = (tuple(int(x) for x in col) for col in every.view(self.world_size, 4).t().cpu())
        if rows != ref:
            raise ValueError(f"{name}'s vocabulary shards {rows} differ from {ref_name}'s {ref} over tp_group: "
                             "both heads must be sharded the same way")
        _same_matrix(hs, codes, f"{name}'s shards")

    def with_reduce(self, reduce: bool) -> "VocabParallel":
        """This layout with :meth:`reduce_grad_hidden` all-reducing (True) or passing through (False)."""
        return self if reduce == self.reduce else dataclasses.replace(self, reduce=reduce)

    def combine_stats(self, lse: Tensor, ent: Optional[Tensor], zy: Tensor):
        """Per-shard statistics -> statistics of the whole vocabulary, identical on every rank.

        Args (float32 [N], this rank's shard only): lse = logsumexp of the shard's logits; ent = the
        entropy of the softmax over the shard alone (None when not wanted); zy = the label's logit,
        0 where this shard does not hold the label.

        Returns (lse, ent, zy) of the whole vocabulary, float32 [N] (ent None when given None):
            lse = logsumexp_r lse_r
            ent = sum_r w_r * (ent_r + lse - lse_r),  w_r = exp(lse_r - lse)
                  (entropy of a mixture: the shards' entropies plus that of the weights w_r; every
                  term is >= 0, so nothing cancels)
            zy  = sum_r zy_r  (exactly one rank holds the label)

        One collective: the 2 or 3 vectors are packed into one [k, N] tensor and all-gathered.
        The alternative, an all-reduce of the max and then one of the rescaled sums, needs two
        collectives back to back; at these sizes (k*N floats, a few MB at most) each collective costs
        mostly latency, so one all-gather (W*k*N floats received) is the faster choice for usual
        group sizes (<= 8). It also makes every rank evaluate the same formula on the same numbers,
        so the results are bitwise identical on every rank.
        """
        parts = [lse, zy] if ent is None else [lse, zy, ent]
        mine = torch.stack(parts).float()
        # flat buffers: some backends (gloo) only accept the concatenated form of the output
        every = mine.new_empty(self.world_size * mine.numel())
        _gather_into(every, mine.view(-1), self.group)
        every = every.view((self.world_size,) + tuple(mine.shape))
        # Sums over the ranks one rank at a time, in rank order, with elementwise ops: a token's result is then
        # a function of its own numbers only, whatever N is (a torch reduction over dim 0 may split or reorder
        # the ranks by N on a GPU). The max is exact in any order.
        lse_r, zy_r = every[:, 0], every[:, 1]
        top = lse_r.amax(dim=0)
        total = torch.zeros_like(top)
        zy_all = torch.zeros_like(top)
        for r in range(self.world_size):
            total += torch.exp(lse_r[r] - top)
            zy_all += zy_r[r]
        lse_all = top + torch.log(total)
        ent_all = None
        if ent is not None:
            ent_all = torch.zeros_like(top)
            for r in range(self.world_size):
                shift = lse_all - lse_r[r]          # -log w_r >= 0
                ent_all += torch.exp(-shift) * (every[r, 2] + shift)
        return lse_all, ent_all, zy_all

    def gather_rows(self, mine: Tensor) -> Tensor:
        """[world_size, *mine.shape]: every rank's ``mine`` (same shape and dtype on every rank), in rank order;
        one all-gather."""
        every = mine.new_empty(self.world_size * mine.numel())
        _gather_into(every, mine.contiguous().view(-1), self.group)
        return every.view((self.world_size,) + tuple(mine.shape))

    def reduce_grad_hidden(self, dh: Tensor) -> Tensor:
        """float32 [N, H] partial d_hidden of this shard -> the full d_hidden (sum over the group) when
        ``reduce`` is True, else unchanged (the caller's own region op will reduce it)."""
        if self.reduce and self.world_size > 1:
            dist.all_reduce(dh, group=self.group)
        return dh


# ---------------------------------------------------------------------------- sequence parallel

def _norm_dim(x: Tensor, dim, arg: str = "dim") -> int:
    checks.integer(dim, arg)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{arg}={dim} is out of range for a tensor of {x.dim()} dimensions")
    return dim % x.dim()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int, world: int):
        ctx.group, ctx.dim, ctx.world = group, dim, world
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((world * local.shape[0],) + tuple(local.shape[1:]))
        _gather_into(out, local, group)
        return out.movedim(0, dim).contiguous() if dim else out

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad.movedim(ctx.dim, 0).contiguous()
        out = g.new_empty((g.shape[0] // ctx.world,) + tuple(g.shape[1:]))
        _reduce_scatter_into(out, g, ctx.group)
        return (out.movedim(0, ctx.dim).contiguous() if ctx.dim else out), None, None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, dim: int, rank: int, world: int):
        ctx.group, ctx.dim, ctx.world = group, dim, world
        step = x.shape[dim] // world
        return x.narrow(dim, rank * step, step).contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = grad.movedim(ctx.dim, 0).contiguous()
        out = g.new_empty((ctx.world * g.shape[0],) + tuple(g.shape[1:]))
        _gather_into(out, g, ctx.group)
        return (out.movedim(0, ctx.dim).contiguous() if ctx.dim else out), None, None, None, None


def gather_sequence(x: Tensor, group, dim: int = 0) -> Tensor:
    """All-gather sequence shards along ``dim``, in rank order: [.., S/W, ..] -> [.., S, ..].

    Every rank must hold a shard of the same shape (Megatron's sequence parallelism splits the
    sequence evenly). Backward reduce-scatters (sums) the gradient, so each rank gets the sum over
    the group of the gradients w.r.t. its shard. That sum is the reduction of d_hidden across the
    tensor-parallel group, so call ``fused_logprobs(..., reduce_grad_hidden=False)`` on the result:
    with the default True the gradient would be reduced twice (W times too large).

    Args: x any shape and dtype; group a ProcessGroup; dim the sequence dimension (0 for Megatron's
    [s, b, h]). Returns a new tensor of x's dtype with dim W times longer.
    """
    checks.tensor(x, "x")
    _, world = _check_group(group, "group")
    dim = _norm_dim(x, dim)
    return _GatherSequence.apply(x, group, dim, world)


def scatter_sequence(x: Tensor, group, dim: int = 0) -> Tensor:
    """The inverse of :func:`gather_sequence`: keep this rank's contiguous 1/W of ``dim``.

    Backward all-gathers the gradient (each rank's gradient covers only its own block). The size
    along ``dim`` must be divisible by the group size (ValueError otherwise).
    """
    checks.tensor(x, "x")
    rank, world = _check_group(group, "group")
    dim = _norm_dim(x, dim)
    if x.shape[dim] % world:
        raise ValueError(f"x has size {x.shape[dim]} along dim {dim}, not divisible by the group size {world}")
    return _ScatterSequence.apply(x, group, dim, rank, world)


# ------------------------------------------------------------------------ next-token labels

def _check_ids(input_ids, arg: str) -> Tensor:
    checks.tensor(input_ids, arg)
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"{arg} must hold integer token ids, got {input_ids.dtype}")
    if input_ids.dim() == 0:
        raise ValueError(f"{arg} must have a sequence dimension, got a scalar")
    return input_ids


def next_token_labels(input_ids: Tensor, *, ignore_index: int = -100, dim: int = -1) -> Tensor:
    """Labels for next-token prediction: labels[t] = input_ids[t + 1] along ``dim``, and the last
    position = ``ignore_index``. Same shape and dtype as ``input_ids`` ([b, s] with dim=-1, or
    [s, b] with dim=0). Use it on the *global* sequence; for a sequence-sharded one use
    :func:`next_token_labels_sharded`."""
    ids = _check_ids(input_ids, "input_ids")
    dim = _norm_dim(ids, dim)
    ignore_index = checks.ignore_index(ignore_index)
    labels = torch.full_like(ids, ignore_index)
    s = ids.shape[dim]
    if s > 1:
        labels.narrow(dim, 0, s - 1).copy_(ids.narrow(dim, 1, s - 1))
    return labels


def next_token_labels_sharded(local_ids: Tensor, group, *, dim: int = -1, ignore_index: int = -100) -> Tensor:
    """:func:`next_token_labels` of the global sequence, for a rank holding one contiguous shard of it.

    ``local_ids`` is this rank's slice along ``dim`` of the global ids; shards are in rank order and
    may differ in length (even be empty), but agree in every other dimension. The last label of
    each shard is the first token of the next non-empty shard, fetched with one small all-gather of
    every rank's first token slice; the global last position gets ``ignore_index``.
    Returns labels of local_ids' shape and dtype. Every rank of ``group`` must call it together.

    Not for Megatron's context parallelism with load balancing, whose shards are not contiguous:
    there, build labels on the global sequence with :func:`next_token_labels` before splitting.
    """
    ids = _check_ids(local_ids, "local_ids")
    rank, world = _check_group(group, "group")
    dim = _norm_dim(ids, dim)
    ignore_index = checks.ignore_index(ignore_index)
    labels = next_token_labels(ids, ignore_index=ignore_index, dim=dim)
    n = ids.shape[dim]
    slice_shape = list(ids.shape)
    slice_shape[dim] = 1
    # [has tokens, first token slice...] per rank; int64 so any id dtype and ignore_index fit
    mine = torch.full([1 + math.prod(slice_shape)], ignore_index, dtype=torch.int64, device=ids.device)
    mine[0] = int(n > 0)
    if n > 0:
        mine[1:] = ids.narrow(dim, 0, 1).reshape(-1)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=ids.device)
    _gather_into(every, mine, group)
    every = every.view(world, -1)
    if n > 0:
        nonempty = every[rank + 1:, 0].nonzero()
        if nonempty.numel():
            nxt = rank + 1 + int(nonempty[0, 0])
            labels.narrow(dim, n - 1, 1).copy_(every[nxt, 1:].view(slice_shape).to(labels.dtype))
    return labels


