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
from ..ops.policy_terms import KL_TYPES, TermSpec
from .aggregate import check_loss_agg


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
        they differ); clip_low in [0, 1), clip_high >= 0.
    dual_clip: None, or c > 1: for negative advantages the term is at most -A * c (dual-clip PPO).
    kl_coef: weight of the KL estimate in the loss (needs ref_logprobs when not 0).
    kl_type: "k1" ("kl"), "k2" ("mse"), "k3" ("low_var_kl"), "abs", or "k1+" / "k3+" (value of k1 / k3,
        gradient of k2), as verl names them.
    entropy_coef: the loss subtracts entropy_coef * entropy (an entropy bonus when > 0).
    loss_agg: "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
        "seq-mean-token-sum-norm" (verl's meanings; see ``aggregate.py``).
    cu_seqlens: for packed 1-D labels, int [k + 1] sequence boundaries (the sequence aggregations need them).
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

    def __post_init__(self):
        checks.tensor(self.advantages, "advantages")
        _optional_tensor(self.advantages, "advantages")
        _optional_tensor(self.old_logprobs, "old_logprobs")
        _optional_tensor(self.ref_logprobs, "ref_logprobs")
        if self.cu_seqlens is not None:
            checks.index_tensor(self.cu_seqlens, "cu_seqlens")
        set_ = object.__setattr__
        set_(self, "clip_low", checks.finite_float(self.clip_low, "clip_low", minimum=0.0))
        if self.clip_low >= 1.0:
            raise ValueError(f"clip_low must lie in [0, 1) (the ratio's lower bound is 1 - clip_low > 0), "
                             f"got {self.clip_low!r}")
        set_(self, "clip_high", checks.finite_float(self.clip_high, "clip_high", minimum=0.0))
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

    def term_spec(self) -> TermSpec:
        return TermSpec(clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip,
                        kl_coef=self.kl_coef, kl_type=KL_TYPES[self.kl_type], entropy_coef=self.entropy_coef,
                        has_old=self.old_logprobs is not None, has_ref=self.ref_logprobs is not None)
