"""logitless for TRL: ``logitless.trl.enable(trainer)`` on a ``trl.GRPOTrainer`` instance computes its
per-token log-probs and entropies with ``logitless.transformers.fused_forward`` (no logits); TRL's
temperature, completion masks, entropy masking and loss stay TRL's. ``disable(trainer)`` restores it.
``enable(trainer, fused_loss=True)`` also computes the loss with logitless' fused policy loss (every TRL
loss setting mapped, TRL's metrics logged; what cannot be mapped is refused by name; docs/trl.md).

Modules: ``grpo`` (the instance patch), ``loss`` (the fused-loss mapping)."""
from .grpo import disable, enable, is_enabled

__all__ = ["enable", "disable", "is_enabled"]
