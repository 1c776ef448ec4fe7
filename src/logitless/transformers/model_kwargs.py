"""Which extra keywords ``fused_forward`` / ``fused_policy_loss`` / a patched forward pass on to the model.

A transformers model's ``forward`` takes ``**kwargs`` and drops what it does not know, so a misspelled or
misplaced setting (``temprature=0.5``, ``surrogate="sapo"``) would run and give a plausible, wrong number.
logitless passes on only the names the base model's ``forward`` declares: its named parameters and the keys of
the ``TypedDict`` its ``**kwargs`` are annotated with (``Unpack[TransformersKwargs]``), plus transformers'
``TransformersKwargs`` keys, which every model accepts. Anything else is a TypeError naming it, with where it
belongs when logitless knows (a ``PolicyLoss`` setting goes in ``loss_settings``).
"""
from __future__ import annotations

import difflib
import functools
import inspect
import typing

from torch import nn

from ..losses import PolicyLoss

_POLICY_FIELDS = frozenset(PolicyLoss.__dataclass_fields__)


def _typed_dict_keys(annotation) -> set:
    """The keys of ``Unpack[SomeTypedDict]`` (or of the TypedDict itself); empty for anything else."""
    for candidate in (annotation, *typing.get_args(annotation)):
        keys = getattr(candidate, "__annotations__", None)
        if isinstance(candidate, type) and issubclass(candidate, dict) and keys:
            return set(keys)
    return set()


@functools.lru_cache(maxsize=None)
def accepted_names(cls: type) -> frozenset:
    """The keywords ``cls.forward`` declares (named parameters, the TypedDict keys of its ``**kwargs``), and
    transformers' ``TransformersKwargs`` keys (every model's forward takes them)."""
    names = set()
    try:
        from transformers.utils.generic import TransformersKwargs
        names |= _typed_dict_keys(TransformersKwargs)
    except ImportError:     # an older transformers without it: the signature alone
        pass
    params = inspect.signature(cls.forward).parameters
    names |= {p.name for p in params.values()
              if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    names.discard("self")
    try:
        hints = typing.get_type_hints(cls.forward)
    except Exception:       # unresolvable annotations: the named parameters are still known
        hints = {}
    for p in params.values():
        if p.kind == inspect.Parameter.VAR_KEYWORD:
            names |= _typed_dict_keys(hints.get(p.name, p.annotation))
    return frozenset(names)


def check_model_kwargs(backbone: nn.Module, kwargs: dict, caller: str, own: tuple = ()) -> None:
    """TypeError for a keyword in ``kwargs`` that ``backbone``'s forward does not declare (see the module's
    docstring). caller: the function's name for the message; own: its own argument names (for suggestions)."""
    accepted = accepted_names(type(backbone))
    unknown = [name for name in kwargs if name not in accepted]
    if not unknown:
        return
    name = unknown[0]
    where = f"{type(backbone).__name__}.forward"
    if name in _POLICY_FIELDS:
        hint = (f"{name} is a logitless.losses.PolicyLoss setting: give it to "
                f"logitless.transformers.fused_policy_loss as loss_settings=dict({name}=...)")
    elif name == "softcap":
        hint = ("the head's softcap is read from the model's config (final_logit_softcapping) and applied "
                "exactly; it is not an argument here (logitless.fused_logprobs takes softcap= for a bare head)")
    else:
        close = difflib.get_close_matches(name, sorted(set(own) | _POLICY_FIELDS | accepted), n=1, cutoff=0.75)
        hint = f"did you mean {close[0]!r}?" if close else f"{where} takes {sorted(accepted)}"
    raise TypeError(f"{caller} got the keyword {name!r}, which neither logitless nor {where} declares; "
                    f"refused rather than passed on (the model would drop it silently): {hint}")
