"""The one autograd Function: glues a backend's two stages, and the tensor-parallel combine.

forward:  local stats (backend) -> [combine across the vocab-parallel group] -> logprob, entropy
backward: backend grads from the saved global lse / entropy -> [all-reduce d_hidden] -> cast
Saved between the two: the inputs and four float32 vectors of length N. Nothing [N x V].

Rows whose label is ignore_index never reach a backend: they cost nothing (prompt and padding tokens
in RL batches), and a non-finite hidden state there cannot leak into d_weight through 0 * inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .contract import Backend

if TYPE_CHECKING:
    from ..parallel import VocabParallel


@dataclass(frozen=True)
class OpOptions:
    """What one call computes, besides its tensors.

    backend: the backend module (see ``contract.py``) that runs both stages.
    with_entropy: also compute the entropy (else a non-differentiable placeholder is returned).
    softcap: None or c > 0, the tanh cap of the logits, applied per logit before the temperature.
    tp: the vocab-parallel layout of ``weight`` (None: the weight holds the whole vocabulary).
    """
    backend: Backend
    with_entropy: bool
    softcap: Optional[float] = None
    tp: Optional["VocabParallel"] = None


def _scatter_rows(values: Tensor, rows: Optional[Tensor], n: int) -> Tensor:
    """values for the kept rows -> a tensor of n rows, zeros elsewhere (values itself if all kept)."""
    if rows is None:
        return values
    out = values.new_zeros((n,) + values.shape[1:])
    return out.index_copy_(0, rows, values)


class FusedLogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, valid: Tensor,
                options: OpOptions):
        """hidden [N, H], weight [V_local, H], labels [N] int64 global ids (anything where not valid),
        inv_temp [N] float32, valid [N] bool. Under ``options.tp`` every rank holds the same labels,
        hence the same valid rows. Returns logprobs [N], entropy [N] (or a non-differentiable
        placeholder), float32."""
        backend, with_entropy, tp, softcap = options.backend, options.with_entropy, options.tp, options.softcap
        n = hidden.shape[0]
        rows = None if bool(valid.all()) else valid.nonzero().squeeze(1)
        if rows is not None:
            labels, inv_temp = labels[rows], inv_temp[rows]
        h = hidden if rows is None else hidden.index_select(0, rows)

        offset = tp.vocab_offset if tp is not None else 0
        local = labels - offset
        local = torch.where((local >= 0) & (local < weight.shape[0]), local, torch.full_like(local, -1))

        if h.shape[0] == 0:   # no scored tokens: no kernel launch
            lse = zy = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            ent = lse if with_entropy else None
        else:
            lse, ent, zy = backend.stats(h, weight, local, inv_temp, with_entropy, softcap)
        if tp is not None:
            lse, ent, zy = tp.combine_stats(lse, ent, zy)

        logprobs = _scatter_rows(zy - lse, rows, n)
        entropy = _scatter_rows(ent, rows, n) if with_entropy else None

        ctx.save_for_backward(hidden, weight, local, inv_temp, rows, lse, ent)
        ctx.options = options
        if entropy is None:
            placeholder = torch.zeros_like(logprobs)
            ctx.mark_non_differentiable(placeholder)  # keep the output arity fixed
            return logprobs, placeholder
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp: Optional[Tensor], g_ent: Optional[Tensor]):
        hidden, weight, local, inv_temp, rows, lse, ent = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        opts = ctx.options
        if not (need_dh or need_dw):
            return (None,) * 6
        h = hidden if rows is None else hidden.index_select(0, rows)

        def kept(g):
            g = g.float()
            return g if rows is None else g[rows]
        g_lp = torch.zeros_like(lse) if g_lp is None else kept(g_lp)
        g_ent = kept(g_ent) if opts.with_entropy and g_ent is not None else None

        if h.shape[0] == 0:
            dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_dh else None
            dw = torch.zeros_like(weight) if need_dw else None
        else:
            dh, dw = opts.backend.grads(h, weight, local, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw,
                                        opts.softcap)
        if dh is not None and opts.tp is not None:
            dh = opts.tp.reduce_grad_hidden(dh)
        if dh is not None:
            dh = _scatter_rows(dh, rows, hidden.shape[0]).to(hidden.dtype)
        return dh, dw, None, None, None, None
