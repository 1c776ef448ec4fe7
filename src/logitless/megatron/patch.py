"""Make ``model(..., output_processor=fn, output_processor_context=ctx)`` work on every release.

Hook mode (megatron-core 0.18+): nothing to do; ``model.forward`` is never touched.

Legacy mode (releases without the hook that route their output through ``_postprocess``; tested
against megatron-core 0.16.1): the one GPTModel instance gets an instance-level ``forward``
(never the class) that accepts the two hook arguments. With a processor it runs the original
forward while, for that call only, the instance's ``_postprocess`` is wrapped and its
``output_layer`` intercepted at the main-model logits call: the original post-processing (MTP
and its loss included) runs unchanged up to that point, then the processor gets the hidden
states the output layer would have turned into logits. The previous instance attribute (if any)
is kept in one backup attribute; unpatch restores it exactly and removes the backup.
"""
from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from torch import nn

from ..record import legacy_call
from .detect import fused_forward_mode, is_gpt_model, unwrap_gpt_model
from .mtp import disable_fused_mtp, enable_fused_mtp, release_has_process_mtp_loss

_BACKUP_ATTR = "_logitless_forward_backup"
# Backup value meaning "no instance-level forward before the patch". A string, so it keeps its
# meaning through copies and pickles of the model (an object() sentinel would not).
_CLASS_FORWARD = "<class forward>"
_ABSENT = object()   # local marker for "no such attribute" during one call


class _MainHidden(Exception):
    """Carries the main-model hidden states out of the original _postprocess (its logits call)."""

    def __init__(self, hidden, weight, runtime_gather_output):
        super().__init__("logitless: main-model logits call intercepted")
        self.hidden, self.weight, self.runtime_gather_output = hidden, weight, runtime_gather_output


def patch_fused_forward(model: nn.Module) -> str:
    """Let ``model`` take ``output_processor`` / ``output_processor_context``. Idempotent.
    Returns the mode ("hook", "legacy" or "unfused"); only "legacy" changes anything."""
    gpt = unwrap_gpt_model(model)
    mode = fused_forward_mode(gpt)
    if mode != "unfused":
        enable_fused_mtp(gpt)      # MTP losses from the fused op too (a no-op without MTP layers)
    if mode != "legacy" or _BACKUP_ATTR in gpt.__dict__:
        return mode
    gpt.__dict__[_BACKUP_ATTR] = gpt.__dict__.get("forward", _CLASS_FORWARD)
    # a bound method resolving the original at call time (not a closure holding it), so a copy
    # of the model never calls back into this instance
    gpt.__dict__["forward"] = types.MethodType(_legacy_forward, gpt)
    return mode


def unpatch_fused_forward(model: nn.Module) -> str:
    """Undo ``patch_fused_forward`` exactly (idempotent); returns the mode."""
    gpt = unwrap_gpt_model(model)
    mode = fused_forward_mode(gpt)
    disable_fused_mtp(gpt)
    if _BACKUP_ATTR in gpt.__dict__:
        previous = gpt.__dict__.pop(_BACKUP_ATTR)
        if isinstance(previous, str) and previous == _CLASS_FORWARD:
            gpt.__dict__.pop("forward", None)
        else:
            gpt.__dict__["forward"] = previous
    return mode


def _original_forward(gpt: nn.Module):
    previous = gpt.__dict__.get(_BACKUP_ATTR, _CLASS_FORWARD)
    if isinstance(previous, str) and previous == _CLASS_FORWARD:
        return type(gpt).forward.__get__(gpt)
    return previous


def _legacy_forward(self, *args, output_processor=None, output_processor_context=None, **kwargs):
    """logitless legacy patch of GPTModel.forward: also accepts ``output_processor`` and
    ``output_processor_context``, like megatron-core 0.18+."""
    original = _original_forward(self)
    if output_processor is None or not getattr(self, "post_process", True):
        # no processor, or a non-last pipeline stage: the hook would not run either
        return original(*args, **kwargs)
    return _forward_with_processor(self, original, args, kwargs, output_processor, output_processor_context)


class _OutputLayerTap:
    """For one forward: the output layer's instance ``forward`` replaced by one that raises
    ``_MainHidden`` at the main-model logits call (``is_main(call_number)``) and runs the layer
    for every other call (the MTP heads' logits); ``close()`` restores the layer exactly."""

    def __init__(self, layer, is_main):
        self.layer, self.is_main, self.calls, self.found = layer, is_main, 0, False
        self.saved = layer.__dict__.get("forward", _ABSENT)
        self.sp_before = getattr(layer, "sequence_parallel", None)
        self.layer_forward = layer.forward

    def _forward(self, hidden, *a, weight=None, runtime_gather_output=None, **kw):
        self.calls += 1
        if not self.found and self.is_main(self.calls):
            self.found = True     # later calls (e.g. a labels=None processor's own logits) run the layer
            raise _MainHidden(hidden, weight, runtime_gather_output)
        return self.layer_forward(hidden, *a, weight=weight, runtime_gather_output=runtime_gather_output, **kw)

    def open(self):
        self.layer.__dict__["forward"] = self._forward

    def close(self):
        if self.saved is _ABSENT:
            self.layer.__dict__.pop("forward", None)
        else:
            self.layer.__dict__["forward"] = self.saved
        if self.sp_before is not None:     # Megatron's inference path may have switched SP off
            self.layer.sequence_parallel = self.sp_before


def _not_from_mtp_loss(_call: int) -> bool:
    """True unless the output-layer call comes from megatron-core's ``process_mtp_loss`` (the MTP
    heads' logits, 0.18+): the first other call is the main-model logits call."""
    frame = sys._getframe(2)
    try:
        for _ in range(8):
            if frame is None:
                return True
            if frame.f_code.co_name == "process_mtp_loss":
                return False
            frame = frame.f_back
        return True
    finally:
        del frame


def _forward_with_processor(gpt, original, args, kwargs, processor, context) -> Any:
    if not is_gpt_model(gpt):
        return _forward_tapping_output_layer(gpt, original, args, kwargs, processor, context)
    post_orig = gpt._postprocess                       # bound class method
    post_params = inspect.signature(post_orig)
    # The main-model logits call is the one the processor replaces. Releases with process_mtp_loss
    # (0.18+) make the MTP heads' logits calls from there (none when the MTP losses are fused);
    # older ones call the output layer once per MTP depth inside _postprocess, then for the main model.
    if release_has_process_mtp_loss():
        is_main = _not_from_mtp_loss
    else:
        main_call = int(getattr(gpt.config, "mtp_num_layers", None) or 0) + 1

        def is_main(n):
            return n == main_call

    def postprocess(*a, **kw):
        named = dict(post_params.bind(*a, **kw).arguments)
        return _tapped(gpt, is_main, lambda: post_orig(*a, **kw), named, processor, context,
                       "this megatron-core's _postprocess")

    gpt.__dict__["_postprocess"] = postprocess
    try:
        return original(*args, **kwargs)
    finally:
        gpt.__dict__.pop("_postprocess", None)


def _forward_tapping_output_layer(model, original, args, kwargs, processor, context) -> Any:
    """HybridModel / MambaModel: their forward calls the output layer itself (after the MTP losses,
    whose logits calls come from ``process_mtp_loss``); the first other call is intercepted and the
    processor returns instead of the logits / loss."""
    named = dict(inspect.signature(type(model).forward).bind(model, *args, **kwargs).arguments)
    named.update(named.pop("kwargs", None) or {})
    return _tapped(model, _not_from_mtp_loss, lambda: original(*args, **kwargs), named, processor, context,
                   f"{type(model).__name__}.forward")


def _tapped(model, is_main, run, named: dict, processor, context, where: str) -> Any:
    """``run()`` with the model's output layer tapped: its main-model logits call (``is_main``) stops the run
    and the processor returns instead. A run that never made that call is an error on a post-process stage
    (its output is not what the processor would return); elsewhere its output stands."""
    tap = _OutputLayerTap(model.output_layer, is_main)
    tap.open()
    try:
        result = run()
    except _MainHidden as got:
        return _call_processor(model, processor, context, named, got)
    finally:
        tap.close()
    if getattr(model, "post_process", True):
        raise RuntimeError(f"logitless legacy patch: {where} never made the main-model logits call that the "
                           "processor replaces; the output is not what the processor would return")
    return result


def _call_processor(gpt, processor, context, named: dict, got: _MainHidden):
    labels = named.get("labels")
    hidden = got.hidden
    if labels is not None and hidden.dim() == 3 and hidden.shape[1] != labels.shape[0]:
        raise RuntimeError(f"logitless legacy patch: intercepted hidden states {tuple(hidden.shape)} do not "
                           f"pair with labels {tuple(labels.shape)}")
    with legacy_call():
        return processor(
            hidden_states=hidden,
            output_layer=gpt.output_layer,
            output_weight=got.weight,
            labels=labels,
            loss_mask=named.get("loss_mask"),
            input_ids=named.get("input_ids"),
            position_ids=named.get("position_ids"),
            attention_mask=named.get("attention_mask"),
            decoder_input=named.get("decoder_input"),
            # The intercepted hidden states are those the output layer gets, i.e. after Megatron's own
            # inference-time last-token slicing (the native hook sees them before it): without an
            # inference context a labels=None processor does not slice them a second time.
            inference_context=named.get("inference_context") if labels is not None else None,
            packed_seq_params=named.get("packed_seq_params"),
            runtime_gather_output=got.runtime_gather_output,
            context=context,
            compute_language_model_loss=gpt.compute_language_model_loss,
            scale_logits=getattr(gpt, "_scale_logits", None),
            config=gpt.config,
        )
