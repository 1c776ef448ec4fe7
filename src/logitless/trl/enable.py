"""``logitless.trl.enable / disable / is_enabled``: one entry for every TRL trainer logitless computes, each
trainer's patch in its own module (``grpo.py``: GRPOTrainer; ``distillation.py``: DistillationTrainer; ``gkd.py``:
trl.experimental's GKDTrainer and GOLDTrainer)."""
from __future__ import annotations

from .names import STATE


def _module(trainer):
    """The module that patches this kind of trainer, or TypeError naming the kinds supported."""
    from . import distillation, gkd, grpo

    if distillation.is_distillation_trainer(trainer):
        return distillation
    if gkd.base_class(trainer) is not None:
        return gkd
    if isinstance(trainer, grpo.grpo_trainer_class()):
        return grpo
    raise TypeError(f"trainer must be a trl.GRPOTrainer or trl.DistillationTrainer instance, or a GKDTrainer / "
                    f"GOLDTrainer of trl.experimental, got {type(trainer).__name__}")


def enable(trainer, *, fused_loss=None, truncation=False):
    """Compute ``trainer``'s LM-head work with logitless (no logits); only this instance changes. Returns ``trainer``.

    GRPOTrainer: its per-token log-probs and entropies (``fused_loss=True``: the policy loss too; docs/trl.md).
    ``truncation=True`` (GRPOTrainer only): those log-probs (current, old and reference), entropies and the fused
    loss under the rollout's own truncation, read from the trainer's top_k / top_p / min_p and generation_kwargs
    (``logitless.trl.truncation``; what cannot be reproduced is a ValueError naming it).
    DistillationTrainer, and trl.experimental's GKDTrainer / GOLDTrainer: its loss, with
    ``logitless.losses.fused_distillation_loss`` from both models' last hidden states and heads (``fused_loss`` left
    out or True).
    Settings that cannot be reproduced exactly are refused here, by name (ValueError), before any step runs.
    Idempotent; ``disable(trainer)`` restores TRL's methods."""
    from ..truncation import Truncation
    from . import grpo

    if isinstance(truncation, Truncation):
        raise TypeError("truncation takes True or False: True reads the rollout's own settings from the trainer "
                        "(GRPOConfig's top_k / top_p / min_p, generation_kwargs); a Truncation object is for "
                        "logitless' functions (fused_logprobs, fused_policy_loss)")
    if not isinstance(truncation, bool):
        raise TypeError(f"truncation must be a bool, got {type(truncation).__name__}")
    module = _module(trainer)
    if truncation and module is not grpo:
        raise ValueError(f"truncation=True applies to a GRPOTrainer's rollout (sampled with top_k / top_p / min_p); "
                         f"{type(trainer).__name__}'s loss reads no sampler's log-probs")
    if module is grpo:
        return grpo.enable(trainer, fused_loss=False if fused_loss is None else fused_loss, truncation=truncation)
    return module.enable(trainer) if fused_loss is None else module.enable(trainer, fused_loss=fused_loss)


def disable(trainer):
    """Undo ``enable``: TRL's own methods again (a no-op on a trainer that is not enabled). Returns ``trainer``."""
    return _module(trainer).disable(trainer)


def is_enabled(trainer) -> bool:
    """Whether ``enable(trainer)`` is in effect on this trainer."""
    return STATE in getattr(trainer, "__dict__", {})
