"""Fused policy losses: the whole PPO / GRPO head (log-probs, entropy, clipped surrogate, KL, entropy
bonus, aggregation) from the last hidden states and the LM-head weight, with gradients formed in the
same pass that computes the statistics (three GEMMs), never building the logits.

Modules: ``api`` (``fused_policy_loss``, ``policy_loss_reference``, ``PolicyLossOutput``), ``policy``
(``PolicyLoss``: inputs and settings, checked once), ``aggregate`` (the per-token weights of each
``loss_agg``), ``tokens`` (the scored tokens, flattened), ``function`` (the custom op and its autograd). The per-token
term, written once with its derivatives, is ``logitless.ops.policy_terms`` (read by every pass); the pass
itself is ``logitless.ops.policy_parts``.
"""
from ..ops.policy_terms import KL_TYPES
from .aggregate import LOSS_AGGS
from .api import PolicyLossOutput, fused_policy_loss, policy_loss, policy_loss_reference
from .policy import PolicyLoss

__all__ = ["fused_policy_loss", "policy_loss_reference", "policy_loss", "PolicyLoss", "PolicyLossOutput",
           "LOSS_AGGS", "KL_TYPES"]
