"""The schedule-plan path: megatron-core's combined 1F1B schedule (``build_schedule_plan``, which overlaps
one micro-batch's forward with another's backward, MoE all-to-all included) with logitless' processor.

megatron-core 0.19's ``GPTModel.build_schedule_plan`` takes ``output_processor`` /
``output_processor_context`` and its post-process node hands them to ``_postprocess``: the node then
returns the processor's output instead of the loss. ``build_fused_schedule_plan`` builds such a plan with
``schedule_plan_processor`` (``fused_output_processor`` run under the "schedule-plan" record), so
``last_path()`` after the node ran says path "schedule-plan".

What the post-process node returns (the schedule's output tensor(s), all float32):
- log-probs: ``(logprobs, entropy)`` [b, s] each, or ``logprobs`` alone with ``with_entropy=False``
  (megatron-core's schedule takes a tensor or a tuple of tensors, whose gradients it gets from the loss
  function);
- with ``loss``: the fused policy loss, a 0-d tensor (the schedule back-propagates through every output
  of the node, and only the loss is differentiable), carrying the whole ``PolicyLossOutput`` (metrics
  included) as its attribute ``policy_output``;
- with ``labels=None``: what megatron-core's own plan returns there, the logits [b, s, V] (or, with
  ``without_labels="hidden_states"``, the hidden states [s, b, h] the node was given).
A model whose ``build_schedule_plan`` lacks the two hook parameters raises ``FusedPathUnavailable``:
there is no unfused plan that returns log-probabilities.
"""
from __future__ import annotations

from typing import Optional, Union

from torch import Tensor, nn

from ..losses import PolicyLoss
from ..record import FusedPathUnavailable, path_scope
from .detect import _has_hook_parameters, unwrap_gpt_model
from .mtp import enable_fused_mtp
from .processor import FusedOutputProcessorContext, fused_output_processor


def schedule_plan_processor(**hook_kwargs):
    """``fused_output_processor`` for the post-process node of a schedule plan: the same computation,
    recorded as path "schedule-plan", with a tuple of tensors (or one tensor) as the node's output."""
    with path_scope("schedule-plan"):
        out = fused_output_processor(**hook_kwargs)
    if hook_kwargs.get("labels") is None:
        return out
    if hasattr(out, "loss"):
        # the schedule back-propagates through every output of the node: only the loss is
        # differentiable, so it is the output; the metrics ride on it
        out.loss.policy_output = out
        return out.loss
    return tuple(out) if out.entropy is not None else out.logprobs


def supports_schedule_plan_hook(model: nn.Module) -> bool:
    """True when the model's ``build_schedule_plan`` takes ``output_processor`` and
    ``output_processor_context`` (signature inspection)."""
    builder = getattr(type(unwrap_gpt_model(model)), "build_schedule_plan", None)
    return builder is not None and _has_hook_parameters(builder)


def build_fused_schedule_plan(model: nn.Module, input_ids: Tensor, position_ids: Optional[Tensor],
                              attention_mask: Optional[Tensor], *, labels: Optional[Tensor],
                              temperature: Union[float, Tensor] = 1.0, with_entropy: bool = True,
                              loss: Optional[PolicyLoss] = None, ignore_index: int = -100, backend: str = "auto",
                              without_labels: str = "logits", **plan_kwargs):
    """``model.build_schedule_plan(input_ids, position_ids, attention_mask, labels=labels, **plan_kwargs)``
    with logitless' processor: the plan's post-process node returns per-token log-probs (and entropy),
    or the fused policy loss with ``loss``, instead of the model's loss (see the module docstring).

    Args:
        model: a GPTModel (possibly wrapped) whose ``build_schedule_plan`` has the output-processor
            parameters (megatron-core 0.19+).
        input_ids, position_ids, attention_mask: as for the model's forward.
        labels: [b, s] int token ids in the labels' layout of the processor (ignore_index where nothing
            is scored); None: the node returns what the model's own plan returns, its logits [b, s, V]
            (``without_labels="hidden_states"``: the [s, b, h] hidden states at the node instead).
        temperature, with_entropy, loss, ignore_index, backend, without_labels: as in
            ``FusedOutputProcessorContext``.
        plan_kwargs: the rest of ``build_schedule_plan``'s arguments (packed_seq_params, loss_mask, ...).
    Returns:
        megatron-core's ``TransformerModelChunkSchedulePlan``.
    """
    gpt = unwrap_gpt_model(model)
    if not supports_schedule_plan_hook(gpt):
        raise FusedPathUnavailable(f"{type(gpt).__name__}.build_schedule_plan has no output_processor / "
                                   "output_processor_context parameters (megatron-core 0.19+ has them): the "
                                   "schedule-plan path cannot run logitless' processor")
    for name in ("output_processor", "output_processor_context"):
        if name in plan_kwargs:
            raise TypeError(f"build_fused_schedule_plan sets {name} itself; do not pass it")
    ctx = FusedOutputProcessorContext(temperature=temperature, with_entropy=with_entropy, ignore_index=ignore_index,
                                      backend=backend, loss=loss, without_labels=without_labels)
    enable_fused_mtp(gpt)
    return gpt.build_schedule_plan(input_ids, position_ids, attention_mask, labels=labels,
                                   output_processor=schedule_plan_processor, output_processor_context=ctx,
                                   **plan_kwargs)
