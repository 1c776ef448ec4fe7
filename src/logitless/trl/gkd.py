"""TRL's GKDTrainer and GOLDTrainer (``trl.experimental``) on logitless: ``enable(trainer)`` replaces, on that
trainer instance only, ``compute_loss`` (both models' full forwards, then the class's ``generalized_jsd_loss`` of
their logits) with one that computes the same loss with ``logitless.losses.fused_distillation_loss`` from both
models' last hidden states and heads: no [tokens x vocab] logits.

Both trainers score position t of ``input_ids`` against ``labels[t + 1]`` (TRL's causal shift; -100 where not
scored: the prompt and padding), with the generalized JSD of the two models' next-token distributions:

    beta                  -> divergence "jsd" with beta (0 forward KL, 1 reverse KL; the same mixture as
                             DistillationTrainer's)
    temperature           -> GOLDTrainer: its ``temperature`` (its loss divides both models' logits by it);
                             GKDTrainer: 1 (its ``temperature`` is the sampling's only: its loss takes the default)
    num_items_in_batch    -> num_items_in_batch (sum / count); None: 'batchmean', the mean over the scored tokens
                             (0 when there is none, as TRL's count clamped to 1)
    each model's logits   -> its own forward's head transform (``logitless.transformers.heads.plan_head``: Cohere's
                             logit_scale, Granite's logits_scaling, Gemma 2 / 3's final_logit_softcapping, ...),
                             since these trainers take the logits from ``model(...)`` itself
    the heads' operands   -> as the model's ``lm_head`` multiplies them (autocast's dtype under autocast)

What stays TRL's: ``training_step`` (``lmbda``'s on-policy generation by the student, ``seq_kd``'s by the teacher,
GOLD's buffering over gradient accumulation and its on/off-policy loss metrics, which it computes from the loss this
returns), the data collator, ``num_items_in_batch``, the backbones' calls (each through its model's wrapper, so
DDP / FSDP / DeepSpeed run their part). ``compute_loss(..., return_outputs=True)`` (evaluation asking for the
student's logits) runs the class's own ``compute_loss``: the logits are what is asked for.

Refused at ``enable`` (``check_mappable``), by name: GOLD's ``use_uld_loss=True`` (the cross-tokenizer ULD loss is
another divergence), a vision-language trainer, no teacher, a subclass with its own ``compute_loss`` or
``generalized_jsd_loss``, a head ``plan_head`` cannot reproduce (a bias, an adapter, an unknown logit scale), a
tensor-parallel student head, vocabularies of different sizes, beta outside [0, 1], a temperature that is not
positive. A batch with multimodal fields reaching the loss is refused by their names.
"""
from __future__ import annotations

from numbers import Real

import torch

from ..record import serial_now, write_step
from ..sharded_head import call_head, check_layout, head_shape, is_dtensor, whole_weight
from .swap import check_fused_loss, disable_loss_method, enable_loss_method

METHOD = "compute_loss"
IGNORE = -100
# the names of the classes this module patches, in the subpackage of trl.experimental that defines each
CLASSES = {"GKDTrainer": "gkd", "GOLDTrainer": "gold"}


def trainer_classes() -> dict:
    """{name: class} of the trainers in ``trl.experimental`` that this trl provides."""
    import importlib

    found = {}
    for name, package in CLASSES.items():
        try:
            found[name] = getattr(importlib.import_module(f"trl.experimental.{package}"), name)
        except Exception:  # noqa: BLE001 - a trl without it (or failing to import it) just lacks that trainer
            continue
    return found


def base_class(trainer):
    """GKDTrainer or GOLDTrainer when ``trainer`` is one of them (or a subclass), else None."""
    for cls in trainer_classes().values():
        if isinstance(trainer, cls):
            return cls
    return None


def is_gold(trainer) -> bool:
    return base_class(trainer) is trainer_classes().get("GOLDTrainer")


def loss_temperature(trainer) -> float:
    """The temperature the trainer's own loss divides both models' logits by."""
    return float(trainer.temperature) if is_gold(trainer) else 1.0


def _head_problems(name: str, model) -> list:
    """Why this model's logits cannot be computed as its own forward computes them ([] when they can)."""
    from ..transformers import unwrap_model
    from ..transformers.forward import _backbone
    from ..transformers.heads import plan_head

    try:
        core = unwrap_model(model)
        plan = plan_head(core, _backbone(core))
    except (TypeError, ValueError) as exc:
        return [f"trainer.{name}: {exc}"]
    if name == "model" and is_dtensor(plan.weight):
        try:
            check_layout(core, plan.weight, "lm_head.weight")
        except ValueError:
            return ["trainer.model's lm_head.weight is a tensor-parallel DTensor (the teacher's head would need the "
                    "same vocabulary shard)"]
    return []


def unmappable(trainer) -> list:
    """The trainer's settings that the fused distillation loss cannot reproduce, as "name (why)"."""
    cls = base_class(trainer)
    if getattr(trainer, "teacher_model", None) is None:
        return ["teacher_model=None (the loss needs the teacher's head)"]
    bad = []
    for method in (METHOD, "generalized_jsd_loss"):
        if getattr(type(trainer), method) is not getattr(cls, method):
            bad.append(f"{type(trainer).__name__}.{method} (a subclass's own {method}: its loss is not "
                       f"{cls.__name__}'s)")
    if getattr(trainer, "use_uld_loss", False):
        bad.append("use_uld_loss=True (GOLD's cross-tokenizer ULD loss is another divergence than the generalized "
                   "JSD)")
    if getattr(trainer, "_is_vlm", False):
        bad.append("a vision-language model (logitless.trl scores text-only models)")
    beta = trainer.beta
    if isinstance(beta, bool) or not isinstance(beta, Real) or not 0.0 <= float(beta) <= 1.0:
        bad.append(f"beta={beta!r} (the generalized JSD takes beta in [0, 1])")
    if is_gold(trainer):
        temp = trainer.temperature
        if isinstance(temp, bool) or not isinstance(temp, Real) or not 0.0 < float(temp) < float("inf"):
            bad.append(f"temperature={temp!r} (must be finite and > 0)")
    heads = []
    for name in ("model", "teacher_model"):
        problems = _head_problems(name, getattr(trainer, name))
        bad += problems
        if not problems:
            from ..transformers import unwrap_model
            heads.append(head_shape(unwrap_model(getattr(trainer, name)).get_output_embeddings().weight))
    if len(heads) == 2 and None not in heads and heads[0][0] != heads[1][0]:
        bad.append(f"the student's vocabulary ({heads[0][0]}) and the teacher's ({heads[1][0]}) differ in size")
    return bad


def check_mappable(trainer) -> None:
    """ValueError naming every setting of this GKDTrainer / GOLDTrainer that the fused loss cannot reproduce."""
    bad = unmappable(trainer)
    if bad:
        raise ValueError(f"logitless.trl.enable cannot compute this {base_class(trainer).__name__}'s loss with "
                         "fused_distillation_loss: " + "; ".join(bad) + ". Leave logitless disabled for this trainer")


def _last_hidden(core, input_ids, attention_mask):
    """The final (normed) hidden states [B, S, H] the model's own forward hands its lm_head."""
    from ..sharded_head import replicated
    from ..transformers.forward import _backbone

    out = _backbone(core)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return replicated(out.last_hidden_state)


def _redirect(wrapper, inner, method, *args):
    """``method(*args)`` run as ``inner``'s forward inside ``wrapper``'s call, so that DDP / FSDP / DeepSpeed do
    their part around it (gather parameters, mark the forward for the backward); ``inner`` itself when it is not
    wrapped."""
    if wrapper is inner and not (inner._forward_pre_hooks or inner._forward_hooks):
        return method(*args)
    had = "forward" in inner.__dict__
    previous = inner.__dict__.get("forward")

    def forward(*_a, **_k):
        # restored before the method runs: it may call the model's real forward
        if had:
            inner.__dict__["forward"] = previous
        else:
            inner.__dict__.pop("forward", None)
        return method(*args)

    inner.__dict__["forward"] = forward
    try:
        return wrapper()
    finally:
        if inner.__dict__.get("forward") is forward:
            if had:
                inner.__dict__["forward"] = previous
            else:
                del inner.__dict__["forward"]


def _fused_loss(self, unwrapped_student, input_ids, attention_mask, labels, num_items_in_batch):
    """The loss, run inside the student wrapper's forward: both backbones, then the fused divergence as the
    student head's forward (``sharded_head.call_head``) with the teacher's whole head weight."""
    from ..api import head_operands
    from ..losses import fused_distillation_loss
    from ..transformers import unwrap_model
    from ..transformers.forward import _backbone
    from ..transformers.heads import plan_head

    student = unwrap_model(unwrapped_student)
    student_hidden = _last_hidden(student, input_ids, attention_mask)
    self.teacher_model.eval()
    unwrapped_teacher = self.accelerator.unwrap_model(self.teacher_model)
    teacher = unwrap_model(unwrapped_teacher)
    with torch.no_grad():
        teacher_hidden = _redirect(self.teacher_model, unwrapped_teacher, _last_hidden, teacher, input_ids,
                                   attention_mask)
    s_plan, t_plan = plan_head(student, _backbone(student)), plan_head(teacher, _backbone(teacher))
    settings = dict(student_logit_scale=s_plan.logit_scale, student_softcap=s_plan.softcap,
                    teacher_logit_scale=t_plan.logit_scale, teacher_softcap=t_plan.softcap)
    # TRL's causal shift: position t predicts labels[t + 1]; the last position predicts nothing
    targets = labels[:, 1:]
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(student_hidden.device)

    def compute(hidden, weight, tp_group):
        hs, ws = head_operands(hidden, weight)
        with whole_weight(teacher.get_output_embeddings()) as teacher_weight:
            ht, wt = head_operands(teacher_hidden[:, :-1].to(ws.device), teacher_weight.to(ws.device))
            with torch.autocast(hs.device.type, enabled=False):
                out = fused_distillation_loss(hs, ws, targets.to(hs.device), teacher_hidden=ht, teacher_weight=wt,
                                              divergence="jsd", beta=float(self.beta),
                                              temperature=loss_temperature(self), num_items_in_batch=num_items_in_batch,
                                              ignore_index=IGNORE, tp_group=tp_group, **settings)
        return (out.loss,)

    head = student.get_output_embeddings()
    since = serial_now()
    (loss,) = call_head(head, student_hidden[:, :-1], compute, owner=student)
    write_step("trl.gold" if is_gold(self) else "trl.gkd", since)
    return loss


def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """logitless in place of GKDTrainer / GOLDTrainer.compute_loss (same arguments, same loss)."""
    if return_outputs:
        # evaluation asking for the student's logits: the class's own loss, which computes them
        return base_class(self).compute_loss(self, model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
    forwarded = self._get_model_forward_kwargs(inputs) if hasattr(self, "_get_model_forward_kwargs") else {}
    if forwarded:
        raise ValueError(f"logitless.trl scores text-only models; the batch has {', '.join(sorted(forwarded))} "
                         "(multimodal inputs): disable logitless for this trainer")
    unwrapped = self.accelerator.unwrap_model(model)
    return _redirect(model, unwrapped, _fused_loss, self, unwrapped, inputs["input_ids"], inputs["attention_mask"],
                     inputs["labels"], num_items_in_batch)


def enable(trainer, *, fused_loss=None):
    """``logitless.trl.enable`` on a GKDTrainer / GOLDTrainer: the loss is always fused; ``fused_loss`` may be left
    out or True."""
    check_fused_loss(fused_loss, base_class(trainer).__name__)
    check_mappable(trainer)
    return enable_loss_method(trainer, METHOD, compute_loss)


def disable(trainer):
    """Undo ``enable``: the class's own ``compute_loss`` again (a no-op on a trainer that is not enabled)."""
    return disable_loss_method(trainer, METHOD)
