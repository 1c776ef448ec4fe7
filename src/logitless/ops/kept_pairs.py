"""The raw products of (token, vocabulary id) pairs and their gradients: what a truncated distribution needs once
its kept set is fixed.

A kept set holds a few ids per token (a nucleus, a top-k) and its size varies from token to token, so the pairs are
flat: ``rows`` [P] (the token of each pair) and ``ids`` [P] (the id, a row of this rank's weight shard, -1 for an id
another rank holds). raw[p] = <hidden[rows[p]], weight[ids[p]]> in float32, in blocks of bounded workspace; the
cost is P x H, not tokens x V. Under tensor parallelism each rank fills the pairs of its own shard and the sum over
the group (one all-reduce of P floats) gives every rank every product; the backward adds each rank's own rows to
d_weight and its part of d_hidden, all-reduced when the caller asks.

On CUDA tensors where triton imports (the rule of ``registry.choose_backend``'s "auto"), Triton kernels
(``triton.pair_products``) do the three products, reading each pair's rows once in their own dtype; the torch
gathers below (float32 copies of the rows) are the CPU path and what the kernels are tested against.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import knobs
from .label_sets import GATHER_ELEMENTS, add_onehot_dw


def _blocks(pairs: int, h: int):
    step = max(1, GATHER_ELEMENTS // max(1, h))
    for start in range(0, pairs, step):
        yield start, min(start + step, pairs)


def _kernels(hidden: Tensor, weight: Tensor):
    """The Triton kernels of the pairs for CUDA tensors where triton imports, else None (the torch path)."""
    path = knobs.pairs_path()
    if path == "torch" or (path == "auto" and not (hidden.is_cuda and weight.is_cuda)):
        return None
    try:
        from .triton import pair_products as kernels
        from .triton.common import INTERPRETING
    except ImportError:
        return None
    if not (INTERPRETING or (hidden.is_cuda and weight.is_cuda)):
        raise ValueError("LOGITLESS_PAIRS_PATH=triton needs CUDA tensors (or TRITON_INTERPRET=1): compiled kernels "
                         f"cannot read tensors on {hidden.device} / {weight.device}")
    return kernels


def pair_products(hidden: Tensor, weight: Tensor, rows: Tensor, ids: Tensor) -> Tensor:
    """raw [P] float32 = <hidden[rows[p]], weight[ids[p]]> (upcast to float32, summed in float32), 0 where
    ids[p] == -1."""
    kernels = _kernels(hidden, weight)
    if kernels is not None:
        return kernels.pair_products(hidden, weight, rows, ids)
    raw = torch.zeros(rows.shape, dtype=torch.float32, device=hidden.device)
    for start, stop in _blocks(rows.numel(), hidden.shape[1]):
        h = hidden.index_select(0, rows[start:stop]).float()
        w = weight.index_select(0, ids[start:stop].clamp(min=0)).float()
        raw[start:stop] = (h * w).sum(dim=1)
    return torch.where(ids >= 0, raw, torch.zeros_like(raw))


def add_pairs_dh(dh: Tensor, weight: Tensor, rows: Tensor, ids: Tensor, coef: Tensor) -> None:
    """dh [N, H] float32 += coef[p] * weight[ids[p]] at row rows[p], for ids >= 0."""
    kernels = _kernels(dh, weight)
    if kernels is not None:
        kernels.add_pairs_dh(dh, weight, rows, ids, coef)
        return
    c = torch.where(ids >= 0, coef, torch.zeros_like(coef))
    for start, stop in _blocks(rows.numel(), weight.shape[1]):
        w = weight.index_select(0, ids[start:stop].clamp(min=0)).float()
        dh.index_add_(0, rows[start:stop], w * c[start:stop].unsqueeze(1))


def add_pairs_dw(dw: Tensor, hidden: Tensor, rows: Tensor, ids: Tensor, coef: Tensor) -> None:
    """dw [V_local, H] (the weight's dtype) += coef[p] * hidden[rows[p]] at row ids[p], for ids >= 0: the pairs
    summed in float32 and added to dw, once per id by the Triton kernels, once per id and block of pairs on the
    torch path (``label_sets.add_onehot_dw``)."""
    kernels = _kernels(hidden, dw)
    if kernels is not None:
        kernels.add_pairs_dw(dw, hidden, rows, ids, coef)
        return
    add_onehot_dw(dw, hidden, ids.unsqueeze(1), coef.unsqueeze(1), rows=rows)


class PairProducts(torch.autograd.Function):
    """raw [P] float32 of the pairs (summed over the group's shards under ``group``), differentiable w.r.t.
    hidden [N, H] and weight [V_local, H]: d_hidden gathers weight rows, d_weight adds hidden rows at the ids;
    d_hidden is all-reduced over ``group`` when ``reduce`` is True."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, rows: Tensor, ids: Tensor, group, reduce: bool,
                known: Optional[Tensor] = None, given: Optional[Tensor] = None) -> Tensor:
        if given is None:
            raw = pair_products(hidden, weight, rows, ids)
            if group is not None:
                dist.all_reduce(raw, group=group)
        else:
            # the products a selection pass already formed (global under tensor parallelism): only the rest are
            # multiplied (and summed over the group)
            todo = (~given).nonzero().squeeze(1)
            part = pair_products(hidden, weight, rows.index_select(0, todo), ids.index_select(0, todo))
            if group is not None:
                dist.all_reduce(part, group=group)
            raw = known.float().index_put((todo,), part)
        ctx.save_for_backward(hidden, weight, rows, ids)
        ctx.group, ctx.reduce = group, reduce
        return raw

    @staticmethod
    def backward(ctx, g: Tensor):
        hidden, weight, rows, ids = ctx.saved_tensors
        g = g.float()
        dh = dw = None
        if ctx.needs_input_grad[0]:
            dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
            add_pairs_dh(dh, weight, rows, ids, g)
            if ctx.group is not None and ctx.reduce:
                dist.all_reduce(dh, group=ctx.group)
            dh = dh.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.zeros_like(weight)
            add_pairs_dw(dw, hidden, rows, ids, g)
        return dh, dw, None, None, None, None, None, None


def pair_logits(hidden: Tensor, weight: Tensor, rows: Tensor, ids: Tensor, inv_temp: Tensor,
                softcap: Optional[float], group=None, reduce: bool = True, known: Optional[Tensor] = None,
                given: Optional[Tensor] = None) -> Tensor:
    """z [P] float32, differentiable: the pairs' logits as the fused ops form them (``maths.logits_from_products``:
    raw / temperature, or tanh(raw / c) * (c / temperature) with a softcap); inv_temp [N] per token. ``known`` [P]
    float32: raw products already formed where ``given`` [P] bool (the forward takes them as they are; the backward
    is the same for every pair)."""
    raw = PairProducts.apply(hidden, weight, rows, ids, group, reduce, known, given)
    scale = inv_temp.index_select(0, rows)
    if softcap is None:
        return raw * scale
    return torch.tanh(raw / softcap) * (scale * softcap)
