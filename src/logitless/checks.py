"""Argument checks shared by the public op and the integrations, so every entry point says the same."""
from __future__ import annotations

import math
from numbers import Real


def positive_float(value, name: str, expected: str = "a positive float") -> float:
    """``value`` as a float if it is a real number (not a bool), finite and > 0.

    TypeError naming ``name`` for anything that is not a number (``expected`` says what is accepted),
    ValueError for a number that is not finite and positive."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)
