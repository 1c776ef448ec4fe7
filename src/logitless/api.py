"""The public operation: validation, backend choice, and the record of which backend ran."""
from __future__ import annotations

import importlib
import threading
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from .checks import positive_float
from .ops.function import FusedLogProbsFunction

BACKENDS = ("auto", "reference", "chunked", "triton")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MODULES = {"reference": "logitless.ops.reference", "chunked": "logitless.ops.chunked",
            "triton": "logitless.ops.triton.backend"}
_state = threading.local()


class TokenLogProbs(NamedTuple):
    """Per-token results, float32, in the labels' shape. ``entropy`` is None when not asked for."""
    logprobs: Tensor
    entropy: Optional[Tensor]


def last_backend() -> Optional[str]:
    """Name of the backend that the last ``fused_logprobs`` call on this thread ran ("reference",
    "chunked" or "triton"), or None before the first call. Integrations and tests use it to prove
    that no silent fallback happened."""
    return getattr(_state, "backend", None)


def load_backend(name: str):
    """The backend module for ``name`` (not "auto"). Raises ValueError for an unknown name and
    RuntimeError when the backend cannot be imported here (e.g. triton missing)."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as exc:
        raise RuntimeError(f"backend {name!r} cannot be imported here: {exc}") from exc


def choose_backend(hidden: Tensor, weight: Tensor, backend: str = "auto"):
    """Resolve ``backend`` for these inputs: returns (module, reason it was chosen).

    "auto" takes "triton" for CUDA tensors when it can run, else "chunked". An explicit name that
    cannot run on these inputs raises RuntimeError with the reason."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto":
        mod = load_backend(backend)
        reason = mod.unavailable_reason(hidden, weight)
        if reason is not None:
            raise RuntimeError(f"backend {backend!r} cannot run on these inputs: {reason}")
        return mod, "requested"
    if hidden.is_cuda:
        try:
            mod = load_backend("triton")
            reason = mod.unavailable_reason(hidden, weight)
        except RuntimeError as exc:
            reason = str(exc)
        if reason is None:
            return mod, "CUDA tensors and triton runs"
        return load_backend("chunked"), f"triton cannot run: {reason}"
    return load_backend("chunked"), f"{hidden.device.type} tensors: triton runs on CUDA only"


def _check_tensor(arg: str, value) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _inv_temperature(temperature, labels: Tensor) -> Tensor:
    """float32 [N] of 1/temperature, from a positive number or a tensor broadcastable to labels."""
    if isinstance(temperature, Tensor):
        if not (temperature.is_floating_point() or temperature.dtype in (torch.int32, torch.int64)):
            raise TypeError(f"temperature tensor must be a real number type, got {temperature.dtype}")
        if temperature.requires_grad:
            raise ValueError("temperature must not require grad: logitless treats it as a constant")
        if temperature.device != labels.device:
            raise ValueError(f"temperature is on {temperature.device}, labels on {labels.device}")
        if temperature.dim() == 1 and temperature.numel() > 1 and labels.dim() >= 2:
            # broadcasting would line [k] up with the *last* (sequence) axis: a per-sequence [b] would
            # silently become per-position whenever b == s
            raise ValueError(f"temperature of shape {tuple(temperature.shape)} is ambiguous for labels of shape "
                             f"{tuple(labels.shape)}: pass [b, 1] for one per sequence or the labels' full "
                             f"shape for one per token")
        try:
            t = torch.broadcast_to(temperature, labels.shape)
        except RuntimeError:
            raise ValueError(f"temperature of shape {tuple(temperature.shape)} does not broadcast to the "
                             f"labels' shape {tuple(labels.shape)}") from None
        t = t.reshape(-1).float()
        if t.numel() and not bool(torch.isfinite(t).all() and (t > 0).all()):
            raise ValueError("temperature must be finite and > 0 everywhere")
        return t.reciprocal()
    temperature = positive_float(temperature, "temperature", "a positive float or a tensor")
    return torch.full((labels.numel(),), 1.0 / temperature, dtype=torch.float32, device=labels.device)


def _check_softcap(softcap) -> Optional[float]:
    return None if softcap is None else positive_float(softcap, "softcap", "None or a positive float")


def fused_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *,
                   temperature: Union[float, Tensor] = 1.0, with_entropy: bool = True,
                   ignore_index: int = -100, tp_group=None, reduce_grad_hidden: bool = True,
                   backend: str = "auto", softcap: Optional[float] = None) -> TokenLogProbs:
    """Log-probability of each label and entropy of softmax(z), z = hidden @ weight.T / temperature
    (or, with ``softcap``, z = softcap * tanh(hidden @ weight.T / softcap) / temperature),
    without materialising the [tokens x vocab] logits.

    Args:
        hidden: [..., H] float32, bfloat16 or float16; any strides.
        weight: [V, H], same dtype and device as ``hidden`` (the LM head / output embedding).
            Under ``tp_group`` this rank's contiguous shard of vocabulary rows.
        labels: [...] int32 or int64, the leading shape of ``hidden``; values in [0, V) (global ids
            under tensor parallelism) or ``ignore_index``.
        temperature: a positive number, or a tensor broadcastable to ``labels.shape`` (per sequence
            or per token). Not differentiated.
        with_entropy: compute the entropy too (False does less work and returns ``entropy=None``).
        ignore_index: label value whose rows get logprob 0, entropy 0 and no gradient.
        tp_group: a torch.distributed process group over which ``weight`` is sharded by vocab rows.
        reduce_grad_hidden: under ``tp_group``, all-reduce d_hidden inside backward (default), so
            every rank gets the full gradient. False leaves it partial for callers whose own
            region ops reduce it (Megatron's copy-to-tensor-parallel region, or
            ``logitless.parallel.gather_sequence``, whose backward reduce-scatters it); never both.
        backend: "auto", "reference", "chunked" or "triton"; see ``logitless.last_backend()``.
        softcap: None, or a positive number c: the logits are capped to (-c, c) by c * tanh(logit / c)
            before the temperature divides them (Gemma 2's ``final_logit_softcapping``). Exact in value
            and gradient; not differentiated itself.

    Returns:
        TokenLogProbs(logprobs, entropy), float32, each of ``labels.shape``.

    Gradients flow to ``hidden`` and ``weight`` (only those that require grad) from any loss on
    logprobs and/or entropy; nothing of size [tokens x vocab] is kept for backward.
    """
    hidden = _check_tensor("hidden", hidden)
    weight = _check_tensor("weight", weight)
    labels = _check_tensor("labels", labels)
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, bfloat16 or float16, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension [..., H]")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary (V == 0)")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight has H={weight.shape[1]} but hidden has H={hidden.shape[-1]}")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device}, hidden on {hidden.device}")
    if labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be int32 or int64, got {labels.dtype}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if labels.device != hidden.device:
        raise ValueError(f"labels are on {labels.device}, hidden on {hidden.device}")
    if not isinstance(with_entropy, bool):
        raise TypeError(f"with_entropy must be a bool, got {type(with_entropy).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -2**63 <= ignore_index < 2**63:
        raise ValueError(f"ignore_index must fit in int64, got {ignore_index}")
    if not isinstance(reduce_grad_hidden, bool):
        raise TypeError(f"reduce_grad_hidden must be a bool, got {type(reduce_grad_hidden).__name__}")

    softcap = _check_softcap(softcap)

    mod, _ = choose_backend(hidden, weight, backend)
    inv_temp = _inv_temperature(temperature, labels)

    flat_labels = labels.reshape(-1).long()
    valid = flat_labels != ignore_index
    tp = None
    if tp_group is not None:
        from .parallel import VocabParallel
        tp = VocabParallel.for_group(tp_group, weight)
        vocab = tp.vocab_size
    else:
        vocab = weight.shape[0]
    bad = valid & ((flat_labels < 0) | (flat_labels >= vocab))
    if flat_labels.numel() and bool(bad.any()):
        first = int(flat_labels[bad][0])
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got {first}")

    # reshape outside the Function so autograd links the caller's tensors to ours
    h2 = hidden.reshape(-1, hidden.shape[-1])
    lp, ent = FusedLogProbsFunction.apply(h2, weight, flat_labels, inv_temp, valid, mod, with_entropy,
                                          tp if tp is None else tp.with_reduce(reduce_grad_hidden), softcap)
    _state.backend = mod.name
    return TokenLogProbs(lp.view(labels.shape), ent.view(labels.shape) if with_entropy else None)
