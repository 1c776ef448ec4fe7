"""Fused policy losses: the whole PPO / GRPO head (log-probs, entropy, the policy-gradient surrogate, KL,
entropy bonus, masks, rollout correction, aggregation) from the last hidden states and the LM-head weight,
never building the logits. Token-local losses form their gradients in the pass that computes the
statistics (three GEMMs); losses that couple tokens (sequence-level ratios, batch-level selections) take
a statistics pass, the per-token coefficients in float64, and a gradient pass. docs/policy-loss.md defines
every loss by name.

Modules: ``api`` (``fused_policy_loss``, ``policy_loss_reference``, ``PolicyLossOutput``), ``policy``
(``PolicyLoss``: inputs and settings, checked once), ``aggregate`` (the per-token weights of each
``loss_agg``), ``tokens`` (the scored tokens, flattened), ``function`` (the custom op and its autograd);
``distillation`` (``fused_distillation_loss``: a student trained toward a teacher, full vocabulary or top-k;
docs/distillation.md), its op ``distill_function``. The policy loss's per-token
term, written once with its derivatives, is ``logitless.ops.policy_terms`` (read by every pass); the pass
itself is ``logitless.ops.policy_parts``.
"""
from ..ops.policy_terms import KL_TYPES, RATIO_LEVELS, SURROGATES
from .aggregate import LOSS_AGGS
from .api import PolicyLossOutput, fused_policy_loss, policy_loss, policy_loss_reference
from .distillation import DIVERGENCES, DistillationOutput, fused_distillation_loss
from .policy import ROLLOUT_IS_MODES, VERL_POLICY_LOSSES, PolicyLoss, verl_loss_settings

__all__ = ["fused_policy_loss", "policy_loss_reference", "policy_loss", "PolicyLoss", "PolicyLossOutput",
           "LOSS_AGGS", "KL_TYPES", "SURROGATES", "RATIO_LEVELS", "ROLLOUT_IS_MODES", "VERL_POLICY_LOSSES",
           "verl_loss_settings", "fused_distillation_loss", "DistillationOutput", "DIVERGENCES"]
