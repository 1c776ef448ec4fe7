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

How the sums are formed (the accuracy; tests/losses/test_distillation_accuracy.py holds it to TRL's float32):
every log-prob is l = x - g with x = z - m (m the row's max over the whole vocabulary) and g = log sum exp(x),
never z - lse: lse is as large as the logits (~20), its rounding (ulp ~2e-6) would shift every l alike, and
sum p = 1 + that error multiplies the divergence's large log-ratios. The KL kinds come out of the statistics
pass itself, normalised by a division instead:

    forward_kl   D = S_t / L_t + g_s - g_t,   S_t = sum_v e_t (x_t - x_s)
    reverse_kl   D = S_s / L_s + g_t - g_s,   S_s = sum_v e_s (x_s - x_t)        (e = exp(x), L = sum e, g = log L)

(sum p_t (l_t - l_s) with p_t = e_t / L_t). Each part of the vocabulary (a kernel's column span, a rank's shard)
keeps its sums relative to its own maxima (``part_statistics``), in float64: float32 sums of 10^5 terms lose a
few ulps of D (5e-6 at D ~ 20), float64 ones of the same float32 terms keep ~1e-6. ``combine_parts`` rescales
the parts onto the common maxima (every per-row number float64), ``finish`` forms g, the entropy and D. jsd's
sums need both normalisers first, in a second pass over the logits (``partial_sums``, float64 sums too).
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
# the per-row statistics of a part of the vocabulary, in this order along dim 0 of a [STAT_ROWS, c, ...] float64
# tensor: each head's max m, sum L = sum exp(z - m); the student's X = sum exp(z_s - m_s) (z_s - m_s) (its
# entropy); the KL kinds' cross sum S (0 for jsd)
M_S, L_S, X_S, M_T, L_T, CROSS = range(6)
STAT_ROWS = 6


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

    @property
    def one_pass(self) -> bool:
        """Whether the statistics pass gives the divergence (the KL kinds) or a second sum is needed (jsd)."""
        return self.kind != "jsd"

    def cross_terms(self, xs: Tensor, xt: Tensor, es: Tensor, et: Tensor) -> Optional[Tensor]:
        """The cross sum's terms [c, V] (float32): e_t (x_t - x_s) forward, e_s (x_s - x_t) reverse; None for
        jsd. x = z - m, e = exp(x), relative to any maxima (``combine_parts`` moves them)."""
        if self.kind == "forward_kl":
            return et * (xt - xs)
        if self.kind == "reverse_kl":
            return es * (xs - xt)
        return None

    def part_statistics(self, zs: Tensor, zt: Tensor) -> Tensor:
        """[STAT_ROWS, c] float64 of the tempered logits zs, zt [c, V] (float32; they become x = z - m in place,
        m this part's row max): the torch form of the kernels' statistics pass."""
        out = torch.zeros((STAT_ROWS, zs.shape[0]), dtype=torch.float64, device=zs.device)
        es = et = None
        for z, (m_row, l_row) in ((zs, (M_S, L_S)), (zt, (M_T, L_T))):
            m = z.amax(dim=1)
            x = z.sub_(m.unsqueeze(1))
            e = x.exp()
            out[m_row], out[l_row] = m, e.sum(dim=1, dtype=torch.float64)
            if z is zs:
                es = e
                out[X_S] = (e * x).sum(dim=1, dtype=torch.float64)
            else:
                et = e
        cross = self.cross_terms(zs, zt, es, et)
        if cross is not None:
            out[CROSS] = cross.sum(dim=1, dtype=torch.float64)
        return out

    def combine_parts(self, parts: Tensor) -> Tensor:
        """[STAT_ROWS, c] float64 of the whole vocabulary from its parts' [STAT_ROWS, c, J] (float64, each
        relative to its own maxima): the sums rescaled onto the common maxima, in float64."""
        if parts.shape[2] == 1:
            return parts[:, :, 0]
        out = torch.empty(parts.shape[:2], dtype=torch.float64, device=parts.device)
        shift = {}
        for m_row, l_row in ((M_S, L_S), (M_T, L_T)):
            top = parts[m_row].amax(dim=1, keepdim=True)
            # a part's shift onto the common max (<= 0); 0 for a part without columns (l = 0, m = -inf)
            d = torch.where(parts[l_row] > 0, parts[m_row] - top, 0.0)
            shift[m_row] = d
            out[m_row] = top[:, 0]
            out[l_row] = (parts[l_row] * d.exp()).sum(dim=1)
        d_s, d_t = shift[M_S], shift[M_T]
        # X = sum e (x): moving x by d adds d L; the cross sum's log-ratio moves by the two shifts' difference
        out[X_S] = ((parts[X_S] + parts[L_S] * d_s) * d_s.exp()).sum(dim=1)
        if self.kind == "forward_kl":
            out[CROSS] = ((parts[CROSS] + parts[L_T] * (d_t - d_s)) * d_t.exp()).sum(dim=1)
        elif self.kind == "reverse_kl":
            out[CROSS] = ((parts[CROSS] + parts[L_S] * (d_s - d_t)) * d_s.exp()).sum(dim=1)
        else:
            out[CROSS] = 0.0
        return out

    def finish(self, stats: Tensor) -> "RowTerms":
        """The per-row numbers of the whole vocabulary from its statistics [STAT_ROWS, c] (float64)."""
        g_s, g_t = stats[L_S].log(), stats[L_T].log()
        ent = g_s - stats[X_S] / stats[L_S]
        d = None
        if self.kind == "forward_kl":
            d = stats[CROSS] / stats[L_T] + (g_s - g_t)
        elif self.kind == "reverse_kl":
            d = stats[CROSS] / stats[L_S] + (g_t - g_s)
        return RowTerms(stats[M_S].float(), g_s.float(), stats[M_T].float(), g_t.float(), ent.float(), d)

    def mixture_log(self, ls: Tensor, lt: Tensor) -> Tensor:
        """lm = log((1 - beta) p_s + beta p_t), elementwise, without leaving log space."""
        return torch.logaddexp(ls + math.log1p(-self.beta), lt + math.log(self.beta))

    def partial_sums(self, ls: Tensor, lt: Tensor) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """(D, A, lm) from the log-probs ls, lt [c, V] (global normalisers, any vocabulary shard): D [c] the
        divergence's sum over these columns, A [c] the KL(p_s || m) part jsd's derivative needs (None
        else), both float64; lm [c, V] the mixture's log-probs (jsd only, for ``student_dlogits``). The pass
        uses it for jsd (the KL kinds come from ``finish``); the KL kinds' direct sums are for the tests."""
        if self.kind == "forward_kl":
            return (lt.exp() * (lt - ls)).sum(dim=1, dtype=torch.float64), None, None
        if self.kind == "reverse_kl":
            return (ls.exp() * (ls - lt)).sum(dim=1, dtype=torch.float64), None, None
        lm = self.mixture_log(ls, lt)
        a = ls.exp() * (ls - lm)
        d = (self.beta * (lt.exp() * (lt - lm)) + (1.0 - self.beta) * a).sum(dim=1, dtype=torch.float64)
        return d, a.sum(dim=1, dtype=torch.float64), lm

    def student_dlogits(self, ls: Tensor, lt: Tensor, d: Tensor, a: Optional[Tensor],
                        lm: Optional[Tensor]) -> Tensor:
        """dD/dzs [c, V] float32 (a fresh tensor) from the log-probs and the global per-token sums."""
        ps = ls.exp()
        if self.kind == "forward_kl":
            return ps.sub_(lt.exp())
        if self.kind == "reverse_kl":
            return ps.mul_(ls - lt - d.float().unsqueeze(1))
        return ps.mul_((ls - lm).sub_(a.float().unsqueeze(1))).mul_(1.0 - self.beta)


@dataclass(frozen=True)
class RowTerms:
    """A row's numbers over the whole vocabulary (float32 [c] unless said): each head's max m and g = log sum
    exp(z - m) (its log-probs are (z - m) - g), the student's entropy, and the divergence d (float64; None for
    jsd until its second sum)."""
    m_s: Tensor
    g_s: Tensor
    m_t: Tensor
    g_t: Tensor
    entropy: Tensor
    d: Optional[Tensor]
