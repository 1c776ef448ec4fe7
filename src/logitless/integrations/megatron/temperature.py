"""The temperature argument of the Megatron integration, checked once and laid out once.

Accepted forms: a positive number; a 0-d tensor; [b] (one per sequence); [b, s] (one per token),
where [b, s] is the labels' layout. Every path (the fused processor, which sees tokens as [s, b],
and the unfused fallback, which sees logits [b, s, V]) gets its layout from ``temperature_bs``, so a
per-sequence [b] can never be broadcast along the sequence axis by accident (as [b] against [b, s]
would be when b == s).
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from ...checks import positive_float


def check_temperature(temperature) -> Union[float, Tensor]:
    """A float, or the tensor as given (its shape is checked against the batch later). TypeError for
    anything else, ValueError for a number that is not finite and > 0 or a tensor requiring grad."""
    if isinstance(temperature, Tensor):
        if temperature.requires_grad:
            raise ValueError("temperature must not require grad: logitless treats it as a constant")
        if temperature.dim() > 2:
            raise ValueError(f"temperature tensor must have shape [b] or [b, s], got {tuple(temperature.shape)}")
        return temperature
    return positive_float(temperature, "temperature", "a positive float or a tensor")


def temperature_bs(temperature, b: int, s: int, device) -> Union[float, Tensor]:
    """The temperature as a float, or a float32 tensor that broadcasts against [b, s] in the right
    way: 0-d, [b, 1] (per sequence: a [b] tensor becomes a column) or [b, s] (also [1, s] / [b, 1])."""
    if not isinstance(temperature, Tensor):
        return float(temperature)
    t = temperature.detach().to(device=device, dtype=torch.float32)
    if t.dim() == 0:
        return t
    if t.dim() == 1:
        if t.shape[0] not in (1, b):
            raise ValueError(f"temperature of shape [{t.shape[0]}] must have one entry per sequence (b={b})")
        return t.view(-1, 1)
    if t.dim() != 2 or t.shape[0] not in (1, b) or t.shape[1] not in (1, s):
        raise ValueError(f"temperature of shape {tuple(t.shape)} must be [b, s] = [{b}, {s}] (or broadcast "
                         "to it)")
    return t
