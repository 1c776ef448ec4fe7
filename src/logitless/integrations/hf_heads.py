"""What a transformers causal-LM head computes, reduced to "a linear map times a constant".

logitless computes softmax(hidden @ weight.T / T). A head is usable when the model's logits are
exactly ``scale * (hidden @ weight.T)`` for a positive constant ``scale``: then the model's
softmax(logits / T) is ours with temperature ``T / scale``. Anything else (tanh softcapping, a
bias, an adapter on the head, a scale of unknown direction) is refused with an error that names
the attribute, never approximated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class HeadPlan:
    """The output embedding of a causal LM, and the constant its logits are multiplied by.

    weight: [V, H] the head's weight (the input embedding when tied).
    logit_scale: the model's logits equal ``logit_scale * hidden @ weight.T``.
    source: where the scale came from, for messages ("1" when there is none).
    """
    weight: Tensor
    logit_scale: float
    source: str


# Model types whose CausalLM forward is known to rescale the logits, and how (read in
# transformers 5.24): "mul" multiplies the logits by the value, "div" divides them by it.
# MiniCPM3 divides the hidden states by ``config.logits_scaling`` before the head: the same thing.
_SCALE_RULES = {
    "cohere": ("model", "logit_scale", "mul"),
    "cohere2": ("model", "logit_scale", "mul"),
    "cohere2_moe": ("model", "logit_scale", "mul"),
    "cohere_compass": ("model", "logit_scale", "mul"),
    "hyperclovax": ("config", "logits_scaling", "mul"),
    "falcon_h1": ("backbone", "lm_head_multiplier", "mul"),
    "minicpm3": ("config", "logits_scaling", "div"),
}
# Every Granite variant divides by config.logits_scaling (GraniteForCausalLM and its MoE, SWA,
# hybrid and vision-language descendants).
_DIV_PREFIXES = ("granite",)

# Config attributes that change the head in some architecture. On a model type without a rule
# above, a non-neutral value is refused: the same name means multiply in one model and divide in
# another (Granite vs HyperCLOVA X), so guessing would give silently different numbers.
_SCALE_ATTRS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_logits_scale")
_SOFTCAP_ATTRS = ("final_logit_softcapping", "logit_softcapping", "output_softcapping")


def _configs(model: nn.Module):
    """The model's config and, for multimodal models, its text config (deduplicated)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return []
    out = [cfg]
    get_text = getattr(cfg, "get_text_config", None)
    if callable(get_text):
        text = get_text()
        if text is not None and text is not cfg:
            out.append(text)
    return out


def _number(owner: str, attr: str, value) -> Optional[float]:
    """``value`` as a float (None stays None). A learnable scale cannot be a temperature."""
    if value is None:
        return None
    if isinstance(value, Tensor):
        if value.requires_grad:
            raise ValueError(f"{owner}.{attr} is a trainable tensor; logitless folds a head scale into the "
                             "temperature, which is not differentiated. Freeze it or use the unfused path.")
        if value.numel() != 1:
            raise ValueError(f"{owner}.{attr} has shape {tuple(value.shape)}; only a scalar head scale folds "
                             "into the temperature")
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{owner}.{attr} must be a number, got {type(value).__name__}")
    return float(value)


def _check_head_module(model: nn.Module, head: nn.Module) -> Tensor:
    cls = type(model).__name__
    if hasattr(head, "base_layer") or type(head).__module__.split(".")[0] == "peft":
        raise ValueError(f"{cls}'s output embedding is wrapped by an adapter ({type(head).__name__}, e.g. LoRA "
                         "on lm_head): its update is not in lm_head.weight. Leave lm_head out of the adapter's "
                         "target_modules (or merge the adapter) to use logitless.")
    weight = getattr(head, "weight", None)
    if not isinstance(head, (nn.Linear, nn.Embedding)) or not isinstance(weight, Tensor) or weight.dim() != 2:
        raise TypeError(f"{cls}'s output embedding is a {type(head).__name__}; logitless supports an "
                        "nn.Linear head (or a tied embedding) with a 2-D weight [vocab, hidden]")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{cls}.lm_head has a bias (lm_head.bias): logits = hidden @ W.T + b, and the fused "
                         "op has no bias term. logitless refuses rather than return different numbers.")
    if type(weight).__name__ == "DTensor" or hasattr(weight, "full_tensor"):
        raise TypeError(f"{cls}.lm_head.weight is a sharded DTensor (FSDP2 unit or tensor-parallel plan on the "
                        "head). Keep lm_head in the root FSDP unit, unsharded at forward time.")
    return weight


def plan_head(model: nn.Module, backbone: Optional[nn.Module] = None) -> HeadPlan:
    """The HeadPlan of an unwrapped transformers causal LM, or a clear error.

    Raises ValueError naming the attribute for a head that is not ``scale * linear``
    (softcapping, bias, adapter on the head, a scale on an architecture without a known rule).
    """
    cls = type(model).__name__
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        raise ValueError(f"{cls} has no output embeddings (get_output_embeddings() is None): "
                         "logitless needs a causal LM with an LM head")
    weight = _check_head_module(model, head)

    configs = _configs(model)
    for cfg in configs:
        for attr in _SOFTCAP_ATTRS:
            cap = getattr(cfg, attr, None)
            if cap is not None:
                raise ValueError(
                    f"{cls} applies tanh softcapping to its logits (config.{attr}={cap}): logits = "
                    f"cap * tanh(hidden @ W.T / cap) is not a linear head and the fused op has no softcap. "
                    f"Set model.config.{attr} = None to train without it, or use the model's own logits.")

    types = [getattr(cfg, "model_type", "") or "" for cfg in configs]
    rule = next((_SCALE_RULES[t] for t in types if t in _SCALE_RULES), None)
    if rule is None and any(t.startswith(_DIV_PREFIXES) for t in types):
        rule = ("config", "logits_scaling", "div")

    scale, source = 1.0, "1"
    if rule is not None:
        where, attr, how = rule
        value = None
        if where == "model" and hasattr(model, attr):
            value, owner = getattr(model, attr), cls
        elif where == "backbone" and backbone is not None and hasattr(backbone, attr):
            value, owner = getattr(backbone, attr), type(backbone).__name__
        if value is None:
            cfg = next((c for c in reversed(configs) if getattr(c, attr, None) is not None), None)
            if cfg is not None:
                value, owner = getattr(cfg, attr), "config"
        value = _number(owner if value is not None else "config", attr, value)
        if value is not None:
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{cls}: {attr}={value} must be finite and > 0 to fold into the temperature")
            scale = value if how == "mul" else 1.0 / value
            source = f"{attr}={value} ({'multiplies' if how == 'mul' else 'divides'} the logits)"
        checked = {attr}
    else:
        checked = set()

    for cfg in configs:
        for attr in _SCALE_ATTRS:
            if attr in checked:
                continue
            value = _number("config", attr, getattr(cfg, attr, None))
            if value is not None and value != 1.0:
                raise ValueError(
                    f"{cls} (model_type {getattr(cfg, 'model_type', '?')!r}) has config.{attr}={value}, which "
                    "rescales the logits in some architectures, and logitless has no rule for this one. "
                    "Refusing rather than guessing; the model's own logits are the safe path.")
    for cfg in configs:
        base = getattr(cfg, "dim_model_base", None)
        if "minicpm3" not in types and base is not None and base != getattr(cfg, "hidden_size", base):
            raise ValueError(f"{cls} has config.dim_model_base={base} != hidden_size (MiniCPM-style muP): its "
                             "head rescales the hidden states and logitless has no rule for this variant")
    return HeadPlan(weight=weight, logit_scale=scale, source=source)
