"""The autograd Function of the fused policy loss: gradients formed in the forward, handed out in backward.

forward: one fused pass (``logitless.ops.policy_parts``) over the scored tokens computes their log-probs and
entropies, the loss sum_i w_i f_i, its metrics, and d_hidden / d_weight of the loss (into buffers
allocated here, only for the inputs that need a gradient).
backward: scales those buffers in place by the upstream gradient of the loss (the loss is 0-d; on
CUDA the factor is read by a kernel, so the backward does not wait for the GPU) and returns them.
They exist once: a second backward through the same loss raises RuntimeError (call the loss again
instead). Gradient accumulation over micro-batches works as usual: every call has its own buffers and
autograd adds them into ``.grad``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..ops.policy_parts import scale_by_upstream
from ..ops.policy_terms import TermSpec, TermTotals, chunk_gradients
from .tokens import ScoredTokens

if TYPE_CHECKING:
    from ..parallel import VocabParallel


@dataclass(frozen=True)
class PassOptions:
    """How the pass runs: the backend's ``policy_pass`` and its kernel for the per-token terms (None: torch
    autograd over ``terms.py``), the vocab-parallel layout (None: whole vocabulary here), and which
    gradients to form (decided by the caller from requires_grad and the grad mode: inside a Function's
    forward both are hidden)."""
    policy_pass: Callable
    terms: Optional[ModuleType]
    tp: Optional["VocabParallel"]
    need_dh: bool
    need_dw: bool
    bounds: Optional[list] = None     # the chunks' boundaries when groups of tokens must stay whole


class _Chunks:
    """The ``combine`` callback of the pass: per chunk, the global statistics, the log-probs and the loss
    gradients of its tokens; it keeps the per-token outputs and the running sums."""

    def __init__(self, tokens: ScoredTokens, spec: TermSpec, options: PassOptions, device):
        self.tokens, self.spec, self.tp, self.terms, self.device = tokens, spec, options.tp, options.terms, device

    # The outputs, the sums and the terms kernel's settings (an allocation, a fill and a copy to the device)
    # are made on first use: in the first chunk's callback, once its statistics kernel is queued, not before
    # it while the GPU waits.
    @cached_property
    def out(self) -> Tensor:
        """float32 [2, n]: the log-probs and entropies (the chunks cover all n rows and each writes its
        own: no fill)."""
        return torch.empty((2, self.tokens.count), dtype=torch.float32, device=self.device)

    @cached_property
    def totals(self) -> TermTotals:
        return TermTotals.zeros(self.device, with_kl=self.spec.has_ref)

    @cached_property
    def settings(self):
        return self.terms.TermSettings.make(self.spec, self.device)

    def __call__(self, start: int, stop: int, lse: Tensor, ent: Tensor, zy: Tensor):
        if self.tp is not None:
            lse, ent, zy = self.tp.combine_stats(lse, ent, zy)
        lp = zy - lse
        self.out[0, start:stop] = lp
        self.out[1, start:stop] = ent
        inputs = self.tokens.inputs.rows(start, stop)
        if self.terms is None:
            g_lp, g_ent = chunk_gradients(lp, ent, inputs, self.spec, self.totals)
        else:
            g_lp, g_ent = self.terms.chunk_terms(lp, ent, inputs, self.settings, self.totals.sums)
        return lse, ent, g_lp, g_ent


class FusedPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, tokens: ScoredTokens, spec: TermSpec, options: PassOptions):
        """hidden [N, H] (every row; only ``tokens.rows`` are scored), weight [V_local, H].
        Returns (loss 0-d, logprobs [N], entropy [N], clipped count 0-d, weighted kl 0-d or 0), float32;
        all but the loss are non-differentiable."""
        tp = options.tp
        dev = hidden.device
        h = hidden if tokens.rows is None else hidden.index_select(0, tokens.rows)
        # the labels were checked to lie in the vocabulary; a shard's own ids, -1 for the others' tokens
        local = tokens.labels
        if tp is not None:
            local = local - tp.vocab_offset
            local = torch.where((local >= 0) & (local < weight.shape[0]), local, torch.full_like(local, -1))

        n, k = h.shape
        dh = None
        if options.need_dh:
            # under tensor parallelism d_hidden is a partial sum: keep it float32 until it is reduced
            dh = torch.empty((n, k), dtype=torch.float32 if tp is not None else hidden.dtype, device=dev)
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if options.need_dw else None
        chunks = _Chunks(tokens, spec, options, dev)
        if n:
            plan_vocab = max(tp.sizes) if tp is not None else weight.shape[0]
            cut = {} if options.bounds is None else {"bounds": options.bounds}
            options.policy_pass(h, weight, local, tokens.inv_temp, chunks, dh, dw, plan_vocab=plan_vocab, **cut)
        else:
            if dh is not None:
                dh.zero_()
            if dw is not None:
                dw.zero_()
        if dh is not None:
            if tp is not None:
                dh = tp.reduce_grad_hidden(dh)
            if tokens.rows is not None:
                dh = torch.zeros(hidden.shape, dtype=dh.dtype, device=dev).index_copy_(0, tokens.rows, dh)
            dh = dh.to(hidden.dtype)
        ctx.grads = (dh, dw)

        totals = chunks.totals
        loss = totals.loss.float()
        logprobs, entropy = tokens.scatter(chunks.out[0]), tokens.scatter(chunks.out[1])
        clipped = totals.clipped.float()
        kl = totals.kl.float() if totals.kl is not None else torch.zeros((), device=dev)
        ctx.mark_non_differentiable(logprobs, entropy, clipped, kl)
        return loss, logprobs, entropy, clipped, kl

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss: Optional[Tensor], *_):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_policy_loss: a second backward through the same loss. Its gradients are "
                               "formed in the forward and handed out once; call fused_policy_loss again")
        ctx.grads = None
        dh, dw = grads
        for g in (dh, dw):     # in place: no second gradient-sized buffer
            if g is None:
                continue
            if g_loss is None:
                g.zero_()
            else:
                scale_by_upstream(g, g_loss)
        return dh, dw, None, None, None
