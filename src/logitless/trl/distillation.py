"""TRL's DistillationTrainer on logitless: ``enable(trainer)`` replaces, on that trainer instance only, the method
``_compute_loss`` (what ``DistillationTrainer.compute_loss`` runs inside the student's wrapper: both models' last
hidden states at the completion positions, then TRL's generalized JSD from both LM heads through
``trl.kernels.ChunkedDivergenceFunction``) with one that computes the same loss with
``logitless.losses.fused_distillation_loss``: four GEMMs, no [tokens x vocab] tile recomputed in the backward.

What stays TRL's: the trainer's ``compute_loss`` (its ``num_items_in_batch`` over the generated completions divided by
the process count, the forward redirection through the student's wrapper, the "entropy" metric it logs from what
``_compute_loss`` returns), the backbones' calls (``_get_last_hidden_state``, the teacher's through its own wrapper,
under ``no_grad``), the completion and tool masks, training_step and gradient accumulation. The replacement returns
TRL's triple ``(loss, entropy_sum, n_valid)``.

TRL's settings map as follows:

    beta                    -> divergence "jsd" with beta (0 forward KL, 1 reverse KL, TRL's generalized JSD)
    temperature             -> temperature (both heads, after the logit scale and softcap)
    num_items_in_batch      -> num_items_in_batch (sum / count); None: token-mean over the scored tokens
    completion_mask * tool_mask -> the scored tokens (labels; ignore_index elsewhere)
    each model's logit scale and final_logit_softcapping, read from its text config as TRL reads them
                            -> student_/teacher_logit_scale, student_/teacher_softcap
    the heads' operand dtype: autocast's dtype under autocast, else the hidden states' (TRL's rule; a float32 head on
                            a bf16 model is multiplied in bf16, as TRL does)

Refused at ``enable`` (``check_mappable``), by name: no teacher, an LM head with a bias (TRL adds it; the fused op
has none), an adapter on a head, a vision-language trainer, a tensor-parallel student head, a beta outside [0, 1], a
temperature that is not positive. Sharded heads: the student's runs the op as its own forward (``call_head``: FSDP2 /
ZeRO-3 gather it and reduce its gradient); the teacher's is gathered whole for the call (``whole_weight``).
"""
from __future__ import annotations

from numbers import Real

import torch

from ..record import serial_now, write_step
from ..sharded_head import call_head, check_layout, head_shape, inner_head, is_dtensor, whole_weight
from .names import VISION_ARGS
from .swap import check_fused_loss, disable_loss_method, enable_loss_method

METHOD = "_compute_loss"
# the loss's scored tokens carry their completion id; the rest this
IGNORE = -100
# multimodal fields DistillationTrainer forwards to the backbones: logitless scores text-only models
MULTIMODAL = VISION_ARGS + ("token_type_ids",)


def trainer_class():
    try:
        from trl import DistillationTrainer
    except Exception as exc:  # noqa: BLE001 - any failure means trl cannot be used here
        raise ImportError(f"logitless.trl needs trl ({type(exc).__name__}: {exc})") from exc
    return DistillationTrainer


def is_distillation_trainer(trainer) -> bool:
    try:
        return isinstance(trainer, trainer_class())
    except ImportError:
        return False


# A model's logit multiplier as TRL's DistillationTrainer reads it from the text config: the first of these
# attributes that is set, and whether it multiplies or divides (logits_scaling divides, except on HyperCLOVA X)
_SCALE_READS = (("logit_scale", "mul"), ("output_multiplier", "mul"), ("lm_head_multiplier", "mul"),
                ("logits_scaling", "div"))


def logit_scale(config) -> float:
    """The multiplier TRL applies to this model's logits before the softcap (1.0 when none is set)."""
    for attr, how in _SCALE_READS:
        value = getattr(config, attr, None)
        if value is None:
            continue
        value = float(value)
        if how == "div" and getattr(config, "model_type", None) != "hyperclovax":
            return 1.0 / value
        return value
    return 1.0


def head_settings(model, who: str) -> dict:
    """fused_distillation_loss's keywords for this (unwrapped) model's head, as TRL applies them."""
    config = model.config.get_text_config()
    return {f"{who}_logit_scale": logit_scale(config),
            f"{who}_softcap": getattr(config, "final_logit_softcapping", None)}


def _head_problems(trainer, name: str, model) -> list:
    """Why this model's head cannot be computed as TRL computes it here ([] when it can)."""
    from ..transformers import unwrap_model

    inner = unwrap_model(model)
    get_out = getattr(inner, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        return [f"trainer.{name} has no output embeddings (get_output_embeddings() is None)"]
    head = inner_head(head)
    bad = []
    if hasattr(head, "base_layer") or type(head).__module__.split(".")[0] == "peft":
        bad.append(f"trainer.{name}'s lm_head is wrapped by an adapter ({type(head).__name__}): leave lm_head out of "
                   "the adapter's target_modules")
    weight = getattr(head, "weight", None)
    shape = head_shape(weight) if isinstance(weight, torch.Tensor) else None
    if shape is None or len(shape) != 2:
        bad.append(f"trainer.{name}'s lm_head is a {type(head).__name__} without a 2-D weight [vocab, hidden]")
    if getattr(head, "bias", None) is not None:
        bad.append(f"trainer.{name}'s lm_head.bias (TRL adds it to the logits; the fused loss has no bias term)")
    settings = head_settings(inner, "x")
    scale, cap = settings["x_logit_scale"], settings["x_softcap"]
    if not (isinstance(scale, Real) and torch.isfinite(torch.tensor(float(scale)))):
        bad.append(f"trainer.{name}'s logit scale {scale!r} (not a finite number)")
    if cap is not None and not (isinstance(cap, Real) and 0 < float(cap) < float("inf")):
        bad.append(f"trainer.{name}'s final_logit_softcapping={cap!r} (must be finite and > 0)")
    if name == "model" and isinstance(weight, torch.Tensor) and is_dtensor(weight):
        try:
            check_layout(inner, weight, "lm_head.weight")
        except ValueError:
            bad.append("trainer.model's lm_head.weight is a tensor-parallel DTensor (the teacher's head would need "
                       "the same vocabulary shard)")
    return bad


def unmappable(trainer) -> list:
    """The trainer's settings that the fused distillation loss cannot reproduce, as "name (why)"."""
    bad = []
    if getattr(trainer, "teacher_model", None) is None:
        return ["teacher_model=None (the loss needs the teacher's head)"]
    beta = trainer.beta
    if isinstance(beta, bool) or not isinstance(beta, Real) or not 0.0 <= float(beta) <= 1.0:
        bad.append(f"beta={beta!r} (TRL's generalized JSD takes beta in [0, 1])")
    temp = trainer.temperature
    if isinstance(temp, bool) or not isinstance(temp, Real) or not 0.0 < float(temp) < float("inf"):
        bad.append(f"temperature={temp!r} (must be finite and > 0)")
    if getattr(trainer, "_is_vlm", False):
        bad.append("a vision-language model (logitless.trl scores text-only models)")
    for name in ("model", "teacher_model"):
        bad += _head_problems(trainer, name, getattr(trainer, name))
    return bad


def check_mappable(trainer) -> None:
    """ValueError naming every DistillationTrainer setting that the fused loss cannot reproduce."""
    bad = unmappable(trainer)
    if bad:
        raise ValueError("logitless.trl.enable cannot compute this DistillationTrainer's loss with "
                         "fused_distillation_loss: " + "; ".join(bad) + ". Leave logitless disabled for this trainer")


def _operands(hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
    """(hidden, weight) in the dtype TRL's chunked divergence multiplies them in: autocast's under autocast, else
    the hidden states'."""
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    return hidden.to(dtype), weight.to(dtype)


def batch_labels(inputs) -> tuple:
    """(input_ids, attention_mask, labels [B, K]) of a DistillationTrainer batch: labels hold the completion ids
    where TRL's loss mask (completion_mask, times tool_mask in multi-turn tool calls) is set, IGNORE elsewhere."""
    extra = [name for name in MULTIMODAL if inputs.get(name) is not None]
    if extra:
        raise ValueError(f"logitless.trl scores text-only models; the batch has {', '.join(extra)} (multimodal "
                         "inputs): disable logitless for this trainer")
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    labels = completion_ids.masked_fill(mask == 0, IGNORE)
    return input_ids, attention_mask, labels


def compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
    """logitless in place of DistillationTrainer._compute_loss (same arguments, same returns: the loss, the
    detached sum of the student's entropy over the scored tokens, their count)."""
    from ..losses import fused_distillation_loss

    input_ids, attention_mask, labels = batch_labels(inputs)
    k = labels.shape[1]
    student_hidden = self._get_last_hidden_state(unwrapped_student, input_ids, attention_mask, k)
    self.teacher_model.eval()
    unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
    with torch.no_grad():
        # the teacher's backbone through its own wrapper, so FSDP / DDP gather its parameters, as TRL runs it
        teacher_hidden = self._forward_redirection(self.teacher_model, unwrapped_teacher, self._get_last_hidden_state,
                                                   unwrapped_teacher, input_ids, attention_mask, k)
    settings = {**head_settings(unwrapped_student, "student"), **head_settings(unwrapped_teacher, "teacher")}
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(labels.device)

    def compute(hidden, weight, tp_group):
        # run as the student head's forward (sharded_head.call_head): whatever shards the head gathers it
        hs, ws = _operands(hidden, weight)
        # the teacher's head, whole and without gradient for this call: an FSDP2 DTensor or a ZeRO-3 partition
        # gathered (whole_weight)
        with whole_weight(unwrapped_teacher.get_output_embeddings()) as teacher_weight:
            ht, wt = _operands(teacher_hidden.to(ws.device), teacher_weight.to(ws.device))
            with torch.autocast(hs.device.type, enabled=False):
                out = fused_distillation_loss(hs, ws, labels.to(hs.device), teacher_hidden=ht, teacher_weight=wt,
                                              divergence="jsd", beta=float(self.beta),
                                              temperature=float(self.temperature),
                                              num_items_in_batch=num_items_in_batch, ignore_index=IGNORE, **settings)
        return out.loss, out.entropy

    student_head = unwrapped_student.get_output_embeddings()
    head_device = inner_head(student_head).weight.device
    since = serial_now()
    loss, entropy = call_head(student_head, student_hidden.to(head_device), compute, owner=unwrapped_student)
    write_step("trl.distillation", since)
    n_valid = (labels != IGNORE).sum()
    return loss, entropy.float().sum().detach(), n_valid


def enable(trainer, *, fused_loss=None):
    """``logitless.trl.enable`` on a DistillationTrainer (see ``logitless.trl.enable``): the loss is always
    fused; ``fused_loss`` may be left out or True (False, log-probs only, has no meaning for this trainer)."""
    check_fused_loss(fused_loss, "DistillationTrainer")
    check_mappable(trainer)
    return enable_loss_method(trainer, METHOD, compute_loss)


def disable(trainer):
    """Undo ``enable``: TRL's own ``_compute_loss`` again (a no-op on a trainer that is not enabled)."""
    return disable_loss_method(trainer, METHOD)
