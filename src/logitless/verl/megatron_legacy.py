"""``install(fused_loss=True)`` on verl's Megatron engine with megatron-core releases without the
output-processor hook (before 0.18; tested on 0.16.1): the same fused processor, reached through
logitless' legacy per-instance patch (``logitless.megatron.patch_fused_forward``) instead of verl's.

On such a release verl's fused forward is "legacy": ``patch_fused_forward`` gave the GPTModel an
instance ``forward`` (``_fused_GPTModel_forward``) that runs the decoder and calls verl's head
(``linear_cross_entropy``) itself, so verl's ``fused_output_processor`` (where the fused policy loss
enters in hook mode, see megatron_loss.py) never runs. For one fused micro-batch ``legacy_route``
puts logitless' legacy patch in its place: the instance's forward becomes logitless' (Megatron's own
forward with its ``_postprocess`` tapped at the output layer), called with verl's
``fused_output_processor`` (logitless' under ``install``, the policy loss pending) and verl's
``FusedOutputProcessorContext(temperature=...)`` from the ``temperature`` verl passes. verl's instance
forward is put back afterwards, exactly; the backward pass needs none of it.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Optional

FUSED = "verl.models.mcore.model_forward_fused"
_ABSENT = object()


def _route(model) -> tuple[str, Optional[str]]:
    """(mode, why): the mode of ``forward_mode`` and, for "unfused", the reason."""
    fused = sys.modules[FUSED]
    uses_hook = getattr(fused, "_use_output_processor_hook", None)    # verl 0.9's mode test
    if uses_hook is None:
        return "unfused", "verl's fused forward without _use_output_processor_hook (a verl release not wired)"
    if uses_hook(model):
        return "hook", None
    from ..megatron import fused_forward_mode, unwrap_gpt_model
    from ..megatron.detect import is_gpt_model
    try:
        gpt = unwrap_gpt_model(model)
    except TypeError as exc:
        return "unfused", f"verl's legacy fused forward on a model logitless' legacy patch does not serve ({exc})"
    if not is_gpt_model(gpt):      # verl's legacy forward patches GPTModels only
        return "unfused", f"verl's legacy fused forward on a {type(gpt).__name__} (not wired to the fused loss)"
    mode = fused_forward_mode(gpt)
    if mode != "legacy":
        return "unfused", (f"verl's legacy fused forward on a model whose megatron-core forward logitless reaches "
                           f"as {mode!r}, not through its legacy patch")
    return "legacy", None


def forward_mode(model) -> str:
    """How the fused policy loss reaches the output layer of the Megatron ``model`` (a chunk as verl's
    engine holds it, wrappers included): "hook" (verl's fused forward passes its output processor,
    megatron-core 0.18+), "legacy" (verl's legacy fused forward, replaced here by logitless' legacy
    patch) or "unfused" (neither)."""
    return _route(model)[0]


def unroutable(model) -> Optional[str]:
    """The reason the fused loss cannot reach ``model``'s output layer, or None."""
    return _route(model)[1]


@contextlib.contextmanager
def planned_forward(pending, plan, model, path: str):
    """While open, ``pending.plan`` (a thread-local the processor reads) is ``plan`` and, on the "legacy" path, the
    model runs through ``legacy_route``: what one of verl's forward steps needs to run a fused loss; both put back
    on exit (the outer plan too, for a nested step)."""
    outer, pending.plan = pending.plan, plan
    try:
        with legacy_route(model) if path == "legacy" else contextlib.nullcontext():
            yield
    finally:
        pending.plan = outer


@contextlib.contextmanager
def legacy_route(model):
    """While open, the GPTModel inside ``model`` runs logitless' legacy patch with verl's output processor
    (see the module docstring) in place of verl's legacy fused forward; on exit its instance ``forward`` is
    what it was (verl's), logitless' patch removed."""
    from ..megatron import patch_fused_forward, unpatch_fused_forward, unwrap_gpt_model
    fused = sys.modules[FUSED]
    gpt = unwrap_gpt_model(model)
    verl_forward = gpt.__dict__.pop("forward", _ABSENT)
    try:
        patch_fused_forward(gpt)           # its original: Megatron's class forward (verl's is set aside)
        legacy = gpt.__dict__["forward"]

        def forward(*args, temperature=1.0, **kwargs):
            ctx = fused.FusedOutputProcessorContext(temperature=temperature)
            return legacy(*args, output_processor=fused.fused_output_processor, output_processor_context=ctx,
                          **kwargs)

        gpt.__dict__["forward"] = forward
        yield
    finally:
        unpatch_fused_forward(gpt)         # drops the instance forward (there was none before the patch)
        if verl_forward is not _ABSENT:
            gpt.__dict__["forward"] = verl_forward
