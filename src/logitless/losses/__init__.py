"""Fused policy losses: the whole PPO / GRPO head (log-probs, entropy, clipped surrogate, KL, entropy
bonus, aggregation) from the last hidden states and the LM-head weight, with gradients formed in the
same pass that computes the statistics (three GEMMs), never building the logits.

Modules: ``api`` (``fused_policy_loss``, ``policy_loss_reference``, ``PolicyLossOutput``), ``policy``
(``PolicyLoss``: inputs and settings, checked once), ``terms`` (the per-token term, written once, and its
derivatives), ``aggregate`` (the per-token weights of each ``loss_agg``), ``tokens`` (the scored tokens,
flattened), ``function`` (the autograd Function). The pass itself is ``logitless.ops.policy``.
"""
from .aggregate import LOSS_AGGS
from .api import PolicyLossOutput, fused_policy_loss, policy_loss, policy_loss_reference
from .policy import PolicyLoss
from .terms import KL_TYPES

__all__ = ["fused_policy_loss", "policy_loss_reference", "policy_loss", "PolicyLoss", "PolicyLossOutput",
           "LOSS_AGGS", "KL_TYPES"]
