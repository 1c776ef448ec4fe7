"""TRL's GRPOTrainer on logitless: ``enable(trainer)`` replaces, on that trainer instance only, the
method that computes per-token log-probs and entropies (``_get_per_token_logps_and_entropies``,
used for the policy's loss and for the old / reference log-probs) with one that calls
``logitless.transformers.fused_forward``: no [tokens x vocab] logits.

Everything else is TRL's: the trainer's temperature, the completion mask (prompt and padding are not
scored), the micro-batching (``batch_size``), autocast, and ``_compute_loss`` with its loss types,
clipping, KL, entropy masking (``top_entropy_quantile``) and entropy bonus. The method keeps TRL's
signature and returns TRL's ``(logps, entropies, aux_loss)``: float32 [b, logits_to_keep], the
entropies None unless asked for, aux_loss None.
"""
from __future__ import annotations

import types

import torch

from .. import checks
from ..record import serial_now, write_step
from .names import METHOD, STATE, VISION_ARGS
from .swap import restore_method
from .truncation import rollout_truncation, rollout_truncation_of


def grpo_trainer_class():
    try:
        from trl import GRPOTrainer
    except Exception as exc:  # noqa: BLE001 - any failure means trl cannot be used here
        raise ImportError(f"logitless.trl needs trl ({type(exc).__name__}: {exc})") from exc
    return GRPOTrainer


def _check_trainer(trainer):
    cls = grpo_trainer_class()
    if not isinstance(trainer, cls):
        raise TypeError(f"trainer must be a trl.GRPOTrainer instance, got {type(trainer).__name__}")


def _check_supported(trainer):
    """Settings whose per-token computation logitless does not reproduce: refused, never approximated."""
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError("trainer.aux_loss_enabled (router_aux_loss_coef != 0 on an MoE model): the MoE "
                         "load-balancing loss needs router logits, which logitless' fused forward does not return; "
                         "set router_aux_loss_coef=0 or leave logitless disabled")
    _check_model(trainer)


def _check_model(trainer):
    """The policy's (and the reference model's) head, checked now rather than at the first step: a head
    logitless cannot compute exactly (a bias, an adapter on it, a softcap without a rule) is a ValueError
    here. A softcapped head (Gemma 2 / 3's final_logit_softcapping) is computed exactly, cap included."""
    from ..transformers import unwrap_model
    from ..transformers.heads import plan_head

    for name in ("model", "ref_model"):
        model = getattr(trainer, name, None)
        if model is None:
            continue
        try:
            plan_head(unwrap_model(model))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"logitless.trl.enable: trainer.{name} cannot be scored by logitless: {exc}") from exc


def head_context(trainer):
    """The context the head runs in: float32 under TRL's cast_lm_head_to_fp32 (TRL computes the logits
    from float32 hidden states and weight outside autocast), else the trainer's own (autocast) dtype."""
    from ..transformers import head_in_fp32
    return head_in_fp32(bool(getattr(trainer.args, "cast_lm_head_to_fp32", False)))


def get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                      compute_entropy=False, compute_aux_loss=False, pixel_values=None,
                                      image_grid_thw=None, num_images=None, pixel_attention_mask=None,
                                      spatial_shapes=None, num_tiles=None, image_sizes=None, token_type_ids=None,
                                      mm_token_type_ids=None, image_position_ids=None):
    """logitless in place of GRPOTrainer._get_per_token_logps_and_entropies (same arguments, same
    returns): log-probs of the completion tokens, and their entropies, from fused_forward."""
    from ..transformers import fused_forward

    given = locals()
    vision = [name for name in VISION_ARGS if given[name] is not None]
    if vision:
        raise ValueError(f"logitless.trl scores text-only models; got {', '.join(vision)} (multimodal inputs): "
                         "disable logitless for this trainer")
    if compute_aux_loss:
        raise ValueError("compute_aux_loss=True: logitless' fused forward returns no router logits for the MoE "
                         "auxiliary loss")
    checks.integer(logits_to_keep, "logits_to_keep", minimum=1)
    batch_size = batch_size or input_ids.size(0)
    since = serial_now()
    all_logps, all_entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        end = min(start + batch_size, input_ids.size(0))
        ids, mask = input_ids[start:end], attention_mask[start:end]
        # TRL's rule: only completion tokens are scored (padding and the prompt get -100) ...
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        # ... and position t is scored against token t + 1: the shifted labels fused_forward takes as given
        targets = torch.full_like(labels, -100)
        targets[:, :-1] = labels[:, 1:]
        kwargs = {}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids[start:end]
        with self.accelerator.autocast(), head_context(self):
            out = fused_forward(model, ids, mask, shift_labels=targets, temperature=self.temperature,
                                with_entropy=bool(compute_entropy), truncation=rollout_truncation_of(self),
                                **kwargs)
        # TRL's log_probs has seq_len - 1 columns (position t for t < s - 1); it keeps the last logits_to_keep
        all_logps.append(out.logprobs[:, :-1][:, -logits_to_keep:])
        if compute_entropy:
            all_entropies.append(out.entropy[:, :-1][:, -logits_to_keep:])
    logps = torch.cat(all_logps, dim=0)
    entropies = torch.cat(all_entropies, dim=0) if compute_entropy else None
    write_step("trl.grpo.logprobs", since)
    return logps, entropies, None


def enable(trainer, *, fused_loss: bool = False, truncation: bool = False):
    """Compute ``trainer``'s per-token log-probs and entropies with logitless (no logits).

    Only this instance changes (an instance attribute shadows the method); the GRPOTrainer class and
    every other trainer keep TRL's computation. Idempotent (enabling again only updates the
    settings); ``disable(trainer)`` restores TRL's method exactly. Returns ``trainer``.

    fused_loss: also compute the policy loss with ``logitless.losses``' fused policy loss (every TRL loss
        setting mapped onto it: ``logitless.trl.loss``, docs/trl.md), logging TRL's metrics; settings that
        cannot be mapped raise ValueError naming them.
    truncation: score every log-prob (the policy's, the old and the reference ones) and entropy under the rollout's
        own truncation, read from the trainer's settings now (``logitless.trl.truncation``: ValueError for what
        logitless cannot reproduce).

    The model's head is checked here (ValueError for one logitless cannot compute exactly), not at the
    first step; a softcapped head is supported, and ``cast_lm_head_to_fp32`` computes the head in float32.
    """
    _check_trainer(trainer)
    checks.boolean(fused_loss, "fused_loss")
    checks.boolean(truncation, "truncation")
    _check_supported(trainer)
    trunc = None
    if truncation:
        trunc = rollout_truncation(trainer)
    if fused_loss:
        from .loss import check_mappable
        check_mappable(trainer)
    state = trainer.__dict__.get(STATE)
    if state is None:
        state = {"previous": {name: trainer.__dict__[name] for name in (METHOD, "_compute_loss")
                              if name in trainer.__dict__}}
        trainer.__dict__[STATE] = state
        trainer.__dict__[METHOD] = types.MethodType(get_per_token_logps_and_entropies, trainer)
    state["fused_loss"] = fused_loss
    state["truncation"] = trunc
    if fused_loss:
        from .loss import compute_loss
        trainer.__dict__["_compute_loss"] = types.MethodType(compute_loss, trainer)
    else:
        restore_method(trainer, state, "_compute_loss")
    return trainer


def disable(trainer):
    """Undo ``enable``: TRL's own methods again (a no-op on a trainer that is not enabled). Returns ``trainer``."""
    _check_trainer(trainer)
    state = trainer.__dict__.pop(STATE, None)
    if state is not None:
        for name in (METHOD, "_compute_loss"):
            restore_method(trainer, state, name)
    return trainer


def is_enabled(trainer) -> bool:
    """Whether ``enable(trainer)`` is in effect on this trainer."""
    return STATE in getattr(trainer, "__dict__", {})
