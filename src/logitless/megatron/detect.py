"""Find the language model (GPTModel, HybridModel, MambaModel) inside a wrapped model and decide,
once per model, how to reach its output.

Modes:
- "hook":    the model's ``forward`` accepts ``output_processor`` and ``output_processor_context``
             (megatron-core 0.18+, or any backport): logitless passes its processor, nothing patched.
- "legacy":  no hook, but the output can be intercepted: a GPTModel that routes its output through
             ``_postprocess`` (megatron-core releases before 0.18; tested on 0.16.1), or a
             HybridModel / MambaModel, whose forward calls its output layer itself (0.19 has no hook
             there yet): logitless patches that one instance's ``forward`` (see patch.py).
- "unfused": neither; only the unfused fallback can run (refused in strict mode).

The decision comes from inspecting the forward signature, never from a version number, so
backports of the hook are used as they are. It is cached on the model instance.
"""
from __future__ import annotations

import importlib
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


def _language_model_classes() -> tuple:
    """The model classes logitless serves: GPTModel, and HybridModel / MambaModel where the installed
    megatron-core has them (MambaModel is a deprecated subclass of HybridModel in 0.19; older releases
    have MambaModel only)."""
    try:
        from megatron.core.models.gpt import GPTModel
    except ImportError as exc:  # megatron-core is optional for logitless as a whole
        raise ImportError(f"logitless.megatron needs megatron-core importable: {exc}") from exc
    classes = [GPTModel]
    for module, name in (("megatron.core.models.hybrid.hybrid_model", "HybridModel"),
                         ("megatron.core.models.mamba.mamba_model", "MambaModel")):
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):   # not in this release (or its optional deps are missing)
            pass
    return tuple(classes)


def is_gpt_model(model: nn.Module) -> bool:
    from megatron.core.models.gpt import GPTModel
    return isinstance(model, GPTModel)


def unwrap_gpt_model(model: nn.Module) -> nn.Module:
    """The language model (GPTModel, HybridModel or MambaModel) inside ``model``: follows ``.module``
    chains (Float16Module, DistributedDataParallel, FSDP-style wrappers) and a multimodal
    ``.language_model``.

    Raises TypeError when ``model`` is not an nn.Module or holds none of those models."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    classes = _language_model_classes()
    seen = [type(model).__name__]
    current = model
    for _ in range(_MAX_WRAPPERS):
        if isinstance(current, classes):
            return current
        inner = getattr(current, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(current, "language_model", None)
        if not isinstance(inner, nn.Module):
            break
        current = inner
        seen.append(type(current).__name__)
    names = " or ".join(c.__name__ for c in classes)
    raise TypeError(f"model holds no megatron.core {names} (followed .module / .language_model through "
                    f"{' -> '.join(seen)}); logitless.megatron supports {', '.join(c.__name__ for c in classes)}")


unwrap_language_model = unwrap_gpt_model


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
    if not is_gpt_model(gpt):
        # HybridModel / MambaModel: forward calls the output layer itself (no _postprocess step);
        # the instance patch intercepts that call
        return "legacy", "forward has no output_processor hook; using the instance patch (output-layer call)"
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
