"""The full-vocabulary divergences between a student's and a teacher's next-token distributions: their one
definition, per element and per token, read by every distillation pass (and by the tests' float64 formulas'
counterpart, which are written independently from the definitions).

Both heads' logits go through the same transformation (TRL's order): z = softcap * tanh(scale * raw / softcap)
* inv_temp (without softcap: z = scale * raw * inv_temp), raw = hidden @ weight.T; log p = z - logsumexp(z).
With ls, lt the student's and the teacher's log-probs of one token over the vocabulary:

    forward_kl   D = sum_v p_t (lt - ls)                       = KL(p_t || p_s)      (TRL beta = 0)
    reverse_kl   D = sum_v p_s (ls - lt)                       = KL(p_s || p_t)      (TRL beta = 1)
    jsd          m = (1 - beta) p_s + beta p_t,  lm = log m    (0 < beta < 1)
                 D = beta * sum_v p_t (lt - lm) + (1 - beta) * sum_v p_s (ls - lm)

and the derivative of D with respect to the student's (tempered) logits zs, exact:

    forward_kl   dD/dzs_v = p_s - p_t
    reverse_kl   dD/dzs_v = p_s (ls - lt - D)
    jsd          dD/dzs_v = (1 - beta) p_s (ls - lm - A),   A = sum_v p_s (ls - lm) = KL(p_s || m)

(for jsd: dD/dp_s,v = (1 - beta)(ls - lm) since the other terms' derivatives cancel through m; then the
softmax's Jacobian). Each per-token sum is a sum over the vocabulary of per-element terms, so under tensor
parallelism every rank sums its shard and the sums are added across ranks (``partial_sums``) once both
log-normalisers are global. The teacher gets no gradient.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

# the public names of the full-vocabulary divergences, and which of them take beta
FULL_VOCAB_DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
TAKES_BETA = ("jsd",)


@dataclass(frozen=True)
class HeadTransform:
    """One head's logit transformation before the temperature: z = softcap * tanh(scale * raw / softcap), or
    scale * raw without softcap (TRL's logit_scale and final_logit_softcapping, in that order)."""
    scale: float = 1.0
    softcap: Optional[float] = None

    def logits(self, raw: Tensor, inv_temp: Tensor, keep_tanh: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """The float32 tempered logits from raw [c, V] float32 (overwritten in place), and with keep_tanh and a
        softcap the tanh [c, V] for the derivative (else None)."""
        if self.scale != 1.0:
            raw = raw.mul_(self.scale)
        if self.softcap is None:
            return raw.mul_(inv_temp.unsqueeze(1)), None
        t = raw.div_(self.softcap).tanh_()
        scale = (inv_temp * self.softcap).unsqueeze(1)
        if keep_tanh:
            return t * scale, t
        return t.mul_(scale), None

    def chain(self, dz: Tensor, inv_temp: Tensor, t: Optional[Tensor]) -> Tensor:
        """dD/draw from dD/dz [c, V], in place: times inv_temp, the softcap's 1 - tanh^2 and the scale."""
        dz = dz.mul_((inv_temp * self.scale).unsqueeze(1))
        if t is not None:
            dz = dz.mul_(t.square_().neg_().add_(1.0))
        return dz


@dataclass(frozen=True)
class Divergence:
    """Which divergence: ``kind`` in FULL_VOCAB_DIVERGENCES, with ``beta`` in (0, 1) for jsd (None else)."""
    kind: str
    beta: Optional[float] = None

    @classmethod
    def of(cls, name: str, beta: Optional[float]) -> "Divergence":
        """TRL's reading of beta: jsd with beta 0 is the forward KL and with beta 1 the reverse KL (its
        function switches formula at the ends, where the mixture's term would vanish)."""
        if name == "jsd" and beta == 0.0:
            return cls("forward_kl")
        if name == "jsd" and beta == 1.0:
            return cls("reverse_kl")
        return cls(name, beta if name == "jsd" else None)

    def mixture_log(self, ls: Tensor, lt: Tensor) -> Tensor:
        """lm = log((1 - beta) p_s + beta p_t), elementwise, without leaving log space."""
        return torch.logaddexp(ls + math.log1p(-self.beta), lt + math.log(self.beta))

    def partial_sums(self, ls: Tensor, lt: Tensor) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """(D, A, lm) from the log-probs ls, lt [c, V] (global normalisers, any vocabulary shard): D [c] the
        divergence's sum over these columns, A [c] the KL(p_s || m) part jsd's derivative needs (None
        else), lm [c, V] the mixture's log-probs (jsd only, for ``student_dlogits``)."""
        if self.kind == "forward_kl":
            return (lt.exp() * (lt - ls)).sum(dim=1), None, None
        if self.kind == "reverse_kl":
            return (ls.exp() * (ls - lt)).sum(dim=1), None, None
        lm = self.mixture_log(ls, lt)
        a = ls.exp() * (ls - lm)
        d = (self.beta * (lt.exp() * (lt - lm)) + (1.0 - self.beta) * a).sum(dim=1)
        return d, a.sum(dim=1), lm

    def student_dlogits(self, ls: Tensor, lt: Tensor, d: Tensor, a: Optional[Tensor],
                        lm: Optional[Tensor]) -> Tensor:
        """dD/dzs [c, V] float32 (a fresh tensor) from the log-probs and the global per-token sums."""
        ps = ls.exp()
        if self.kind == "forward_kl":
            return ps.sub_(lt.exp())
        if self.kind == "reverse_kl":
            return ps.mul_(ls - lt - d.unsqueeze(1))
        return ps.mul_((ls - lm).sub_(a.unsqueeze(1))).mul_(1.0 - self.beta)
