"""logitless for TRL. ``logitless.trl.enable(trainer)``:

- on a ``trl.GRPOTrainer`` computes its per-token log-probs and entropies with
  ``logitless.transformers.fused_forward`` (no logits); TRL's temperature, completion masks, entropy masking and
  loss stay TRL's. ``enable(trainer, fused_loss=True)`` also computes the loss with logitless' fused policy loss
  (every TRL loss setting mapped, TRL's metrics logged; what cannot be mapped is refused by name);
  ``enable(trainer, truncation=True)`` scores them under the rollout's own top_k / top_p / min_p (``truncation``);
- on a ``trl.DistillationTrainer`` computes its loss (TRL's generalized JSD between the student's and the teacher's
  next-token distributions) with ``logitless.losses.fused_distillation_loss`` from both models' last hidden states
  and heads; TRL's normalisation and metrics stay TRL's;
- on ``trl.experimental``'s ``GKDTrainer`` / ``GOLDTrainer`` computes their loss (the same generalized JSD, from each
  model's own head transform) the same way; GOLD's ULD loss is refused.

``disable(trainer)`` restores TRL's methods (docs/trl.md).

Modules: ``enable`` (the entry points), ``grpo`` (GRPOTrainer's instance patch), ``loss`` (its fused-loss mapping),
``truncation`` (the rollout's truncation read from the trainer), ``distillation`` (DistillationTrainer's), ``gkd``
(GKDTrainer's and GOLDTrainer's), ``names`` (TRL's names they read)."""
from .enable import disable, enable, is_enabled

__all__ = ["enable", "disable", "is_enabled"]
