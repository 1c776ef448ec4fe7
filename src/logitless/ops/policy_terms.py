"""The per-token policy-loss term, defined here in torch: the reference path evaluates it, and so does the
fused pass on the CPU backends, taking its derivatives with torch.autograd. The triton backend evaluates the
same formulas, derivatives written out, in one kernel per chunk (``ops/triton/policy_terms.py``), which the
tests hold to this module for every setting.

For one scored token with log-prob lp and entropy H of the current policy, advantage A, behaviour
log-prob old and reference log-prob ref (verl's ``compute_policy_loss_vanilla`` and ``kl_penalty``):

    ratio = exp(clamp(lp - old, -20, 20))                      (old = lp, detached, when on-policy: ratio 1)
    pg1   = -A * ratio
    pg2   = -A * clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg    = max(pg1, pg2)
    pg    = min(pg, -A * dual_clip)  where A < 0               (dual-clip PPO; only when dual_clip is set)
    kl    = k1: lp - ref | k2: (lp - ref)^2 / 2 | abs: |lp - ref|
            k3: r = clamp(ref - lp, -20, 20), clamp(exp(r) - r - 1, -10, 10)
            "+" suffix (k1+, k3+): that value, with the gradient of k2 (verl's straight-through estimator)
    f     = pg + kl_coef * kl - entropy_coef * H

The loss is sum_i w_i f_i over the scored tokens, with weights w_i fixed by the aggregation
(``losses/aggregate.py``). It is minimised. Every token's term depends on that token's lp and H only, which is
what lets the fused pass form the gradient of a chunk of tokens as soon as their statistics are known.
Terms are evaluated in float64 (vectors of one value per token: the cost is nil).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# verl's names for the same estimators
KL_TYPES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3",
            "k1+": "k1+", "kl+": "k1+", "k3+": "k3+", "low_var_kl+": "k3+"}
RATIO_LOG_CLAMP = 20.0      # verl clamps lp - old (and ref - lp for k3) to +-20 before exp
K3_CLAMP = 10.0             # and the k3 estimate to +-10


@dataclass(frozen=True)
class TermSpec:
    """The scalar settings of the per-token term (validated by ``PolicyLoss``)."""
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    kl_coef: float
    kl_type: str           # a canonical value of KL_TYPES
    entropy_coef: float
    has_old: bool
    has_ref: bool


@dataclass(frozen=True)
class TokenInputs:
    """Per-token inputs of the scored tokens, float64 [n] (old / ref None when not given)."""
    advantages: Tensor
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    weights: Tensor

    def rows(self, start: int, stop: int) -> "TokenInputs":
        def cut(t):
            return None if t is None else t[start:stop]
        return TokenInputs(cut(self.advantages), cut(self.old_logprobs), cut(self.ref_logprobs),
                           cut(self.weights))


def kl_estimate(lp: Tensor, ref: Tensor, kl_type: str) -> Tensor:
    """Per-token KL(current || reference) estimate of ``kl_type`` (canonical name), verl's formulas."""
    base = kl_type.rstrip("+")
    if base == "k1":
        kl = lp - ref
    elif base == "abs":
        kl = (lp - ref).abs()
    elif base == "k2":
        kl = 0.5 * (lp - ref).square()
    else:
        r = (ref - lp).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
        kl = (r.exp() - r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    if kl_type.endswith("+"):
        # the value of the estimator, the gradient of k2 (unbiased for the KL's gradient)
        k2 = 0.5 * (lp - ref).square()
        kl = k2 - k2.detach() + kl.detach()
    return kl


def per_token_terms(lp: Tensor, ent: Tensor, tokens: TokenInputs, spec: TermSpec
                    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(f, clipped, kl) per token: the term f of the module docstring, whether the clipped surrogate was
    the larger (verl's clip fraction counts these), and the KL estimate (None without ref_logprobs).
    lp, ent: [n] float64 (differentiable); tokens: the same n tokens."""
    adv = tokens.advantages
    old = tokens.old_logprobs if spec.has_old else lp.detach()
    ratio = (lp - old).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP).exp()
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if spec.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * spec.dual_clip), pg)
    f = pg
    kl = kl_estimate(lp, tokens.ref_logprobs, spec.kl_type) if spec.has_ref else None
    if kl is not None and spec.kl_coef != 0.0:
        f = f + spec.kl_coef * kl
    if spec.entropy_coef != 0.0:
        f = f - spec.entropy_coef * ent
    return f, clipped, kl


@dataclass
class TermTotals:
    """Running sums over chunks, as 0-d float64 tensors (no host synchronisation per chunk)."""
    loss: Tensor
    clipped: Tensor
    kl: Optional[Tensor]
    sums: Tensor          # float64 [3]: the three above are its views (kl's slot stays 0 without it)

    @classmethod
    def zeros(cls, device, with_kl: bool) -> "TermTotals":
        z = torch.zeros(3, dtype=torch.float64, device=device)    # one fill: views summed into in place
        return cls(z[0], z[1], z[2] if with_kl else None, z)


def weighted_terms(lp: Tensor, ent: Tensor, tokens: TokenInputs, spec: TermSpec):
    """(sum_i w_i f_i, number clipped, sum_i w_i kl_i or None), from float64 lp / ent [n]; differentiable
    in lp and ent. The reference path calls this on the whole batch, the fused pass on each chunk."""
    f, clipped, kl = per_token_terms(lp, ent, tokens, spec)
    w = tokens.weights
    return (w * f).sum(), clipped.sum(dtype=torch.float64), None if kl is None else (w * kl.detach()).sum()


def chunk_gradients(lp: Tensor, ent: Tensor, tokens: TokenInputs, spec: TermSpec, totals: TermTotals
                    ) -> tuple[Tensor, Optional[Tensor]]:
    """d(sum_i w_i f_i)/d lp_i and /d ent_i (float32 [n]; the entropy one None when the loss does not
    depend on the entropy), for float32 lp / ent [n] of one chunk; adds the chunk's sums to ``totals``."""
    with torch.enable_grad():
        lp64 = lp.detach().double().requires_grad_(True)
        ent64 = ent.detach().double().requires_grad_(spec.entropy_coef != 0.0)
        loss, clipped, kl = weighted_terms(lp64, ent64, tokens, spec)
        wanted = (lp64, ent64) if ent64.requires_grad else (lp64,)
        grads = torch.autograd.grad(loss, wanted, allow_unused=True)
    totals.loss += loss.detach()
    totals.clipped += clipped
    if kl is not None:
        totals.kl += kl

    def as32(g):
        return torch.zeros_like(lp) if g is None else g.float()
    return as32(grads[0]), (as32(grads[1]) if len(grads) > 1 else None)
