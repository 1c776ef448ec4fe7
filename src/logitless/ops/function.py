"""The one autograd Function: glues a backend's two stages, and the tensor-parallel combine.

forward:  local stats (backend) -> [combine across the vocab-parallel group] -> logprob, entropy
backward: backend grads from the saved global lse / entropy -> [all-reduce d_hidden] -> cast
Saved between the two: the inputs and four float32 vectors of length N. Nothing [N x V].
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor


class FusedLogProbsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, valid: Tensor,
                backend: Any, with_entropy: bool, tp: Optional[Any], softcap: Optional[float] = None):
        """hidden [N, H], weight [V_local, H], labels [N] int64 global ids (anything where not valid),
        inv_temp [N] float32, valid [N] bool, softcap None or a positive float (tanh cap of the logits,
        applied per logit before the temperature, so the tensor-parallel combine is unchanged).
        Returns logprobs [N], entropy [N] (or None), float32."""
        offset = tp.vocab_offset if tp is not None else 0
        local = labels - offset
        here = valid & (local >= 0) & (local < weight.shape[0])
        local = torch.where(here, local, torch.full_like(local, -1))

        if hidden.shape[0] == 0:   # no tokens: no kernel launch, empty outputs
            lse = zy = torch.zeros(0, dtype=torch.float32, device=hidden.device)
            ent = lse if with_entropy else None
        else:
            lse, ent, zy = backend.stats(hidden, weight, local, inv_temp, with_entropy, softcap)
        if tp is not None:
            lse, ent, zy = tp.combine_stats(lse, ent, zy)

        zero = torch.zeros_like(lse)
        logprobs = torch.where(valid, zy - lse, zero)
        entropy = torch.where(valid, ent, zero) if with_entropy else None

        ctx.save_for_backward(hidden, weight, local, inv_temp, valid, lse, ent)
        ctx.backend, ctx.tp, ctx.with_entropy, ctx.softcap = backend, tp, with_entropy, softcap
        if entropy is None:
            ctx.mark_non_differentiable(zero)  # keep the output arity fixed
            return logprobs, zero
        return logprobs, entropy

    @staticmethod
    def backward(ctx, g_lp: Optional[Tensor], g_ent: Optional[Tensor]):
        hidden, weight, local, inv_temp, valid, lse, ent = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return (None,) * 9
        zero = torch.zeros_like(lse)
        g_lp = zero if g_lp is None else torch.where(valid, g_lp.float(), zero)
        if not ctx.with_entropy or g_ent is None:
            g_ent = None
        else:
            g_ent = torch.where(valid, g_ent.float(), zero)
        if hidden.shape[0] == 0:
            dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_dh else None
            dw = torch.zeros_like(weight) if need_dw else None
        else:
            dh, dw = ctx.backend.grads(hidden, weight, local, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw,
                                      ctx.softcap)
        if dh is not None and ctx.tp is not None:
            dh = ctx.tp.reduce_grad_hidden(dh)
        if dh is not None:
            dh = dh.to(hidden.dtype)
        return dh, dw, None, None, None, None, None, None, None
