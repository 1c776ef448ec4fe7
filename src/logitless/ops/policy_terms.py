"""The policy-loss terms, defined here once in torch (float64, on vectors of one value per scored token):
the fused pass differentiates them with torch.autograd (per chunk, or on the whole batch when they couple
tokens), the reference path evaluates them on the whole batch, and the triton backend's kernel
(``ops/triton/policy_terms.py``) writes out the derivatives of the token-local subset, held to this module
by the tests.

For one scored token with log-prob lp and entropy H of the current policy, advantage A, behaviour log-prob
old, reference log-prob ref, and the token's sequence i (verl's ``core_algos``, TRL's ``_compute_loss``):

    ratio level (``ratio_level``; d = lp - old, old = lp detached when on-policy: ratio 1; c the
    ``ratio_log_clamp``: verl's 20 by default, None for TRL, which does not clamp):
        "token"           r = exp(clamp(d, -c, c))                                     (verl, TRL)
        "sequence"        r = exp(clamp(mean_{t in i} d_t, -c, c)) for every token of i   (GSPO; TRL's
                          importance_sampling_level="sequence": the gradient flows through the mean)
        "sequence-token"  r = exp(min(lp - sg(lp) + sg(mean_{t in i} d_t), 10))  (verl's "gspo", GSPO-token:
                          the sequence ratio's value, a per-token gradient)
    surrogate (``surrogate``):
        "ppo"     max(-A min(r, delta), -A clamp(r, 1 - clip_low, 1 + clip_high)), then for A < 0 at most
                  -A dual_clip (delta: TRL's two-sided clip, INTELLECT-2; dual_clip: verl's clip_ratio_c)
        "cispo"   -sg(clamp(r, 1 - clip_low, 1 + clip_high)) A lp
        "sapo"    -A sigmoid(tau (r - 1)) 4 / tau,  tau = tau_pos where A > 0 else tau_neg
        "gpg"     -A lp
        "dro"     -(A lp - dro_beta / 2 (lp - old)^2)
        "vespo"   -sg(phi_i) A lp,  phi_i = exp(lam + k log w_i - lam w_i), log w_i = clamp(sum_{t in i}
                  clamp(d_t, -20, 20) + sum_{t in i} log clamp(rho_t), log 1e-8, 20); (k, lam) = vespo_pos
                  where A >= 0 else vespo_neg; rho the rollout weights, whose sum is the one log clamp(rho_i)
                  where they are one per sequence (TRL's get_gamma_weights)
        "dppo_tv" -A sg(min(r, cap)) lp keep,  keep = p - p_old <= clip_high where A > 0 else >= -clip_low
        "dppo_kl" the same with keep = binary KL(p_old || p) <= clip_high or p <= p_old (A > 0),
                  <= clip_low or p >= p_old (A <= 0)                         (cap = dual_clip, or 20)
    masks and weights of the surrogate, pg <- pg * mask * rho:
        off-policy sequence mask (DeepSeek-V3.2, TRL): keep the sequence where A >= 0 or
            mean_{t in i} (sampling_t - sg(lp_t)) <= off_policy_threshold (sampling: rollout log-probs,
            else old; a NaN rollout log-prob, a token the rollout engine could not score, adds 0 to the
            sum, as TRL's nan_to_num: ``PolicyLoss.rollout_nan_is_missing``)
        entropy mask (TRL's top_entropy_quantile q < 1): keep tokens whose entropy is at least the
            (1 - q) quantile of the scored tokens' entropies (with ``entropy_quantile_group``, of every
            rank's scored tokens, as TRL's quantile spans its processes)
        rho: the rollout-correction weights (``rollout_weights``), given per token (0 where masked)
        rejection (verl's token-level rollout_rs, ``rejection_factor``): with e = clamp(lp - sampling, -20,
            20), detached (sampling: rollout log-probs, else old; a NaN rollout log-prob gives e = 0), a token
            is rejected where e lies outside [log ratio_min, log ratio_max] (token_k1), 0.5 e^2 > k2_max
            (token_k2) or exp(e) - 1 - e > k3_max (token_k3); and a whole sequence where the sum, mean or
            maximum over its scored tokens of -e (k1), 0.5 e^2 (k2) or exp(e) - 1 - e (k3) fails its bound
            (verl's seq_sum_k*, seq_mean_k*, seq_max_k*; k1 as the band [log min, log max] of the sum or mean
            of e); the bounds given ANDed. A rejected token's
            policy term is dropped; the aggregation's normalisers stay the scored tokens', except that
            under seq-mean-token-mean a sequence's policy term is the mean over its kept tokens (0 with
            none): pg <- pg keep (len_i / kept_i there). This is verl's agg_loss of the policy term over
            its rejection-masked response mask with the mini-batch's token count and sequence count given,
            as verl's engine gives them; the KL term and the entropy bonus keep every scored token.
        current_is (verl's bypass reinforce IS weights, ``current_is_weights``): with e as above (not
            clamped), a detached weight w = exp(clamp(e, -20, 20)) per token ("token_*") or w_i =
            exp(clamp(sum_{t in i} e_t, -20, 20)) per sequence ("sequence_*": the sum, not the mean), clamped
            to [current_is_min, current_is_max] ("*_truncate", TIS) or set to 0 outside it ("*_mask", IcePop):
            pg <- pg w
    KL (``kl_type``, estimator of KL(current || reference), x = lp - ref):
        k1: x | abs: |x| | k2: x^2 / 2 | k3: r = clamp(-x, -20, 20), clamp(exp(r) - r - 1, -10, 10) (verl's
        low_var_kl) | k3_unclamped: exp(-x) + x - 1 (TRL's) | "+" suffix: that value with the gradient of k2
        kl_ratio (TRL's use_bias_correction_kl): the estimate times r (with its gradient; k3_unclamped's
        written so that its gradient keeps its precision far from the reference: ``kl_times_ratio``)
    f = pg + kl_coef * kl,  and the loss is  sum_i w_i f_i - entropy_coef * sum_i u_i H_i

with w the aggregation weights (``losses/aggregate.py``) and u the entropy bonus's (the same, or those of
``entropy_agg`` over the tokens the entropy mask keeps). With a KL aggregation of its own (``kl_agg``, weights
v: verl aggregates sapo's policy term by seq-mean-token-mean and its KL loss by loss_agg_mode) the KL term
leaves f: loss = sum_i w_i pg_i + kl_coef * sum_i v_i kl_i - entropy_coef * sum_i u_i H_i. It is minimised.

Coupling. A term is token-local when f_i depends on token i's lp and H only: then the fused pass forms the
gradient of each chunk of tokens from that chunk (three GEMMs). The sequence ratio levels, VESPO, the two
masks, current_is's sequence weights and the rejection mask's sequence options (and, under
seq-mean-token-mean, its kept count per sequence) make f_i depend on other tokens' values (through sums over
a sequence, or a quantile over the batch); ``TermSpec.coupled`` says so, and the loss is then evaluated on
all tokens at once: the statistics of every token first, the group reductions and the per-token coefficients
dL/dlp_i, dL/dH_i from the float64 autograd of this module on [n] vectors, and a second pass over the head
for the gradients (``logitless.losses.api``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

# verl's names for its estimators (k3 / low_var_kl clamped as verl does), and TRL's unclamped k3
KL_TYPES = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3",
            "k1+": "k1+", "kl+": "k1+", "k3+": "k3+", "low_var_kl+": "k3+",
            "k3_unclamped": "k3_unclamped", "k3_unclamped+": "k3_unclamped+"}
SURROGATES = ("ppo", "cispo", "sapo", "gpg", "dro", "vespo", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov")
# surrogates whose terms depend on other tokens' values (a sequence's, or the batch's)
COUPLED_SURROGATES = ("vespo", "geo_mean", "clip_cov", "kl_cov")
RATIO_LEVELS = ("token", "sequence", "sequence-token")
CURRENT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
RATIO_LOG_CLAMP = 20.0      # verl clamps lp - old (and ref - lp for k3) to +-20 before exp; TRL does not
K3_CLAMP = 10.0             # and the k3 estimate to +-10
GSPO_TOKEN_LOG_MAX = 10.0   # verl's gspo clamps its log-ratio at 10 (above only)
DPPO_CAP = 20.0             # verl's dppo: the detached ratio is truncated at clip_ratio_c, 20 by default
VESPO_LOG_MIN = math.log(1e-8)


@dataclass(frozen=True)
class TermSpec:
    """The scalar settings of the terms (validated by ``PolicyLoss``)."""
    clip_low: float
    clip_high: float
    dual_clip: Optional[float]
    kl_coef: float
    kl_type: str           # a canonical value of KL_TYPES
    entropy_coef: float
    has_old: bool
    has_ref: bool
    surrogate: str = "ppo"
    ratio_level: str = "token"
    delta: Optional[float] = None
    ratio_log_clamp: Optional[float] = RATIO_LOG_CLAMP     # None: the policy ratio's log not clamped (TRL)
    kl_ratio: bool = False
    sapo_tau: tuple = (1.0, 1.05)            # (positive, negative) advantages
    dro_beta: float = 0.0
    vespo_pos: tuple = (2.0, 3.0)            # (k, lambda) for A >= 0
    vespo_neg: tuple = (3.0, 2.0)            # and for A < 0
    off_policy_threshold: Optional[float] = None
    entropy_quantile: float = 1.0
    entropy_group: Optional[str] = None      # the process group whose tokens the entropy quantile spans
    entropy_agg: Optional[str] = None        # None: the entropy bonus has the loss's weights
    kl_agg: Optional[str] = None             # None: the KL term has the loss's weights
    loss_agg: str = "token-mean"
    has_rollout: bool = False                # rollout (sampling) log-probs given
    has_rollout_weights: bool = False        # rollout-correction weights given
    rollout_per_sequence: bool = False       # ... one per sequence (TRL's sequence modes; VESPO counts it once)
    cov_ratio: float = 2e-4                  # clip_cov / kl_cov: the share of tokens selected
    cov_bounds: tuple = (1.0, 5.0)           # clip_cov: the covariance band of the candidates
    cov_kl_coef: float = 1.0                 # kl_cov: verl's ppo_kl_coef
    rejection_ratio: Optional[tuple] = None  # (min, max) of the detached ratio, a side None for unbounded
    rejection_k2: Optional[float] = None     # the largest 0.5 e^2 kept
    rejection_k3: Optional[float] = None     # the largest exp(e) - 1 - e kept
    rejection_seq: tuple = ()                # (stat "sum" / "mean" / "max", "k1" / "k2" / "k3", min, max) per sequence
    current_is: Optional[str] = None         # CURRENT_IS_MODES: IS weights of this pass's log-probs
    current_is_band: tuple = (None, None)    # its (min, max), a side None for unbounded

    @property
    def rejects(self) -> bool:
        """Whether a rejection mask of this pass's log-probs is on (``rejection_factor``)."""
        return (self.rejection_ratio is not None or self.rejection_k2 is not None or self.rejection_k3 is not None
                or bool(self.rejection_seq))

    @property
    def coupled(self) -> bool:
        """Whether a token's term depends on other tokens' log-probs or entropies (see the module)."""
        return (self.ratio_level != "token" or self.surrogate in COUPLED_SURROGATES
                or self.off_policy_threshold is not None or self.entropy_quantile < 1.0
                or (self.rejects and self.loss_agg == "seq-mean-token-mean")    # kept tokens per sequence
                or bool(self.rejection_seq)
                or (self.current_is or "").startswith("sequence"))

    @property
    def sequence_coupled(self) -> bool:
        """Coupled through sums over a sequence only (not over the batch): a chunk of whole sequences holds
        everything its tokens' terms depend on."""
        return (self.coupled and self.entropy_quantile >= 1.0
                and self.surrogate not in ("clip_cov", "kl_cov"))

    @property
    def uses_entropy(self) -> bool:
        return self.entropy_coef != 0.0


@dataclass(frozen=True)
class TokenInputs:
    """Per-token inputs of the scored tokens, float64 [n] (old / ref None when not given).

    weights: the aggregation weights w. seq: int64 [n], the sequence of each token (0 .. n_seq - 1;
    None where the labels delimit no sequences). ent_weights, kl_weights: the entropy bonus's and the KL
    term's weights (None: the same as w). rollout: the rollout engine's log-probs; rollout_weights: the
    rollout-correction weights rho. horizon: the sequence axis' size (for entropy weights of
    seq-mean-token-sum-norm)."""
    advantages: Tensor
    old_logprobs: Optional[Tensor]
    ref_logprobs: Optional[Tensor]
    weights: Tensor
    seq: Optional[Tensor] = None
    n_seq: int = 0
    ent_weights: Optional[Tensor] = None
    rollout: Optional[Tensor] = None
    rollout_weights: Optional[Tensor] = None
    horizon: object = 1.0      # float, or a 0-d float64 tensor
    kl_weights: Optional[Tensor] = None

    def rows(self, start: int, stop: int) -> "TokenInputs":
        def cut(t):
            return None if t is None else t[start:stop]
        return TokenInputs(cut(self.advantages), cut(self.old_logprobs), cut(self.ref_logprobs), cut(self.weights),
                           cut(self.seq), self.n_seq, cut(self.ent_weights), cut(self.rollout),
                           cut(self.rollout_weights), self.horizon, cut(self.kl_weights))


def kl_estimate(lp: Tensor, ref: Tensor, kl_type: str) -> Tensor:
    """Per-token KL(current || reference) estimate of ``kl_type`` (canonical name): verl's formulas, and
    TRL's unclamped k3."""
    base = kl_type.rstrip("+")
    if base == "k1":
        kl = lp - ref
    elif base == "abs":
        kl = (lp - ref).abs()
    elif base == "k2":
        kl = 0.5 * (lp - ref).square()
    elif base == "k3_unclamped":
        r = ref - lp
        kl = r.exp() - r - 1.0
    else:
        r = (ref - lp).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
        kl = (r.exp() - r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)
    if kl_type.endswith("+"):
        # the value of the estimator, the gradient of k2 (unbiased for the KL's gradient)
        k2 = 0.5 * (lp - ref).square()
        kl = k2 - k2.detach() + kl.detach()
    return kl


# ---- group reductions (sequences) ----

def _need_seq(tokens: TokenInputs, what: str) -> Tensor:
    if tokens.seq is None:
        raise ValueError(f"{what} needs sequences: give labels [b, s] (a sequence per row) or cu_seqlens for "
                         "packed 1-D labels")
    return tokens.seq


def seq_sum(x: Tensor, tokens: TokenInputs, what: str) -> Tensor:
    """float64 [n_seq]: the sum of x [n] over each sequence's scored tokens (differentiable)."""
    seq = _need_seq(tokens, what)
    return x.new_zeros(tokens.n_seq).index_add(0, seq, x)


def seq_mean(x: Tensor, tokens: TokenInputs, what: str) -> Tensor:
    """float64 [n_seq]: the mean of x over each sequence's scored tokens (0 for a sequence with none)."""
    count = seq_sum(torch.ones_like(x), tokens, what)
    return seq_sum(x, tokens, what) / count.clamp_min(1.0)


def mask_weights(keep: Tensor, tokens: TokenInputs, agg: str) -> Tensor:
    """float64 [n]: the weights of aggregation ``agg`` (``aggregate.py``'s modes) over the scored tokens
    that ``keep`` (bool [n]) keeps, as if the others were not scored."""
    v = keep.double()
    if agg == "token-sum":
        return v
    if agg == "token-mean":
        return v / v.sum().clamp_min(1.0)
    per_seq = seq_sum(v, tokens, f"loss_agg={agg!r}")
    n_seq = (per_seq > 0).sum().double().clamp_min(1.0)
    if agg == "seq-mean-token-mean":
        return v / (n_seq * per_seq[tokens.seq].clamp_min(1.0))
    if agg == "seq-mean-token-sum":
        return v / n_seq
    return v / (n_seq * tokens.horizon)


# ---- the terms ----

def clamp_log_ratio(x: Tensor, spec: TermSpec) -> Tensor:
    """The policy ratio's log (lp - old, or its sequence mean) as the ratio's exp reads it: clamped to
    +-``spec.ratio_log_clamp`` (verl), or unchanged where that is None (TRL)."""
    c = spec.ratio_log_clamp
    return x if c is None else x.clamp(-c, c)


def _log_ratio(lp: Tensor, d: Tensor, tokens: TokenInputs, spec: TermSpec) -> tuple[Tensor, Optional[Tensor]]:
    """(log r per token, as the ratio level forms and clamps it; moves): r = exp(log r). moves, at the
    token-local levels: bool [n], where d log r / d lp of the token itself is 1 (its clamp does not bind;
    0 elsewhere, and no other token's lp enters); None at level "sequence"."""
    if spec.ratio_level == "token":
        c = spec.ratio_log_clamp
        moves = torch.ones_like(d, dtype=torch.bool) if c is None else (d >= -c) & (d <= c)
        return clamp_log_ratio(d, spec), moves
    mean = seq_mean(d, tokens, f"ratio_level={spec.ratio_level!r}")[tokens.seq]
    if spec.ratio_level == "sequence":
        return clamp_log_ratio(mean, spec), None
    return (lp - lp.detach() + mean.detach()).clamp(max=GSPO_TOKEN_LOG_MAX), mean.detach() <= GSPO_TOKEN_LOG_MAX


def kl_times_ratio(lp: Tensor, ref: Tensor, kl: Tensor, ratio: Tensor, log_ratio: Tensor, moves: Optional[Tensor],
                   kl_type: str) -> Tensor:
    """kl_ratio's term: the KL estimate ``kl`` (of ``kl_type``) times the ratio r = exp(log_ratio).

    TRL's unclamped k3 times r, (exp(ref - lp) - (ref - lp) - 1) r, has the gradient (lp - ref) r where the
    ratio moves with lp (``moves``), but taken from the product it is the sum of two parts of size
    exp(ref - lp) r of opposite signs, whose rounding swamps it once the policy lies far below the reference
    at the token: from exp(ref - lp) of about 1e5 in float32 (TRL's own evaluation), 1e12 in float64. So it
    is written exp(ref - lp + log r) - (ref - lp + 1) r, the same value, with the first part's gradient
    formed directly: 0 where the ratio moves (ref - lp + log r does not depend on lp there), -exp(ref - lp)
    r where its clamp binds. The other estimators are bounded (verl's k3 by its clamp, the "+" ones' large
    values detached) or polynomial in lp - ref, and at ratio level "sequence" the ratio couples the tokens:
    kl r there."""
    if kl_type != "k3_unclamped" or moves is None:
        return kl * ratio
    x = ref - lp
    # the exponent's value, and its gradient -1 only where log r is clamped (no lp inside it then)
    exponent = (x + log_ratio).detach() - (~moves).double() * (lp - lp.detach())
    return exponent.exp() - (x + 1.0) * ratio


def _vespo_phi(d: Tensor, adv: Tensor, tokens: TokenInputs, spec: TermSpec) -> Tensor:
    """TRL's get_gamma_weights, per token (its sequence's phi), detached. TRL adds the log of every rollout
    weight it is given: one per token, or one per sequence (its sequence modes' [B, 1] ratio), which the
    tokens here carry each, so it is counted once (the mean over the sequence of a constant)."""
    d = d.detach().clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    log_w = seq_sum(d, tokens, "surrogate='vespo'")
    if tokens.rollout_weights is not None:
        log_rho = tokens.rollout_weights.log().clamp(VESPO_LOG_MIN, RATIO_LOG_CLAMP)
        per_seq = seq_mean if spec.rollout_per_sequence else seq_sum
        log_w = log_w + per_seq(log_rho, tokens, "surrogate='vespo'")
    log_w = log_w.clamp(VESPO_LOG_MIN, RATIO_LOG_CLAMP)[tokens.seq]
    w = log_w.exp()
    pos = adv >= 0
    k = torch.where(pos, spec.vespo_pos[0], spec.vespo_neg[0])
    lam = torch.where(pos, spec.vespo_pos[1], spec.vespo_neg[1]).clamp_min(1e-4)
    return (lam + k * log_w - lam * w).exp().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _surrogate(lp: Tensor, old: Tensor, ratio: Tensor, d: Tensor, adv: Tensor, tokens: TokenInputs,
               spec: TermSpec) -> tuple[Tensor, Tensor]:
    """(pg, clipped) per token before masks and rollout weights; clipped is verl's pg_clipfrac event."""
    lo, hi = 1.0 - spec.clip_low, 1.0 + spec.clip_high
    no_clip = torch.zeros_like(adv, dtype=torch.bool)
    if spec.surrogate == "ppo":
        pg1 = -adv * ratio
        pg2 = -adv * ratio.clamp(lo, hi)
        clipped = pg2 > pg1
        if spec.delta is not None:
            pg1 = -adv * ratio.clamp(max=spec.delta)
        pg = torch.maximum(pg1, pg2)
        if spec.dual_clip is not None:
            pg = torch.where(adv < 0, torch.minimum(pg, -adv * spec.dual_clip), pg)
        return pg, clipped
    if spec.surrogate == "cispo":
        clamped = ratio.clamp(lo, hi)
        return -clamped.detach() * adv * lp, ratio != clamped
    if spec.surrogate == "sapo":
        tau = torch.where(adv > 0, spec.sapo_tau[0], spec.sapo_tau[1])
        return -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, no_clip
    if spec.surrogate == "gpg":
        return -adv * lp, no_clip
    if spec.surrogate == "dro":
        return -(lp * adv - 0.5 * spec.dro_beta * (lp - old).square()), no_clip
    if spec.surrogate == "vespo":
        return -_vespo_phi(d, adv, tokens, spec) * adv * lp, no_clip
    if spec.surrogate == "geo_mean":           # a loss per sequence: ``geo_mean_loss``
        d_clamped = d.detach().clamp(-spec.clip_low, spec.clip_high)
        return torch.zeros_like(lp), d.detach() != d_clamped
    if spec.surrogate in ("clip_cov", "kl_cov"):
        return _covariance_surrogate(lp, ratio, d, adv, spec)
    # dppo_tv, dppo_kl (verl): a detached truncated ratio, tokens outside the trust region dropped
    cap = DPPO_CAP if spec.dual_clip is None else spec.dual_clip
    lpd = lp.detach()
    p, p_old = lpd.exp(), old.exp()
    if spec.surrogate == "dppo_tv":
        keep = torch.where(adv > 0, p - p_old <= spec.clip_high, p - p_old >= -spec.clip_low)
    else:
        bkl = p_old * (old - lpd) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
        keep = torch.where(adv > 0, (bkl <= spec.clip_high) | (p <= p_old), (bkl <= spec.clip_low) | (p >= p_old))
    return -adv * ratio.detach().clamp(max=cap) * lp * keep.double(), ~keep


def _covariance_surrogate(lp: Tensor, ratio: Tensor, d: Tensor, adv: Tensor, spec: TermSpec) -> tuple[Tensor, Tensor]:
    """verl's clip_cov and kl_cov (Entropy-Mechanism-of-RL): tokens chosen by the covariance of advantage and
    log-prob over the batch. clip_cov: among the tokens the clip did not bind whose covariance lies in
    (lb, ub), ``cov_ratio`` of the batch's tokens drawn at random (torch.randperm on the default CPU
    generator, as verl draws them) get no policy-gradient term. kl_cov: the ``cov_ratio`` share with the
    largest covariance get ``cov_kl_coef`` |lp - old| added; no clipping."""
    n = adv.numel()
    lpd = lp.detach()
    cov = (adv - adv.mean()) * (lpd - lpd.mean())
    pg1 = -adv * ratio
    count = max(int(spec.cov_ratio * n), 1)
    if spec.surrogate == "kl_cov":
        chosen = torch.zeros_like(adv, dtype=torch.bool)
        if n:
            chosen[torch.topk(cov, min(count, n), largest=True).indices] = True
        return torch.where(chosen, pg1 + spec.cov_kl_coef * d.abs(), pg1), torch.zeros_like(chosen)
    pg2 = -adv * ratio.clamp(1.0 - spec.clip_low, 1.0 + spec.clip_high)
    lb, ub = spec.cov_bounds
    candidates = torch.nonzero((cov < ub) & (cov > lb) & ~(pg2 > pg1)).squeeze(1)
    chosen = torch.zeros_like(adv, dtype=torch.bool)
    if candidates.numel():
        perm = torch.randperm(candidates.numel())
        chosen[candidates[perm[:min(count, candidates.numel())].to(candidates.device)]] = True
    return torch.maximum(pg1, pg2) * (~chosen).double(), chosen


def geo_mean_loss(lp: Tensor, tokens: TokenInputs, spec: TermSpec) -> Tensor:
    """verl's geo_mean (GMPO): the mean over the batch's sequences of -mean(A) exp(mean of the token
    log-ratios, each clipped to [-clip_low, clip_high] on the side the advantage's sign selects); it
    ignores loss_agg, as verl does. With rollout weights, times their geometric mean per sequence."""
    old = tokens.old_logprobs if spec.has_old else lp.detach()
    adv = tokens.advantages
    d = lp - old
    sign = torch.sign(adv)
    d_min = sign * torch.minimum(sign * d, sign * d.clamp(-spec.clip_low, spec.clip_high))
    length = seq_sum(torch.ones_like(d), tokens, "surrogate='geo_mean'") + 1e-8
    ratio = torch.exp(seq_sum(d_min, tokens, "surrogate='geo_mean'") / length)
    pg = -(seq_sum(adv, tokens, "surrogate='geo_mean'") / length) * ratio
    if spec.has_rollout_weights:
        pg = pg * torch.exp(seq_sum(torch.log(tokens.rollout_weights + 1e-10), tokens, "rollout_weights") / length)
    return pg.sum() / max(tokens.n_seq, 1)


def _gathered(e: Tensor, group: str) -> Tensor:
    """float32 [sum of n over the ranks]: every rank's e [n] (sizes may differ), in rank order, as TRL's
    pad_across_processes + gather + drop of the padding gives them. A collective of ``group`` (by name)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group)
    size = torch.tensor([e.numel()], dtype=torch.int64, device=e.device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(sizes, size, group=pg)
    sizes = [int(n) for n in torch.cat(sizes).tolist()]
    padded = e.new_zeros(max(sizes))
    padded[:e.numel()] = e
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=pg)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def entropy_mask(ent: Tensor, quantile: float, group: Optional[str] = None) -> Tensor:
    """bool [n]: TRL's get_high_entropy_mask over these tokens (float32, as TRL computes it): the tokens
    whose entropy is at least the (1 - quantile) quantile of the scored tokens' entropies, of this call's
    tokens, or with ``group`` (a process group's name) of every rank's (TRL gathers them over its processes;
    every rank of the group must make the call)."""
    e = ent.detach().float()
    pool = e if group is None else _gathered(e, group)
    if pool.numel() == 0:
        return torch.zeros_like(e, dtype=torch.bool)
    return e >= torch.quantile(pool, 1.0 - quantile)


def rejection_keep(lp: Tensor, old: Tensor, tokens: TokenInputs, spec: TermSpec) -> Tensor:
    """bool [n]: the tokens the rejection mask keeps (module docstring; verl's compute_rollout_rejection_mask,
    token_k1 / token_k2 / token_k3), from this pass's log-probs lp (detached) against the rollout's."""
    sampling = tokens.rollout if spec.has_rollout else old
    e = (lp.detach() - sampling).nan_to_num(nan=0.0).clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP)
    keep = torch.ones_like(e, dtype=torch.bool)
    if spec.rejection_ratio is not None:
        lo, hi = spec.rejection_ratio
        if lo is not None:
            keep &= e >= math.log(lo)
        if hi is not None:
            keep &= e <= math.log(hi)
    if spec.rejection_k2 is not None:
        keep &= 0.5 * e.square() <= spec.rejection_k2
    if spec.rejection_k3 is not None:
        keep &= e.exp() - 1.0 - e <= spec.rejection_k3
    for stat, k, lo, hi in spec.rejection_seq:
        what = f"a sequence-level rejection ({stat} of {k})"
        value = {"k1": -e, "k2": 0.5 * e.square(), "k3": e.exp() - 1.0 - e}[k]
        if stat == "max":
            per_seq = value.new_zeros(tokens.n_seq).scatter_reduce(0, _need_seq(tokens, what), value, "amax",
                                                                   include_self=False)
        else:
            per_seq = (seq_sum if stat == "sum" else seq_mean)(value, tokens, what)
        if k == "k1":       # the sum (or mean) of e in [log min, log max]: exp of it in the band
            seq_keep = torch.ones_like(per_seq, dtype=torch.bool)
            if lo is not None:
                seq_keep &= -per_seq >= math.log(lo)
            if hi is not None:
                seq_keep &= -per_seq <= math.log(hi)
        else:
            seq_keep = per_seq <= hi
        keep &= seq_keep[tokens.seq]
    return keep


def rejection_factor(lp: Tensor, old: Tensor, tokens: TokenInputs, spec: TermSpec) -> Tensor:
    """float64 [n], detached: what the rejection mask multiplies the policy term by (module docstring):
    keep, and under seq-mean-token-mean keep len_i / kept_i, which turns the weight 1 / (n_seq len_i) of
    the sequence's scored tokens into 1 / (n_seq kept_i) over its kept ones."""
    keep = rejection_keep(lp, old, tokens, spec).double()
    if spec.loss_agg != "seq-mean-token-mean":
        return keep
    length = seq_sum(torch.ones_like(keep), tokens, "rejection under loss_agg='seq-mean-token-mean'")
    kept = seq_sum(keep, tokens, "rejection under loss_agg='seq-mean-token-mean'")
    return keep * (length / kept.clamp_min(1.0))[tokens.seq]


def current_is_weights(lp: Tensor, old: Tensor, tokens: TokenInputs, spec: TermSpec) -> Tensor:
    """float64 [n], detached: the IS weights of this pass's log-probs against the rollout's (module docstring;
    verl's compute_rollout_correction_weights of log_prob - rollout_log_prob, as its bypass reinforce loss
    applies them)."""
    sampling = tokens.rollout if spec.has_rollout else old
    e = (lp.detach() - sampling).nan_to_num(nan=0.0)
    if spec.current_is.startswith("sequence"):
        e = seq_sum(e, tokens, f"current_is={spec.current_is!r}")[tokens.seq]
    w = e.clamp(-RATIO_LOG_CLAMP, RATIO_LOG_CLAMP).exp()
    lo, hi = spec.current_is_band
    if spec.current_is.endswith("truncate"):
        return w.clamp(min=lo, max=hi)
    out = torch.zeros_like(w, dtype=torch.bool)
    if lo is not None:
        out |= w < lo
    if hi is not None:
        out |= w > hi
    return w.masked_fill(out, 0.0)


def per_token_terms(lp: Tensor, ent: Tensor, tokens: TokenInputs, spec: TermSpec
                    ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(f, clipped, kl) per token: the term f = pg + kl_coef kl of the module docstring (the entropy bonus
    apart: ``weighted_terms`` adds it with its own weights; so is the KL term when it has weights of its
    own, ``tokens.kl_weights``: f = pg then), verl's clip event, and the KL term as it enters the loss (None
    without ref_logprobs). lp, ent: [n] float64 (differentiable); tokens: the same
    n tokens (all of the batch when ``spec.coupled``)."""
    adv = tokens.advantages
    old = tokens.old_logprobs if spec.has_old else lp.detach()
    d = lp - old
    log_ratio, moves = _log_ratio(lp, d, tokens, spec)
    ratio = log_ratio.exp()
    pg, clipped = _surrogate(lp, old, ratio, d, adv, tokens, spec)
    if spec.off_policy_threshold is not None:
        sampling = tokens.rollout if spec.has_rollout else old
        # NaN: a token the rollout engine could not score (allowed by rollout_nan_is_missing): no evidence
        drift = (sampling - lp.detach()).nan_to_num(nan=0.0)
        mean_kl = seq_mean(drift, tokens, "off_policy_threshold")[tokens.seq]
        pg = pg * ((adv >= 0) | (mean_kl <= spec.off_policy_threshold)).double()
    if spec.entropy_quantile < 1.0:
        pg = pg * entropy_mask(ent, spec.entropy_quantile, spec.entropy_group).double()
    if spec.has_rollout_weights and spec.surrogate not in ("vespo", "geo_mean"):
        pg = pg * tokens.rollout_weights
    if spec.current_is is not None:
        pg = pg * current_is_weights(lp, old, tokens, spec)
    if spec.rejects:
        pg = pg * rejection_factor(lp, old, tokens, spec)
    f = pg
    kl = None
    if spec.has_ref:
        kl = kl_estimate(lp, tokens.ref_logprobs, spec.kl_type)
        if spec.kl_ratio:
            kl = kl_times_ratio(lp, tokens.ref_logprobs, kl, ratio, log_ratio, moves, spec.kl_type)
        if spec.kl_coef != 0.0 and tokens.kl_weights is None:
            f = f + spec.kl_coef * kl
    return f, clipped, kl


def entropy_weights(ent: Tensor, tokens: TokenInputs, spec: TermSpec) -> Tensor:
    """float64 [n]: u, the entropy bonus's weights: those of ``entropy_agg`` (or the loss's aggregation)
    over the scored tokens, or, with the entropy mask, over the tokens it keeps (TRL's effective mask)."""
    if spec.entropy_quantile >= 1.0:
        return tokens.weights if tokens.ent_weights is None else tokens.ent_weights
    keep = entropy_mask(ent, spec.entropy_quantile, spec.entropy_group)
    return mask_weights(keep, tokens, spec.entropy_agg or spec.loss_agg)


@dataclass
class TermTotals:
    """Running sums over chunks, as 0-d float64 tensors (no host synchronisation per chunk)."""
    loss: Tensor
    clipped: Tensor
    kl: Optional[Tensor]
    sums: Tensor          # float64 [3]: the three above are its views (kl's slot stays 0 without it)
    extra: dict = field(default_factory=dict)

    @classmethod
    def zeros(cls, device, with_kl: bool) -> "TermTotals":
        z = torch.zeros(3, dtype=torch.float64, device=device)    # one fill: views summed into in place
        return cls(z[0], z[1], z[2] if with_kl else None, z)


def weighted_terms(lp: Tensor, ent: Tensor, tokens: TokenInputs, spec: TermSpec):
    """(sum_i w_i f_i [+ kl_coef sum_i v_i kl_i] - entropy_coef sum_i u_i H_i, number clipped,
    sum_i v_i kl_i or None; v = w unless the KL term has weights of its own), from float64 lp / ent [n];
    differentiable in lp and ent. The reference path and coupled losses call this on the
    whole batch, the fused pass of a token-local loss on each chunk."""
    f, clipped, kl = per_token_terms(lp, ent, tokens, spec)
    w = tokens.weights
    loss = (w * f).sum()
    if spec.surrogate == "geo_mean":
        loss = loss + geo_mean_loss(lp, tokens, spec)
    v = w if tokens.kl_weights is None else tokens.kl_weights
    if kl is not None and tokens.kl_weights is not None and spec.kl_coef != 0.0:
        loss = loss + spec.kl_coef * (v * kl).sum()
    if spec.uses_entropy:
        loss = loss - spec.entropy_coef * (entropy_weights(ent, tokens, spec) * ent).sum()
    return loss, clipped.sum(dtype=torch.float64), None if kl is None else (v * kl.detach()).sum()


def chunk_gradients(lp: Tensor, ent: Tensor, tokens: TokenInputs, spec: TermSpec, totals: TermTotals
                    ) -> tuple[Tensor, Optional[Tensor]]:
    """d(loss)/d lp_i and /d ent_i (float32 [n]; the entropy one None when the loss does not depend on
    the entropy), for float32 lp / ent [n] of one chunk; adds the chunk's sums to ``totals``."""
    with torch.enable_grad():
        lp64 = lp.detach().double().requires_grad_(True)
        ent64 = ent.detach().double().requires_grad_(spec.uses_entropy)
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
