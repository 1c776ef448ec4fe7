"""The temperature argument of the Megatron integration, checked once and laid out once.

Accepted forms: a positive number; a 0-d tensor; [b] (one per sequence); [b, s] (one per token),
where [b, s] is the labels' layout. Every path (the fused processor, which sees tokens as [s, b],
and the unfused fallback, which sees logits [b, s, V]) gets its layout from ``temperature_bs``, so a
per-sequence [b] can never be broadcast along the sequence axis by accident (as [b] against [b, s]
would be when b == s).
"""
from __future__ import annotations

from typing import Union

from torch import Tensor

from .. import checks


def check_temperature(temperature) -> Union[float, Tensor]:
    """``checks.temperature`` with at most 2 dimensions ([b] or [b, s]); the shape is checked against
    the batch later, by ``temperature_bs``."""
    return checks.temperature(temperature, max_dim=2)


def temperature_bs(temperature, b: int, s: int, device) -> Union[float, Tensor]:
    """The temperature as a float, or a float32 tensor that broadcasts against [b, s] in the right
    way: 0-d, [b, 1] (per sequence: a [b] tensor becomes a column) or [b, s] (also [1, s] / [b, 1])."""
    t = checks.temperature(temperature, device=device, max_dim=2)
    if not isinstance(t, Tensor) or t.dim() == 0:
        return t
    if t.dim() == 1:
        if t.shape[0] not in (1, b):
            raise ValueError(f"temperature of shape [{t.shape[0]}] must have one entry per sequence (b={b})")
        return t.view(-1, 1)
    if t.shape[0] not in (1, b) or t.shape[1] not in (1, s):
        raise ValueError(f"temperature of shape {tuple(t.shape)} must be [b, s] = [{b}, {s}] (or broadcast "
                         "to it)")
    return t
