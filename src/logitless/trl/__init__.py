"""logitless for TRL: ``logitless.trl.enable(trainer)`` on a ``trl.GRPOTrainer`` instance computes its
per-token log-probs and entropies with ``logitless.transformers.fused_forward`` (no logits); TRL's
temperature, completion masks, entropy masking and loss stay TRL's. ``disable(trainer)`` restores it.

Modules: ``grpo`` (the instance patch)."""
from .grpo import disable, enable, is_enabled

__all__ = ["enable", "disable", "is_enabled"]
