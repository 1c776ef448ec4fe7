"""Find the GPTModel inside a wrapped model and decide, once per model, how to reach its output.

Modes:
- "hook":    ``GPTModel.forward`` accepts ``output_processor`` and ``output_processor_context``
             (megatron-core 0.18+, or any backport): logitless passes its processor, nothing patched.
- "legacy":  no hook, but the model routes its output through ``_postprocess`` (megatron-core
             releases before 0.18; tested on 0.16.1): logitless patches that one instance's
             ``forward`` (see patch.py).
- "unfused": neither; only the unfused fallback can run (refused in strict mode).

The decision comes from inspecting the forward signature, never from a version number, so
backports of the hook are used as they are. It is cached on the model instance.
"""
from __future__ import annotations

import inspect
from typing import Optional

from torch import nn

HOOK_PARAMETERS = ("output_processor", "output_processor_context")
_MODE_ATTR = "_logitless_fused_mode"
_MAX_WRAPPERS = 32
_inspections = 0


def signature_inspections() -> int:
    """How many times a forward signature was inspected in this process (tests check the cache)."""
    return _inspections


def _gpt_model_class():
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError as exc:  # megatron-core is optional for logitless as a whole
        raise ImportError(f"logitless.megatron needs megatron-core importable: {exc}") from exc
    return GPTModel


def unwrap_gpt_model(model: nn.Module) -> nn.Module:
    """The GPTModel inside ``model``: follows ``.module`` chains (Float16Module,
    DistributedDataParallel, FSDP-style wrappers) and a multimodal ``.language_model``.

    Raises TypeError when ``model`` is not an nn.Module or holds no GPTModel."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    gpt_cls = _gpt_model_class()
    seen = [type(model).__name__]
    current = model
    for _ in range(_MAX_WRAPPERS):
        if isinstance(current, gpt_cls):
            return current
        inner = getattr(current, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(current, "language_model", None)
        if not isinstance(inner, nn.Module):
            break
        current = inner
        seen.append(type(current).__name__)
    raise TypeError("model holds no megatron.core GPTModel (followed .module / .language_model through "
                    f"{' -> '.join(seen)}); logitless.megatron supports GPTModel only")


def _has_hook_parameters(fn) -> bool:
    global _inspections
    _inspections += 1
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(name in params for name in HOOK_PARAMETERS)


def supports_output_processor_hook(model: nn.Module) -> bool:
    """True when the GPTModel's class ``forward`` takes both ``output_processor`` and
    ``output_processor_context`` (signature inspection, not a version check). The class method is
    inspected, so logitless' own legacy instance patch never makes a model look hooked."""
    gpt = unwrap_gpt_model(model)
    return _has_hook_parameters(type(gpt).forward)


def _resolve_mode(gpt: nn.Module) -> tuple[str, str]:
    if _has_hook_parameters(type(gpt).forward):
        return "hook", ""
    post = getattr(type(gpt), "_postprocess", None)
    if callable(post):
        return "legacy", "forward has no output_processor hook; using the instance patch"
    return "unfused", ("forward has neither the output_processor hook nor a _postprocess step "
                       "that logitless can intercept")


def fused_forward_mode(model: nn.Module) -> str:
    """"hook", "legacy" or "unfused" for ``model`` (see the module docstring); resolved on the
    first call and cached on the GPTModel instance."""
    return mode_and_reason(model)[0]


def mode_and_reason(model: nn.Module) -> tuple[str, str]:
    gpt = unwrap_gpt_model(model)
    cached: Optional[tuple[str, str]] = gpt.__dict__.get(_MODE_ATTR)
    if cached is None:
        cached = _resolve_mode(gpt)
        gpt.__dict__[_MODE_ATTR] = cached
    return cached
