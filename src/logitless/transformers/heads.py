"""What a transformers causal-LM head computes, reduced to "a linear map times a constant",
optionally tanh-softcapped.

logitless computes softmax(hidden @ weight.T / T), or with ``softcap=c`` softmax(c * tanh(hidden @
weight.T / c) / T). A head is usable when the model's logits are exactly ``scale * (hidden @ weight.T)``
for a positive constant ``scale`` (then the model's softmax(logits / T) is ours with temperature
``T / scale``), or exactly ``c * tanh(hidden @ weight.T / c)`` in an architecture known to compute
that (Gemma 2 and Gemma 3's ``final_logit_softcapping``). Anything else (softcapping elsewhere, a bias,
an adapter on the head, a scale of unknown direction) is refused with an error that names the
attribute, never approximated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import Optional

from torch import Tensor, nn

from ..sharded_head import head_shape, inner_head


@dataclass(frozen=True)
class HeadPlan:
    """The output embedding of a causal LM, and the constant its logits are multiplied by.

    weight: [V, H] the head's weight (the input embedding when tied), as the model holds it now: under
        FSDP / ZeRO-3 / tensor parallelism a shard or placeholder (``sharded_head.head_shape`` gives its
        whole shape); the fused op runs on what the head's own call gathers.
    logit_scale: the model's logits equal ``logit_scale * hidden @ weight.T`` (1.0 with a softcap).
    softcap: None, or c: the model's logits equal ``c * tanh(hidden @ weight.T / c)`` (pass it to
        ``fused_logprobs(softcap=...)``).
    """
    weight: Tensor
    logit_scale: float
    softcap: Optional[float] = None


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
# MuseSpark / MuseGlimmer's ``output_multiplier`` scales the logits inside their tanh softcap (and
# their MoE router logits), so it is refused like the rest.
_SCALE_ATTRS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_logits_scale", "output_multiplier")
_SOFTCAP_ATTRS = ("final_logit_softcapping", "logit_softcapping", "output_softcapping")

# Model types (of model.config itself) whose CausalLM forward computes, from that same config,
#   logits = cap * tanh(lm_head(hidden) / cap),  cap = config.final_logit_softcapping  (None: no cap)
# (read in transformers 5.25: Gemma2ForCausalLM, Gemma3ForCausalLM). A cap found anywhere else, e.g.
# on the text config of Gemma3ForConditionalGeneration, whose forward does not apply it, stays refused.
_SOFTCAP_RULES = {
    "gemma2": "final_logit_softcapping",
    "gemma3_text": "final_logit_softcapping",
}


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


def _check_head_module(model: nn.Module, head: nn.Module, weight_sharded: bool) -> Tensor:
    cls = type(model).__name__
    inner = inner_head(head)   # an FSDP1 unit around the head: the Linear inside, sharded outside its call
    weight_sharded = weight_sharded or inner is not head
    head = inner
    if hasattr(head, "base_layer") or type(head).__module__.split(".")[0] == "peft":
        raise ValueError(f"{cls}'s output embedding is wrapped by an adapter ({type(head).__name__}, e.g. LoRA "
                         "on lm_head): its update is not in lm_head.weight. Leave lm_head out of the adapter's "
                         "target_modules (or merge the adapter) to use logitless.")
    weight = getattr(head, "weight", None)
    shape = head_shape(weight) if isinstance(weight, Tensor) else None
    if isinstance(head, (nn.Linear, nn.Embedding)) and isinstance(weight, Tensor) and shape is None \
            and not weight_sharded:
        raise ValueError(f"{cls}.lm_head.weight is 1-D {tuple(weight.shape)}: a flat FSDP shard. Pass the FSDP "
                         "(FullyShardedDataParallel) wrapper itself, whose forward unshards it, not the module "
                         "inside it.")
    if not isinstance(head, (nn.Linear, nn.Embedding)) or not isinstance(weight, Tensor) or (
            shape is not None and len(shape) != 2):
        raise TypeError(f"{cls}'s output embedding is a {type(head).__name__}; logitless supports an "
                        "nn.Linear head (or a tied embedding) with a 2-D weight [vocab, hidden]")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{cls}.lm_head has a bias (lm_head.bias): logits = hidden @ W.T + b, and the fused "
                         "op has no bias term. logitless refuses rather than return different numbers.")
    return weight


def _softcap(model: nn.Module, configs) -> Optional[float]:
    """The model's final-logit softcap (None when there is none), or ValueError naming the attribute
    for a softcap logitless has no rule for."""
    cls = type(model).__name__
    top = configs[0] if configs else None
    attr = _SOFTCAP_RULES.get(getattr(top, "model_type", None))
    cap = None
    if attr is not None and getattr(top, attr, None) is not None:
        cap = _number("config", attr, getattr(top, attr))
        if not (math.isfinite(cap) and cap > 0):
            raise ValueError(f"{cls}: config.{attr}={cap} must be finite and > 0 (the logits are "
                             f"cap * tanh(logits / cap))")
    for cfg in configs:
        for other in _SOFTCAP_ATTRS:
            if cfg is top and other == attr:
                continue
            value = getattr(cfg, other, None)
            if value is not None:
                owner = "config" if cfg is top else "config.get_text_config()"
                raise ValueError(
                    f"{cls} (model_type {getattr(cfg, 'model_type', '?')!r}) has {owner}.{other}={value}, a tanh "
                    "softcap that logitless has no rule for on this architecture (where, and whether, its "
                    "forward applies it is unknown). Refusing rather than guessing; set "
                    f"{owner}.{other} = None if the model does not use it, or use the model's own logits.")
    return cap


def plan_head(model: nn.Module, backbone: Optional[nn.Module] = None, *, weight_sharded: bool = False) -> HeadPlan:
    """The HeadPlan of an unwrapped transformers causal LM, or a clear error.

    weight_sharded: the model is inside FSDP1 and this is not its forward, so the head weight may be a
        flat shard; its shape is not checked then.

    Raises ValueError naming the attribute for a head that is neither ``scale * linear`` nor a known
    softcap (softcapping without a rule, bias, adapter on the head, a scale on an architecture without
    a known rule).
    """
    cls = type(model).__name__
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is None:
        raise ValueError(f"{cls} has no output embeddings (get_output_embeddings() is None): "
                         "logitless needs a causal LM with an LM head")
    weight = _check_head_module(model, head, weight_sharded)

    configs = _configs(model)
    softcap = _softcap(model, configs)

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
    if softcap is not None and scale != 1.0:
        # no known architecture does both, and the order (scale inside or outside the tanh) would matter
        raise ValueError(f"{cls} has both a logit scale ({source}) and a softcap ({softcap}); logitless has "
                         "no rule for their order")
    return HeadPlan(weight=weight, logit_scale=scale, softcap=softcap)
