"""What a Megatron forward returns when it is given no labels, reproduced at the output-processor
boundary: a rollout / inference forward through logitless' processor gets exactly what the model
would have returned without the processor.

Megatron's post-processing after the hook point (megatron-core 0.19, ``GPTModel._postprocess`` and
``HybridModel.forward``): in inference mode with ``materialize_only_last_token_logits`` keep only
the last token's hidden states (static batching) or each request's last token (dynamic batching,
gathering sequence-parallel shards first); the output layer; the logit scaling (MuP); the config
logger's ``input_and_logits`` payload; then logits [s, b, V] -> [b, s, V].

``FusedOutputProcessorContext.without_labels`` picks the output: "logits" (the above, the default)
or "hidden_states" (the [s, b, h] hidden states the processor was given, untouched, as Megatron
returns them from a stage without an output layer).
"""
from __future__ import annotations

from collections import OrderedDict

from torch import Tensor

WITHOUT_LABELS = ("logits", "hidden_states")


def inference_mode_active(inference_context, config) -> bool:
    try:
        from megatron.core.inference.utils import InferenceMode
    except ImportError:  # releases before InferenceMode: inference is "a context and not training"
        return inference_context is not None
    return bool(InferenceMode.is_active())


def megatron_logits(*, hidden_states: Tensor, output_layer, output_weight, runtime_gather_output=None,
                    inference_context=None, scale_logits=None, config=None, **kwargs) -> Tensor:
    """The model's own logits [b, s, V] from the hidden states [s, b, h] at the hook point: the
    same calls, in the same order, as Megatron's post-processing (see the module docstring)."""
    in_inference = inference_mode_active(inference_context, config)
    sp_override = False
    if (in_inference and inference_context is not None
            and getattr(getattr(inference_context, "config", None), "materialize_only_last_token_logits", False)):
        if inference_context.is_static_batching():
            hidden_states = hidden_states[-1:, :, :]
        else:
            if output_layer.sequence_parallel:
                from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
                hidden_states = gather_from_sequence_parallel_region(hidden_states, group=output_layer.tp_group)
                output_layer.sequence_parallel = False
                sp_override = True
            reshaped = hidden_states.squeeze(1).unsqueeze(0)
            hidden_states = inference_context.last_token_logits(reshaped).unsqueeze(1)
    try:
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
    finally:
        if sp_override:
            output_layer.sequence_parallel = True
    if scale_logits is not None:
        logits = scale_logits(logits)
    log_outputs(config, kwargs, "input_and_logits", logits=logits)
    return logits.transpose(0, 1).contiguous()


def log_outputs(config, kwargs, prefix: str, **outputs) -> None:
    """Megatron's config logger (when it is on): the payload of its unfused path, with ``outputs`` (logits, or
    the fused path's logprobs and entropy) in place of the logits, under ``prefix``."""
    try:
        from megatron.core.config_logger import has_config_logger_enabled, log_config_to_disk
    except ImportError:
        return
    if config is None or not has_config_logger_enabled(config):
        return
    payload = OrderedDict({k: kwargs.get(k) for k in ("input_ids", "position_ids", "attention_mask",
                                                       "decoder_input")})
    payload.update(outputs)
    log_config_to_disk(config, payload, prefix=prefix)
