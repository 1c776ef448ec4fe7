"""Replacing one of a trainer's methods on that instance only (enable) and putting it back (disable): the state
kept under ``names.STATE`` remembers what the instance had before."""
from __future__ import annotations

import types

from .. import checks
from .names import STATE


def restore_method(trainer, state, name):
    """Put back on ``trainer`` what enable() replaced of ``name`` (the class's method when it was not an instance
    attribute before)."""
    if name in state["previous"]:
        trainer.__dict__[name] = state["previous"][name]
    else:
        trainer.__dict__.pop(name, None)


def check_fused_loss(fused_loss, trainer_name: str) -> None:
    """The distillation trainers' loss is always fused: ``fused_loss`` may be None or True; False is a ValueError
    (log-probs only has no meaning for them)."""
    if fused_loss is not None:
        checks.boolean(fused_loss, "fused_loss")
        if not fused_loss:
            raise ValueError(f"fused_loss=False: a {trainer_name} computes no per-token log-probs apart from its "
                             "loss, so logitless computes the loss; leave fused_loss out (or True)")


def enable_loss_method(trainer, method: str, fn):
    """``trainer.<method>`` becomes ``fn`` bound to it, on this instance only; returns ``trainer``."""
    state = trainer.__dict__.get(STATE)
    if state is None:
        state = {"previous": {method: trainer.__dict__[method]} if method in trainer.__dict__ else {}}
        trainer.__dict__[STATE] = state
    state["fused_loss"] = True
    trainer.__dict__[method] = types.MethodType(fn, trainer)
    return trainer


def disable_loss_method(trainer, method: str):
    """Undo ``enable_loss_method`` (a no-op on a trainer that is not enabled)."""
    state = trainer.__dict__.pop(STATE, None)
    if state is not None:
        restore_method(trainer, state, method)
    return trainer
