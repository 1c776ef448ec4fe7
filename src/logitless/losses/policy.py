"""``PolicyLoss``: what one call of the fused policy loss computes, besides the LM head's tensors.

The per-token inputs (advantages, the behaviour and reference policies' log-probs) and the scalar
settings, checked once here, so ``fused_policy_loss``, ``policy_loss_reference`` and the integrations
(Megatron's output processor, transformers) accept the same things and refuse the same things.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import Tensor

from .. import checks
from ..ops.policy_terms import CURRENT_IS_MODES, KL_TYPES, RATIO_LEVELS, RATIO_LOG_CLAMP, SURROGATES, TermSpec
from .aggregate import check_loss_agg

# the settings that act only on the ratio's value (or the log-ratio lp - old), which is 1 (0) without old_logprobs
ON_POLICY_IDLE = ("clip_low", "clip_high", "dual_clip", "delta", "ratio_log_clamp", "dro_beta", "vespo_k_pos",
                  "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "kl_cov_coef")
ROLLOUT_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# the surrogates that read clip_low / clip_high, and those whose term reads the ratio exp(lp - old)
CLIPPED_SURROGATES = ("ppo", "cispo", "geo_mean", "clip_cov", "dppo_tv", "dppo_kl")
RATIO_SURROGATES = ("ppo", "cispo", "sapo", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")


def _optional_tensor(value, name: str) -> Optional[Tensor]:
    if value is None:
        return None
    value = checks.tensor(value, name)
    if value.requires_grad:
        raise ValueError(f"{name} must not require grad: logitless treats it as a constant")
    return value


@dataclass(frozen=True, eq=False)
class PolicyLoss:
    """A PPO / GRPO policy loss (formulas: ``logitless.ops.policy_terms`` and ``aggregate``).

    advantages: tensor broadcastable to the labels (per token [b, s], per sequence [b, 1], or 0-d).
    old_logprobs: log-probs of the labels under the behaviour policy, broadcastable to the labels; None
        means on-policy (ratio 1 in value; the gradient is that of -A * logprob).
    ref_logprobs: log-probs under the reference policy, for the KL term and metric; None for none.
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high] (DAPO's clip-higher when
        they differ); clip_low in [0, 1] (1: no lower clip), clip_high >= 0 (surrogate "cispo": >= -1, the
        bound 1 + clip_high may lie below 1, as TRL's cispo with epsilon_high < 1; never below 1 - clip_low).
    dual_clip: None, or c > 1: for negative advantages the term is at most -A * c (dual-clip PPO).
    kl_coef: weight of the KL estimate in the loss (needs ref_logprobs when not 0).
    kl_type: "k1" ("kl"), "k2" ("mse"), "k3" ("low_var_kl", clamped as verl clamps it), "abs", or "k1+" /
        "k3+" (value of k1 / k3, gradient of k2), as verl names them; "k3_unclamped" ("k3_unclamped+"):
        exp(ref - lp) - (ref - lp) - 1 without verl's clamps (TRL's estimator).
    entropy_coef: the loss subtracts entropy_coef * entropy (an entropy bonus when > 0).
    loss_agg: "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
        "seq-mean-token-sum-norm" (verl's meanings; see ``aggregate.py``).
    cu_seqlens: for packed 1-D labels, int [k + 1] sequence boundaries (the sequence aggregations need them).

    The policy-gradient term (definitions: ``logitless.ops.policy_terms``; docs/policy-loss.md):
    surrogate: "ppo" (the clipped surrogate, default), "cispo", "sapo", "gpg", "dro", "vespo", "dppo_tv",
        "dppo_kl", "geo_mean" (GMPO), "clip_cov", "kl_cov". verl's policy_loss names map onto these settings
        with ``verl_loss_settings``.
    cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_coef: clip_cov / kl_cov's share of selected tokens, clip_cov's
        covariance band, kl_cov's coefficient of |lp - old| (verl's clip_cov_ratio / kl_cov_ratio, clip_cov_lb,
        clip_cov_ub, ppo_kl_coef).
    ratio_level: "token" (default), "sequence" (GSPO's length-normalised sequence ratio, the gradient
        through the sequence mean: TRL's importance_sampling_level="sequence"), "sequence-token" (its value
        with a per-token gradient: verl's "gspo").
    delta: None, or > 1: the unclipped ratio is capped at delta (TRL's two-sided clipping).
    ratio_log_clamp: the log-ratio lp - old (at ratio_level "sequence" its sequence mean) is clamped to
        +-ratio_log_clamp before exp, its gradient 0 beyond (verl's 20, the default); None: not clamped
        (TRL's ratio, value and gradient exp(lp - old) however far the policy drifted). > 0.
    kl_ratio: multiply the KL estimate by the importance ratio (TRL's use_bias_correction_kl).
    sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0) for positive / other advantages.
    dro_beta: DRO's penalty (> 0; needed by surrogate "dro").
    vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's gamma weighting (TRL's names).
    off_policy_threshold: None, or the off-policy sequence mask's threshold on the sequence's mean
        sampling-minus-current log-prob (DeepSeek-V3.2, TRL's off_policy_mask_threshold).
    entropy_quantile: in (0, 1]; below 1 only the tokens with the top ``entropy_quantile`` share of
        entropies carry the policy-gradient term and the entropy bonus (TRL's top_entropy_quantile).
    entropy_quantile_group: None (the quantile of this call's scored tokens), or a torch.distributed process
        group (or its name): the quantile of every rank's scored tokens, as TRL's top_entropy_quantile spans
        its processes (each rank of the group makes the call; its entropies are gathered, a host sync).
    entropy_agg: None (the entropy bonus aggregated like the loss) or a ``loss_agg`` name for the bonus.
    kl_agg: None (the KL term aggregated like the loss) or a ``loss_agg`` name for the KL term (verl
        aggregates sapo's policy term by seq-mean-token-mean and its KL loss by loss_agg_mode); needs a KL term.
    rollout_logprobs: the rollout engine's log-probs of the labels (per token), for ``rollout_is`` and the
        off-policy mask (which otherwise uses old_logprobs).
    rollout_is: None, or "token_truncate" / "sequence_truncate" (TIS: the weight exp(old - rollout), per
        token or of the sequence's sum, clamped to [rollout_is_min, rollout_is_max]) or "token_mask" /
        "sequence_mask" (MIS: the weight set to 0 outside that band), multiplying the policy-gradient term
        (TRL's vllm_importance_sampling_mode); needs rollout_logprobs and old_logprobs.
    rollout_is_min, rollout_is_max: the band (None: unbounded on that side; truncation needs a maximum).
        verl's rollout_correction: rollout_is="token" / "sequence" with rollout_is_threshold=u is
        "token_truncate" / "sequence_truncate" with rollout_is_max=u; a threshold "l_u" (IcePop) is
        "token_mask" / "sequence_mask" with rollout_is_min=l, rollout_is_max=u. The log-ratio is clamped to
        +-20 before exp, as verl does.
    rollout_nan_is_missing: False (default): rollout_logprobs must be finite at every scored token (a
        ValueError names it). True: a NaN there marks a token the rollout engine could not score (vLLM's
        missing log-probs): its rollout_is log-ratio is 0 (weight 1) and it adds 0 to the off-policy mask's
        sum (still counted in the mean), as TRL's nan_to_num does.
    rollout_is_batch_normalize: divide the weights by their mean over the scored tokens (over the
        sequences, at sequence level), as verl's rollout_is_batch_normalize.
    rejection_ratio_min, rejection_ratio_max, rejection_k2_max, rejection_k3_max: a rejection mask of *this
        pass's* log-probs against the rollout's (rollout_logprobs, else old_logprobs; verl's token-level
        rollout_rs): with e = clamp(logprob - rollout, -20, 20), detached, a token is rejected where the ratio
        exp(e) lies outside [rejection_ratio_min, rejection_ratio_max] (verl's token_k1 with threshold l_u is
        the band [1 / u, 1 / l]), 0.5 e^2 > rejection_k2_max (token_k2) or exp(e) - 1 - e > rejection_k3_max
        (token_k3); the bounds given are ANDed (each > 0; None: not applied). Per sequence (verl's sequence-level
        rollout_rs; a sequence failing one is rejected whole): rejection_seq_ratio_min / _max bound exp(sum of the
        sequence's e) (seq_sum_k1 with "l_u": [1 / u, 1 / l]), rejection_seq_mean_ratio_min / _max exp(mean of
        e) (seq_mean_k1); rejection_seq_sum_k2_max, rejection_seq_sum_k3_max, rejection_seq_mean_k2_max,
        rejection_seq_mean_k3_max, rejection_seq_max_k2_max, rejection_seq_max_k3_max bound the sum, mean or
        maximum of 0.5 e^2 / exp(e) - 1 - e over the sequence's scored tokens. A rejected token's
        policy-gradient term is dropped; the aggregation keeps the scored tokens' normalisers, except that
        under seq-mean-token-mean a sequence's policy term is the mean over its kept tokens (verl's agg_loss
        over the rejection-masked mask with the mini-batch's counts given). The KL term and the entropy bonus
        keep every scored token. Needs old_logprobs or rollout_logprobs; not with surrogate "geo_mean".
    current_is: None, or "token_truncate" / "sequence_truncate" / "token_mask" / "sequence_mask": importance
        weights of *this pass's* log-probs against the rollout's (rollout_logprobs, else old_logprobs), detached,
        multiplying the policy-gradient term (verl's bypass_mode reinforce loss, whose old log-probs are the
        rollout's): exp(clamp(e, -20, 20)) per token, or per sequence of the *sum* of its tokens' e (verl's
        rollout_is "sequence"), e = logprob - rollout; clamped to [current_is_min, current_is_max] ("truncate",
        TIS: verl's threshold u is current_is_max=u) or 0 outside it ("mask", IcePop: verl's "l_u"). Needs
        old_logprobs or rollout_logprobs; not with surrogate "geo_mean".
    current_is_min, current_is_max: that band (None: unbounded on that side; truncation needs a maximum).
    rollout_weights: the rollout-correction weights themselves (per token, or per sequence [b, 1]: VESPO
        then counts each sequence's weight once in its sequence weight, as TRL does), when
        computed elsewhere (verl's rollout_is_weights, TRL's importance_sampling_ratio); not with rollout_is.
    """
    advantages: Tensor
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: Optional[float] = None
    kl_coef: float = 0.0
    kl_type: str = "k3"
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    cu_seqlens: Optional[Tensor] = None
    surrogate: str = "ppo"
    ratio_level: str = "token"
    delta: Optional[float] = None
    ratio_log_clamp: Optional[float] = RATIO_LOG_CLAMP
    kl_ratio: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dro_beta: Optional[float] = None
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_threshold: Optional[float] = None
    entropy_quantile: float = 1.0
    entropy_quantile_group: Optional[str] = None
    entropy_agg: Optional[str] = None
    kl_agg: Optional[str] = None
    rollout_logprobs: Optional[Tensor] = None
    rollout_is: Optional[str] = None
    rollout_is_min: Optional[float] = None
    rollout_is_max: Optional[float] = None
    rollout_weights: Optional[Tensor] = None
    rollout_is_batch_normalize: bool = False
    rollout_nan_is_missing: bool = False
    cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_coef: float = 1.0
    rejection_ratio_min: Optional[float] = None
    rejection_ratio_max: Optional[float] = None
    rejection_k2_max: Optional[float] = None
    rejection_k3_max: Optional[float] = None
    rejection_seq_ratio_min: Optional[float] = None
    rejection_seq_ratio_max: Optional[float] = None
    rejection_seq_mean_ratio_min: Optional[float] = None
    rejection_seq_mean_ratio_max: Optional[float] = None
    rejection_seq_sum_k2_max: Optional[float] = None
    rejection_seq_sum_k3_max: Optional[float] = None
    rejection_seq_mean_k2_max: Optional[float] = None
    rejection_seq_mean_k3_max: Optional[float] = None
    rejection_seq_max_k2_max: Optional[float] = None
    rejection_seq_max_k3_max: Optional[float] = None
    current_is: Optional[str] = None
    current_is_min: Optional[float] = None
    current_is_max: Optional[float] = None

    def __post_init__(self):
        checks.tensor(self.advantages, "advantages")
        _optional_tensor(self.advantages, "advantages")
        _optional_tensor(self.old_logprobs, "old_logprobs")
        _optional_tensor(self.ref_logprobs, "ref_logprobs")
        if self.cu_seqlens is not None:
            checks.index_tensor(self.cu_seqlens, "cu_seqlens")
        set_ = object.__setattr__
        set_(self, "clip_low", checks.finite_float(self.clip_low, "clip_low", minimum=0.0))
        if self.clip_low > 1.0:
            raise ValueError(f"clip_low must lie in [0, 1] (the ratio's lower bound 1 - clip_low >= 0; 1: none), "
                             f"got {self.clip_low!r}")
        # CISPO's detached weight is only clamped: its upper bound 1 + clip_high may lie below 1 (TRL's cispo
        # clamps the ratio at epsilon_high, 0.2 by default), down to 0
        set_(self, "clip_high", checks.finite_float(self.clip_high, "clip_high",
                                                    minimum=-1.0 if self.surrogate == "cispo" else 0.0))
        if self.clip_high < -self.clip_low:
            raise ValueError(f"clip_high={self.clip_high!r} puts the ratio's upper bound 1 + clip_high below its "
                             f"lower bound 1 - clip_low (clip_low={self.clip_low!r})")
        if self.dual_clip is not None:
            set_(self, "dual_clip", checks.finite_float(self.dual_clip, "dual_clip", minimum=1.0, above=True))
        set_(self, "kl_coef", checks.finite_float(self.kl_coef, "kl_coef"))
        set_(self, "entropy_coef", checks.finite_float(self.entropy_coef, "entropy_coef"))
        if not isinstance(self.kl_type, str):
            raise TypeError(f"kl_type must be a str, got {type(self.kl_type).__name__}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {tuple(KL_TYPES)}, got {self.kl_type!r} (a full-vocabulary KL "
                             "is not a per-token term: use fused_logprobs and your own loss)")
        if self.kl_coef != 0.0 and self.ref_logprobs is None:
            raise ValueError(f"kl_coef={self.kl_coef} needs ref_logprobs (the reference policy's log-probs)")
        check_loss_agg(self.loss_agg)
        self._check_loss_settings()

    def _check_loss_settings(self):
        set_ = object.__setattr__
        _optional_tensor(self.rollout_logprobs, "rollout_logprobs")
        _optional_tensor(self.rollout_weights, "rollout_weights")
        _choice(self.surrogate, "surrogate", SURROGATES)
        _choice(self.ratio_level, "ratio_level", RATIO_LEVELS)
        checks.boolean(self.kl_ratio, "kl_ratio")
        checks.boolean(self.rollout_is_batch_normalize, "rollout_is_batch_normalize")
        checks.boolean(self.rollout_nan_is_missing, "rollout_nan_is_missing")
        if self.delta is not None:
            set_(self, "delta", checks.finite_float(self.delta, "delta", minimum=1.0, above=True))
        if self.ratio_log_clamp is not None:
            set_(self, "ratio_log_clamp", checks.finite_float(self.ratio_log_clamp, "ratio_log_clamp", minimum=0.0,
                                                              above=True))
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            set_(self, name, checks.finite_float(getattr(self, name), name, minimum=0.0, above=True))
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            set_(self, name, checks.finite_float(getattr(self, name), name))
        if self.dro_beta is not None:
            set_(self, "dro_beta", checks.finite_float(self.dro_beta, "dro_beta", minimum=0.0, above=True))
        if self.delta is not None and self.surrogate != "ppo":
            raise ValueError(f"delta caps the ratio of the clipped surrogate; surrogate={self.surrogate!r} has none")
        if self.dual_clip is not None and self.surrogate not in ("ppo", "dppo_tv", "dppo_kl"):
            raise ValueError(f"dual_clip applies to surrogate 'ppo' (and is the ratio cap of 'dppo_*'); "
                             f"surrogate={self.surrogate!r} has no use for it")
        if self.surrogate == "dro" and self.dro_beta is None:
            raise ValueError("surrogate='dro' needs dro_beta > 0 (DRO's quadratic log-ratio penalty)")
        r = checks.finite_float(self.cov_ratio, "cov_ratio", minimum=0.0, above=True)
        if r > 1.0:
            raise ValueError(f"cov_ratio must be in (0, 1], got {r!r}")
        set_(self, "cov_ratio", r)
        for name in ("clip_cov_lb", "clip_cov_ub", "kl_cov_coef"):
            set_(self, name, checks.finite_float(getattr(self, name), name))
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}")
        if self.surrogate == "geo_mean" and (self.off_policy_threshold is not None or self.entropy_quantile < 1.0):
            raise ValueError("surrogate='geo_mean' is a loss per sequence: off_policy_threshold and entropy_quantile "
                             "(token masks) do not apply to it")
        if self.surrogate in ("vespo", "geo_mean", "clip_cov", "kl_cov") and self.ratio_level != "token":
            raise ValueError(f"surrogate={self.surrogate!r} forms its own ratios; ratio_level={self.ratio_level!r} "
                             "must be 'token'")
        if self.surrogate in ("gpg", "dro") and self.ratio_level != "token":
            raise ValueError(f"ratio_level={self.ratio_level!r} has no effect under surrogate={self.surrogate!r}, "
                             "whose term has no importance ratio; it must be 'token'")
        if self.off_policy_threshold is not None:
            set_(self, "off_policy_threshold", checks.finite_float(self.off_policy_threshold,
                                                                   "off_policy_threshold"))
        q = checks.finite_float(self.entropy_quantile, "entropy_quantile", minimum=0.0, above=True)
        if q > 1.0:
            raise ValueError(f"entropy_quantile must be in (0, 1], got {q!r}")
        set_(self, "entropy_quantile", q)
        group = self.entropy_quantile_group
        if group is not None and not isinstance(group, str):
            import torch.distributed as dist
            if not isinstance(group, dist.ProcessGroup):
                raise TypeError(f"entropy_quantile_group must be a torch.distributed ProcessGroup or its name, got "
                                f"{type(group).__name__}")
            set_(self, "entropy_quantile_group", group.group_name)     # the op takes groups by name
        if self.entropy_agg is not None:
            check_loss_agg(self.entropy_agg)
        if self.kl_agg is not None:
            check_loss_agg(self.kl_agg)
            if self.ref_logprobs is None:
                raise ValueError(f"kl_agg={self.kl_agg!r} aggregates the KL term, which needs ref_logprobs")
        if self.rollout_is is not None:
            _choice(self.rollout_is, "rollout_is", ROLLOUT_IS_MODES)
            if self.rollout_logprobs is None:
                raise ValueError(f"rollout_is={self.rollout_is!r} needs rollout_logprobs (the rollout engine's "
                                 "log-probs of the labels)")
            if self.old_logprobs is None:
                raise ValueError(f"rollout_is={self.rollout_is!r} needs old_logprobs (the weight is "
                                 "exp(old_logprobs - rollout_logprobs))")
            if self.rollout_weights is not None:
                raise ValueError("give rollout_weights or rollout_is, not both")
        for name in ("rollout_is_min", "rollout_is_max"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, checks.finite_float(value, name, minimum=0.0))
        if self.rollout_is is not None and self.rollout_is.endswith("truncate") and self.rollout_is_max is None:
            raise ValueError(f"rollout_is={self.rollout_is!r} (truncated importance sampling) needs rollout_is_max")
        if (self.rollout_is_min is not None and self.rollout_is_max is not None
                and self.rollout_is_min > self.rollout_is_max):
            raise ValueError(f"rollout_is_min={self.rollout_is_min} is above rollout_is_max={self.rollout_is_max}")
        self._check_rejection()
        self._check_current_is()
        self._check_no_idle_setting()
        if self.rollout_logprobs is not None and not self._reads_rollout_logprobs():
            raise ValueError("rollout_logprobs has no effect without rollout_is, off_policy_threshold, current_is or "
                             "a rejection_* bound (nothing else reads them): a setting without effect is refused, "
                             "not ignored (docs/policy-loss.md lists what each setting needs)")

    def _reads_rollout_logprobs(self) -> bool:
        return reads_rollout_logprobs({name: getattr(self, name) for name in self.__dataclass_fields__})

    def _idle_under(self, name: str) -> Optional[str]:
        """Under which of this loss's choices the setting ``name`` has no effect (None: it has one). One rule
        for every setting with a default: given another value where nothing reads it, it is an error."""
        surrogate = f"under surrogate={self.surrogate!r}"
        if name in ("clip_low", "clip_high") and self.surrogate not in CLIPPED_SURROGATES:
            return f"{surrogate} (no clipped ratio)"
        if name == "ratio_log_clamp" and not self.kl_ratio:
            if self.surrogate not in RATIO_SURROGATES:
                return f"{surrogate} (no importance ratio)"
            if self.ratio_level == "sequence-token":
                return "under ratio_level='sequence-token' (its ratio has its own bound)"
        if name in ("kl_type", "kl_ratio") and self.ref_logprobs is None:
            return "without ref_logprobs (no KL term)"
        if self.old_logprobs is None and on_policy_idle(name, self.surrogate, self.clip_high):
            # on-policy the ratio is exp(lp - sg(lp)) = 1 in value: no clip or cap binds, no log-ratio
            # penalty or weight moves (CISPO's bound 1 + clip_high below 1 does bind)
            return "without old_logprobs (on-policy: the ratio is 1)"
        prefixes = {"sapo_tau_": "sapo", "dro_beta": "dro", "vespo_": "vespo", "clip_cov_": "clip_cov",
                    "kl_cov_coef": "kl_cov"}
        for prefix, owner in prefixes.items():
            if name.startswith(prefix) and self.surrogate != owner:
                return surrogate
        if name == "cov_ratio" and self.surrogate not in ("clip_cov", "kl_cov"):
            return surrogate
        if (name == "loss_agg" and self.surrogate == "geo_mean" and (self.ref_logprobs is None or self.kl_agg)
                and (self.entropy_coef == 0.0 or self.entropy_agg)):
            return ("under surrogate='geo_mean' (a mean over sequences: loss_agg weighs only the KL term or metric "
                    "and the entropy bonus, and there is neither)")
        if name == "entropy_quantile_group" and self.entropy_quantile >= 1.0:
            return "under entropy_quantile=1 (no entropy mask)"
        if name == "entropy_agg" and self.entropy_coef == 0.0:
            return "under entropy_coef=0 (no entropy bonus)"
        if name in ("rollout_is_min", "rollout_is_max", "rollout_is_batch_normalize") and self.rollout_is is None:
            return "without rollout_is (no rollout importance weights are formed)"
        if name == "rollout_nan_is_missing" and self.rollout_logprobs is None:
            return "without rollout_logprobs"
        if (name == "off_policy_threshold" and self.old_logprobs is None and self.rollout_logprobs is None):
            return "without old_logprobs or rollout_logprobs (no drift to measure)"
        return None

    def _check_no_idle_setting(self):
        for name, spec in self.__dataclass_fields__.items():
            value = getattr(self, name)
            if isinstance(value, Tensor) or value == spec.default:
                continue
            under = self._idle_under(name)
            if under is not None:
                raise ValueError(f"{name}={value!r} has no effect {under}: a setting without effect is "
                                 "refused, not ignored (docs/policy-loss.md lists what each setting needs)")

    def _check_rejection(self):
        set_ = object.__setattr__
        names = [name for name in self.__dataclass_fields__ if name.startswith("rejection_")]
        for name in names:
            value = getattr(self, name)
            if value is not None:
                set_(self, name, checks.finite_float(value, name, minimum=0.0, above=True))
        given = [name for name in names if getattr(self, name) is not None]
        if not given:
            return
        for band in ("rejection_ratio", "rejection_seq_ratio", "rejection_seq_mean_ratio"):
            lo, hi = getattr(self, f"{band}_min"), getattr(self, f"{band}_max")
            if lo is not None and hi is not None and lo > hi:
                raise ValueError(f"{band}_min={lo} is above {band}_max={hi}")
        self._check_per_token_rollout_term(given[0], "the rejection mask", "is a token mask of the policy term")

    def _check_current_is(self):
        set_ = object.__setattr__
        for name in ("current_is_min", "current_is_max"):
            value = getattr(self, name)
            if value is not None:
                set_(self, name, checks.finite_float(value, name, minimum=0.0))
        if self.current_is is None:
            if self.current_is_min is not None or self.current_is_max is not None:
                raise ValueError("current_is_min / current_is_max need current_is (the weights' mode)")
            return
        _choice(self.current_is, "current_is", CURRENT_IS_MODES)
        if self.current_is.endswith("truncate") and self.current_is_max is None:
            raise ValueError(f"current_is={self.current_is!r} (truncated importance sampling) needs current_is_max")
        if (self.current_is_min is not None and self.current_is_max is not None
                and self.current_is_min > self.current_is_max):
            raise ValueError(f"current_is_min={self.current_is_min} is above current_is_max={self.current_is_max}")
        self._check_per_token_rollout_term(f"current_is={self.current_is!r}", "the weight",
                                           "weights a per-token policy term")

    def _check_per_token_rollout_term(self, what: str, term: str, role: str):
        """A term of this pass's log-probs against the rollout's (rejection sampling, current_is) needs those
        log-probs, and acts per token, which a per-sequence loss (geo_mean) has no place for."""
        if self.old_logprobs is None and self.rollout_logprobs is None:
            raise ValueError(f"{what} needs rollout_logprobs or old_logprobs ({term} compares this pass's "
                             "log-probs with the rollout's)")
        if self.surrogate == "geo_mean":
            raise ValueError(f"{what} {role}; surrogate='geo_mean' is a loss per sequence")

    def _rejection_seq(self) -> tuple:
        """TermSpec.rejection_seq: (stat, k, min, max) for each sequence-level rejection bound given."""
        out = []
        for stat, band in (("sum", "rejection_seq_ratio"), ("mean", "rejection_seq_mean_ratio")):
            lo, hi = getattr(self, f"{band}_min"), getattr(self, f"{band}_max")
            if lo is not None or hi is not None:
                out.append((stat, "k1", lo, hi))
        for stat in ("sum", "mean", "max"):
            for k in ("k2", "k3"):
                hi = getattr(self, f"rejection_seq_{stat}_{k}_max")
                if hi is not None:
                    out.append((stat, k, None, hi))
        return tuple(out)

    @property
    def rollout_per_sequence(self) -> bool:
        """Whether the rollout weights are one per sequence: rollout_is's sequence modes, or rollout_weights of
        shape [..., 1] with two or more dimensions (TRL's [B, 1] importance_sampling_ratio)."""
        if self.rollout_is is not None:
            return self.rollout_is.startswith("sequence")
        w = self.rollout_weights
        return w is not None and w.dim() >= 2 and w.shape[-1] == 1

    def term_spec(self) -> TermSpec:
        return TermSpec(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                        kl_coef=self.kl_coef, kl_type=KL_TYPES[self.kl_type], entropy_coef=self.entropy_coef,
                        has_old=self.old_logprobs is not None, has_ref=self.ref_logprobs is not None,
                        surrogate=self.surrogate, ratio_level=self.ratio_level, delta=self.delta,
                        ratio_log_clamp=self.ratio_log_clamp,
                        kl_ratio=self.kl_ratio, sapo_tau=(self.sapo_tau_pos, self.sapo_tau_neg),
                        dro_beta=self.dro_beta or 0.0, vespo_pos=(self.vespo_k_pos, self.vespo_lambda_pos),
                        vespo_neg=(self.vespo_k_neg, self.vespo_lambda_neg),
                        off_policy_threshold=self.off_policy_threshold, entropy_quantile=self.entropy_quantile,
                        entropy_group=self.entropy_quantile_group,
                        entropy_agg=self.entropy_agg, kl_agg=self.kl_agg, loss_agg=self.loss_agg,
                        has_rollout=self.rollout_logprobs is not None,
                        has_rollout_weights=self.rollout_weights is not None or self.rollout_is is not None,
                        rollout_per_sequence=self.rollout_per_sequence,
                        cov_ratio=self.cov_ratio, cov_bounds=(self.clip_cov_lb, self.clip_cov_ub),
                        cov_kl_coef=self.kl_cov_coef,
                        rejection_ratio=(None if self.rejection_ratio_min is None and self.rejection_ratio_max is None
                                         else (self.rejection_ratio_min, self.rejection_ratio_max)),
                        rejection_k2=self.rejection_k2_max, rejection_k3=self.rejection_k3_max,
                        rejection_seq=self._rejection_seq(),
                        current_is=self.current_is, current_is_band=(self.current_is_min, self.current_is_max))


def on_policy_idle(name: str, surrogate: str, clip_high: float) -> bool:
    """Whether the setting ``name`` has no effect without old_logprobs (see ``ON_POLICY_IDLE``): CISPO's
    clip_high below 0 (a bound below ratio 1) binds (and its band needs clip_low >= -clip_high), and kl_cov's
    cov_ratio selects where a 0 penalty goes."""
    if name in ("clip_low", "clip_high") and surrogate == "cispo" and clip_high < 0.0:
        return False
    return name in ON_POLICY_IDLE or (name == "cov_ratio" and surrogate == "kl_cov")


def on_policy_settings(settings: dict) -> dict:
    """PolicyLoss settings (by name) without those that have no effect when old_logprobs is None (which the loss
    refuses there): for an integration that maps a trainer's settings onto a batch that may be on-policy."""
    surrogate, clip_high = settings.get("surrogate", "ppo"), settings.get("clip_high", 0.0)
    return {k: v for k, v in settings.items() if not on_policy_idle(k, surrogate, clip_high)}


def reads_rollout_logprobs(settings: dict) -> bool:
    """Whether PolicyLoss settings (by name) read rollout_logprobs: rollout_is, the off-policy mask, current_is
    or a rejection bound. Without one, rollout_logprobs has no effect (and is refused)."""
    return any(settings.get(name) is not None for name in ("rollout_is", "off_policy_threshold", "current_is")) or any(
        value is not None for name, value in settings.items() if name.startswith("rejection_"))


def _choice(value, name: str, allowed) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


# verl's actor.policy_loss.loss_mode names -> PolicyLoss settings (verl's clip_ratio_c is dual_clip for
# "vanilla" and the ratio cap of "dppo_*"; its policy_loss.clip_cov_ratio / kl_cov_ratio are cov_ratio,
# clip_cov_lb / _ub the same, ppo_kl_coef is kl_cov_coef, dro_beta the same)
VERL_POLICY_LOSSES = {
    "vanilla": {"surrogate": "ppo"},
    "gspo": {"surrogate": "ppo", "ratio_level": "sequence-token"},
    "sapo": {"surrogate": "sapo"},
    "gpg": {"surrogate": "gpg"},
    "cispo": {"surrogate": "cispo"},
    "dro": {"surrogate": "dro"},
    "dppo_tv": {"surrogate": "dppo_tv"},
    "dppo_kl": {"surrogate": "dppo_kl"},
    "geo_mean": {"surrogate": "geo_mean"},
    "clip_cov": {"surrogate": "clip_cov"},
    "kl_cov": {"surrogate": "kl_cov"},
}


def verl_loss_settings(loss_mode: str) -> dict:
    """PolicyLoss keyword arguments for verl's ``policy_loss.loss_mode`` (a copy; ValueError for others)."""
    if loss_mode not in VERL_POLICY_LOSSES:
        raise ValueError(f"loss_mode must be one of {tuple(VERL_POLICY_LOSSES)}, got {loss_mode!r}")
    return dict(VERL_POLICY_LOSSES[loss_mode])
