"""Argument checks shared by the public op, the losses and the integrations, so every entry point
accepts the same things and says the same thing about what it refuses.

Each check names the argument: TypeError for a value of the wrong kind, ValueError for a value of
the right kind that is out of range. Integrations keep only their own layout rules (which axis a
per-sequence temperature belongs to) as short adapters in front of :func:`temperature`.
"""
from __future__ import annotations

import difflib
import math
from numbers import Real
from typing import Optional, Union

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)

# The smallest temperature: logitless scales float32 logits by 1 / temperature, and below this the scale
# (1e30) times any logit of magnitude above ~3e8 overflows float32, as would the log-probs themselves
# (they grow like 1 / temperature). Any finite temperature above it is exact: a huge one makes 1 / T
# round to 0 in float32, which is the float32 value of every logit divided by it (a uniform softmax).
MIN_TEMPERATURE = 1e-30
TEMPERATURE_RULE = f"temperature must be finite and >= {MIN_TEMPERATURE:g}"


def tensor(value, name: str) -> Tensor:
    """``value`` if it is a torch.Tensor, else TypeError naming ``name``."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def index_tensor(value, name: str) -> Tensor:
    """A tensor of int32 or int64 (token ids, labels), else TypeError naming ``name``."""
    value = tensor(value, name)
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {value.dtype}")
    return value


def boolean(value, name: str) -> bool:
    """``value`` if it is a bool (not merely truthy), else TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def reduce_grad_hidden(value, tp_group) -> bool:
    """``reduce_grad_hidden`` if it is a bool with an effect: False (leave d_hidden as this rank's partial sum)
    means something only under ``tp_group``; without one d_hidden is whole, so False is a ValueError."""
    boolean(value, "reduce_grad_hidden")
    if not value and tp_group is None:
        raise ValueError("reduce_grad_hidden=False has no effect without tp_group (d_hidden is already whole on one "
                         "process): leave it True, or pass the tensor-parallel group")
    return value


def integer(value, name: str, minimum: Optional[int] = None) -> int:
    """``value`` if it is an int (not a bool) >= ``minimum`` (when given); TypeError / ValueError
    naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def ignore_index(value, name: str = "ignore_index") -> int:
    """An int that fits in int64 (it is compared with int64 labels)."""
    value = integer(value, name)
    if not -2**63 <= value < 2**63:
        raise ValueError(f"{name} must fit in int64, got {value}")
    return value


def is_finite(value) -> bool:
    """math.isfinite of a number, written as comparisons (NaN fails both): under torch.compile a float
    argument may be a symbolic float (``dynamic=True``, or a value that changed between calls), which
    comparisons guard on but math.isfinite cannot take (a graph break, an error under fullgraph=True)."""
    return -math.inf < value < math.inf


def positive_float(value, name: str, expected: str = "a positive float") -> float:
    """``value`` as a float if it is a real number (not a bool), finite and > 0.

    TypeError naming ``name`` for anything that is not a number (``expected`` says what is accepted),
    ValueError for a number that is not finite and positive."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__}")
    value = float(value)   # a symbolic float (torch.compile) as a number an error message can show
    if not (is_finite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return value


def optional_positive_float(value, name: str) -> Optional[float]:
    return None if value is None else positive_float(value, name, "None or a positive float")


# The range of a logit softcap: far beyond any model's (Gemma 2: 30), and inside it the capped logits
# c * tanh(raw / c) / temperature stay finite in float32 for every supported temperature.
SOFTCAP_RANGE = (1e-6, 1e6)


def softcap(value) -> Optional[float]:
    """None, or a number in SOFTCAP_RANGE (TypeError / ValueError naming ``softcap``)."""
    value = optional_positive_float(value, "softcap")
    low, high = SOFTCAP_RANGE
    if value is not None and not low <= value <= high:
        raise ValueError(f"softcap must be None or in [{low:g}, {high:g}], got {value!r}")
    return value


def real_tensor(value: Tensor, name: str, device: Optional[torch.device] = None, max_dim: Optional[int] = None,
                check_values: bool = True) -> Tensor:
    """A per-token / per-sequence input tensor (temperature, advantages, log-probs) as detached
    float32: a real dtype, not requiring grad (logitless treats it as a constant), on ``device`` when
    given, at most ``max_dim`` dimensions, and with ``check_values`` finite
    everywhere (one host synchronisation)."""
    if not (value.is_floating_point() or value.dtype in INDEX_DTYPES):
        raise TypeError(f"{name} tensor must be a real number type, got {value.dtype}")
    if value.requires_grad:
        raise ValueError(f"{name} must not require grad: logitless treats it as a constant")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, the tokens on {device}")
    if max_dim is not None and value.dim() > max_dim:
        raise ValueError(f"{name} tensor must have at most {max_dim} dimensions, got shape {tuple(value.shape)}")
    value = value.detach().float()
    if check_values and value.numel():
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} must be finite everywhere")
    return value


def temperature(value, device: Optional[torch.device] = None, max_dim: Optional[int] = None,
                check_values: bool = True) -> Union[float, Tensor]:
    """The one temperature rule: a finite number >= MIN_TEMPERATURE (returned as a float), or a real tensor
    that does not require grad, lies on ``device`` (when given), has at most ``max_dim`` dimensions
    and is finite and >= MIN_TEMPERATURE everywhere (returned as detached float32; ``check_values=False`` skips the
    value check, the only host synchronisation). Its layout (per sequence, per token) is the caller's
    rule."""
    if isinstance(value, Tensor):
        t = real_tensor(value, "temperature", device, max_dim, check_values=False)
        # float64 values are checked as given (1e300 is a valid temperature, inf in float32)
        if check_values and t.numel() and not bool(temperature_ok(precise(value, t)).all()):
            raise ValueError(f"{TEMPERATURE_RULE} everywhere")
        return t
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"temperature must be a positive float or a tensor, got {type(value).__name__}")
    t = float(value)
    if not (is_finite(t) and t >= MIN_TEMPERATURE):
        raise ValueError(f"{TEMPERATURE_RULE} (1 / temperature scales float32 logits), got {t!r}")
    return t


def precise(value: Tensor, t: Tensor) -> Tensor:
    """``value`` detached if it is float64, else its float32 copy ``t``: where the inverse temperature is
    computed from (1 / 1e300 rounds to float32's range; 1e300 itself does not)."""
    return value.detach() if value.dtype == torch.float64 else t


def temperature_ok(t: Tensor) -> Tensor:
    """bool, elementwise: the temperature ``t`` lies in the supported range (finite, >= MIN_TEMPERATURE)."""
    return torch.isfinite(t) & (t >= MIN_TEMPERATURE)


# 1 / temperature is at least float32's smallest normal number: a huge temperature's true inverse rounds to
# 0, but 0 * -inf (the kernels' padding) is NaN; this scale gives every logit the same float32 softmax as 0.
MIN_INVERSE_TEMPERATURE = torch.finfo(torch.float32).tiny
# and at most 1 / MIN_TEMPERATURE as float32 rounds it (1e30 rounds up, to 1.0000000150e30)
MAX_INVERSE_TEMPERATURE = float(torch.tensor(1.0 / MIN_TEMPERATURE, dtype=torch.float32))


def inverse_temperature(t: Tensor) -> Tensor:
    """float32 1 / t where ``temperature_ok(t)`` (at least MIN_INVERSE_TEMPERATURE), NaN elsewhere: the op
    checks its inverse temperatures with ``inverse_temperature_ok`` (an infinite or negative t fails)."""
    inv = t.reciprocal().float().clamp_min(MIN_INVERSE_TEMPERATURE)
    return torch.where(temperature_ok(t), inv, torch.full_like(inv, math.nan))


def inverse_temperature_of(t: float) -> float:
    """``inverse_temperature`` of a checked number."""
    return max(1.0 / t, MIN_INVERSE_TEMPERATURE)


def inverse_temperature_ok(inv_temp: Tensor) -> Tensor:
    """0-d bool: every inverse temperature is what ``inverse_temperature`` makes of a supported temperature
    (NaN fails both comparisons)."""
    return ((inv_temp >= 0) & (inv_temp <= MAX_INVERSE_TEMPERATURE)).all()


def finite_float(value, name: str, minimum: Optional[float] = None, above: bool = False) -> float:
    """``value`` as a float if it is a real number (not a bool) and finite, and (when ``minimum`` is
    given) >= minimum, or > minimum with ``above``. TypeError / ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not is_finite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if minimum is not None and (value <= minimum if above else value < minimum):
        raise ValueError(f"{name} must be {'>' if above else '>='} {minimum}, got {value!r}")
    return value


def per_token_tensor(value, name: str, labels: Tensor) -> Tensor:
    """A per-token input (advantages, log-probs of another policy, ...) as detached float32 of the labels'
    shape: a real tensor that does not require grad, on the labels' device, broadcastable to
    ``labels.shape`` (one value per sequence [b, 1], per token [b, s], or one for all).

    A 1-D [k] tensor (k > 1) against labels of two or more dimensions is refused as ambiguous:
    broadcasting would line it up with the last (sequence) axis, so a per-sequence [b] would silently
    become per-position whenever b == s. Values are not checked here (the caller checks the scored
    tokens only, so padding may hold anything)."""
    value = real_tensor(tensor(value, name), name, device=labels.device, check_values=False)
    if value.dim() == 1 and value.numel() > 1 and labels.dim() >= 2:
        raise ValueError(f"{name} of shape {tuple(value.shape)} is ambiguous for labels of shape "
                         f"{tuple(labels.shape)}: pass [b, 1] for one per sequence or the labels' full shape "
                         f"for one per token")
    try:
        return torch.broadcast_to(value, labels.shape)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(value.shape)} does not broadcast to the labels' shape "
                         f"{tuple(labels.shape)}") from None


# a per-token weight of a loss (token_weight): a negative one turns the loss's term into one to maximise
TOKEN_WEIGHT_RULE = ("token_weight must be finite and >= 0 at every scored token (label != ignore_index): a "
                     "negative weight turns that token's term into one the loss maximises")


def weight_ok(w: Tensor) -> Tensor:
    """bool mask of the per-token weights that are finite and >= 0 (``TOKEN_WEIGHT_RULE``)."""
    return torch.isfinite(w) & (w >= 0)


def did_you_mean(name: str, known) -> Optional[str]:
    """"did you mean 'x'?" for a misspelled keyword ``name`` among ``known`` names, or None where none is close
    (the one suggestion every op's refusal of an unknown keyword gives)."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}?" if close else None


def labels_out_of_range(labels: Tensor, valid: Tensor, vocab: int) -> Tensor:
    """bool mask of the scored labels (``valid``) that lie outside [0, vocab)."""
    return valid & ((labels < 0) | (labels >= vocab))


def check_label_range(flat_labels: Tensor, valid: Tensor, vocab: int, ignore_index: int) -> None:
    """ValueError when a label that is not ignore_index lies outside [0, vocab) (one host sync)."""
    bad = labels_out_of_range(flat_labels, valid, vocab)
    if flat_labels.numel() and bool(bad.any()):
        first = int(flat_labels[bad][0])
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got {first}")


NON_FINITE_HIDDEN = ("hidden must be finite at every scored row (label != ignore_index): a NaN or an infinity there "
                     "makes that row's log-prob NaN and every entry of the weight's gradient NaN")


def non_finite_rows(hidden: Tensor, valid: Tensor) -> Tensor:
    """0-d bool: whether a scored row (``valid`` [N]) of hidden [N, H] holds a NaN or an infinity. One reduction
    (a float32 row sum: NaN or infinite exactly when the row holds one, short of float32 overflow, which the logits
    of such a row would overflow too), no [N, H] temporary."""
    return (valid & ~torch.isfinite(hidden.sum(dim=-1, dtype=torch.float32))).any()
