"""A sampler's truncation (``logitless.Truncation``) in the layout of ``fused_forward`` / ``fused_policy_loss``:
per-token setting tensors come in the targets' [b, s] layout (or [b, 1] per sequence), kept_ids [b, s, K], and
follow the rows the head scores (only the scored positions; one packed row flattened)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from ..truncation import Truncation

_SETTINGS = ("top_k", "top_p", "min_p")


def check_truncation(truncation) -> Optional[Truncation]:
    """TypeError for anything but a Truncation or None; the Truncation's own checks."""
    if truncation is None:
        return None
    if not isinstance(truncation, Truncation):
        raise TypeError(f"truncation must be a logitless.Truncation or None, got {type(truncation).__name__}")
    return truncation.check()


def _full(value: Tensor, name: str, shape) -> Tensor:
    want = tuple(shape) + tuple(value.shape[len(shape):]) if name == "kept_ids" else tuple(shape)
    try:
        return torch.broadcast_to(value, want)
    except RuntimeError:
        raise ValueError(f"truncation.{name} of shape {tuple(value.shape)} does not broadcast to the batch's "
                         f"{list(shape)} ([b, s] per token, [b, 1] per sequence)") from None


def as_rows(truncation: Optional[Truncation], shape, idx: Optional[Tensor] = None, flat: bool = True,
            device=None) -> Optional[Truncation]:
    """The truncation for the head's rows: its tensors broadcast to ``shape`` ([b, s]) and, with ``flat``,
    flattened to [b * s] (kept_ids [b * s, K]) and narrowed to the rows ``idx`` (None: all), on ``device``."""
    if truncation is None:
        return None

    def rows(value, name):
        if not isinstance(value, Tensor):
            return value
        value = _full(value, name, shape)
        if flat:
            value = value.reshape(-1, value.shape[-1]) if name == "kept_ids" else value.reshape(-1)
            if idx is not None:
                value = value.index_select(0, idx.to(value.device))
        return value if device is None else value.to(device)

    return dataclasses.replace(truncation, **{name: rows(getattr(truncation, name), name)
                                              for name in _SETTINGS + ("kept_ids",)})
