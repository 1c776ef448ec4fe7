"""The public operation: validation, backend choice, and the record of which backend ran."""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import checks
from .ops.function import FusedLogProbsFunction, OpOptions
from .ops.registry import BACKENDS, choose_backend

if TYPE_CHECKING:
    from .parallel import VocabParallel

__all__ = ["fused_logprobs", "TokenLogProbs", "last_backend", "choose_backend", "BACKENDS"]

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


def record_backend(name: str) -> None:
    """Set what ``last_backend()`` returns (the op, and the fused losses, call it)."""
    _state.backend = name


def inv_temperature(temperature, labels: Tensor) -> Tensor:
    """float32 [N] of 1/temperature, from a positive number or a tensor broadcastable to labels."""
    t = checks.temperature(temperature, device=labels.device)
    if not isinstance(t, Tensor):
        return torch.full((labels.numel(),), 1.0 / t, dtype=torch.float32, device=labels.device)
    if t.dim() == 1 and t.numel() > 1 and labels.dim() >= 2:
        # broadcasting would line [k] up with the *last* (sequence) axis: a per-sequence [b] would
        # silently become per-position whenever b == s
        raise ValueError(f"temperature of shape {tuple(t.shape)} is ambiguous for labels of shape "
                         f"{tuple(labels.shape)}: pass [b, 1] for one per sequence or the labels' full "
                         f"shape for one per token")
    try:
        t = torch.broadcast_to(t, labels.shape)
    except RuntimeError:
        raise ValueError(f"temperature of shape {tuple(t.shape)} does not broadcast to the "
                         f"labels' shape {tuple(labels.shape)}") from None
    return t.reshape(-1).reciprocal()


def check_head(hidden, weight, labels) -> tuple[Tensor, Tensor, Tensor]:
    """The checks every fused entry point makes on (hidden [..., H], weight [V, H], labels [...])."""
    hidden = checks.tensor(hidden, "hidden")
    weight = checks.tensor(weight, "weight")
    labels = checks.index_tensor(labels, "labels")
    if hidden.dtype not in checks.FLOAT_DTYPES:
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
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal hidden's leading shape "
                         f"{tuple(hidden.shape[:-1])}")
    if labels.device != hidden.device:
        raise ValueError(f"labels are on {labels.device}, hidden on {hidden.device}")
    return hidden, weight, labels


def vocab_layout(weight: Tensor, tp_group) -> tuple[Optional["VocabParallel"], int]:
    """(the vocab-parallel layout or None, the global vocabulary size)."""
    if tp_group is None:
        return None, weight.shape[0]
    from .parallel import VocabParallel
    tp = VocabParallel.for_group(tp_group, weight)
    return tp, tp.vocab_size


def check_label_range(flat_labels: Tensor, valid: Tensor, vocab: int, ignore_index: int) -> None:
    """ValueError when a label that is not ignore_index lies outside [0, vocab) (one host sync)."""
    bad = valid & ((flat_labels < 0) | (flat_labels >= vocab))
    if flat_labels.numel() and bool(bad.any()):
        first = int(flat_labels[bad][0])
        raise ValueError(f"labels must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got {first}")


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
    hidden, weight, labels = check_head(hidden, weight, labels)
    checks.boolean(with_entropy, "with_entropy")
    ignore_index = checks.ignore_index(ignore_index)
    checks.boolean(reduce_grad_hidden, "reduce_grad_hidden")
    softcap = checks.optional_positive_float(softcap, "softcap")

    mod, _ = choose_backend(hidden, weight, backend)
    inv_temp = inv_temperature(temperature, labels)

    flat_labels = labels.reshape(-1).long()
    valid = flat_labels != ignore_index
    tp, vocab = vocab_layout(weight, tp_group)
    check_label_range(flat_labels, valid, vocab, ignore_index)

    # reshape outside the Function so autograd links the caller's tensors to ours
    h2 = hidden.reshape(-1, hidden.shape[-1])
    options = OpOptions(backend=mod, with_entropy=with_entropy, softcap=softcap,
                        tp=None if tp is None else tp.with_reduce(reduce_grad_hidden))
    lp, ent = FusedLogProbsFunction.apply(h2, weight, flat_labels, inv_temp, valid, options)
    record_backend(mod.name)
    return TokenLogProbs(lp.view(labels.shape), ent.view(labels.shape) if with_entropy else None)
