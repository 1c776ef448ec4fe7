"""The one computation behind every verl site: verl's ``linear_cross_entropy`` contract, run by
``logitless.fused_logprobs``.

verl's contract (``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy``):
``(hidden [..., H], weight [V(/tp), H], labels [...], temperature: float, reduction: str,
dist_process_group) -> (logprobs, entropy)``: hidden and labels are each flattened (hidden to
[N, H], labels to [N]) and paired row by row; logprobs is float32 [N] (a scalar for reduction
"sum" / "mean"), entropy float32 [N]; gradients flow to hidden and weight.

Under ``install(truncation=True)``, inside the actor's log-prob and update calls (``truncation.py``), both
compute the log-probs and entropies of the rollout's truncated distribution (its top_k / top_p).
"""
from __future__ import annotations

from numbers import Real
from typing import Optional

import torch
from torch import Tensor

from .. import checks
from ..api import TokenLogProbs, fused_logprobs, head_operands
from . import truncation as rollout_truncation

REDUCTIONS = ("none", "sum", "mean")


def check_temperature(temperature) -> float:
    """verl passes one Python number (its kernel asserts a float); ints are accepted too."""
    if isinstance(temperature, bool) or not isinstance(temperature, Real):
        raise TypeError(f"temperature must be a positive float, got {type(temperature).__name__}")
    return checks.positive_float(temperature, "temperature")


def group_or_none(group):
    """verl always passes Megatron's TP group, also at TP=1: a group of one rank needs no collectives."""
    if group is None:
        return None
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return None
    return group if dist.get_world_size(group) > 1 else None


def _truncated() -> dict:
    """``truncation=`` for fused_logprobs in a truncated worker call (noted for ``truncation.check_ran``)."""
    trunc = rollout_truncation.current()
    if trunc is None:
        return {}
    rollout_truncation.note_head()
    return {"truncation": trunc}


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, temperature=1.0,
                         reduction: str = "none", dist_process_group=None, *,
                         reduce_grad_hidden: bool = True) -> tuple:
    """verl's ``linear_cross_entropy`` computed by logitless (see the module docstring).

    reduce_grad_hidden: under a TP group of more than one rank, whether d_hidden is all-reduced
    here (the caller has no region op that reduces it) or left partial (the caller gathered the
    hidden states from the sequence-parallel region, whose backward reduce-scatters it).
    """
    hidden = checks.tensor(hidden, "hidden")
    weight = checks.tensor(weight, "weight")
    labels = checks.index_tensor(labels, "labels")
    t = check_temperature(temperature)
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension [..., H]")
    h = hidden.reshape(-1, hidden.shape[-1])
    flat = labels.reshape(-1)
    if flat.numel() != h.shape[0]:
        raise ValueError(f"labels has {flat.numel()} elements but hidden has {h.shape[0]} rows "
                         f"(hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)})")
    h, w = head_operands(h, weight)
    group = group_or_none(dist_process_group)
    with torch.autocast(h.device.type, enabled=False):
        # without a group of several ranks d_hidden is whole: the setting has no effect (and is refused) there
        out = fused_logprobs(h, w, flat, temperature=t, tp_group=group,
                             reduce_grad_hidden=reduce_grad_hidden or group is None, **_truncated())
    logprobs = out.logprobs
    r = reduction.lower()
    if r == "sum":
        logprobs = logprobs.sum()
    elif r == "mean":
        logprobs = logprobs.sum() / max(flat.numel(), 1)
    return logprobs, out.entropy


def fused_linear_for_ppo(hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor,
                         temperature=1.0, entropy_dtype: Optional[torch.dtype] = None) -> TokenLogProbs:
    """verl's ``FusedLinearForPPO.forward`` contract: hidden [T, H] or [B, T, H], labels of its
    leading shape; log-probs float32, entropy in ``entropy_dtype`` (default float32)."""
    hidden_states = checks.tensor(hidden_states, "hidden_states")
    vocab_weights = checks.tensor(vocab_weights, "vocab_weights")
    input_ids = checks.index_tensor(input_ids, "input_ids")
    t = check_temperature(temperature)
    if hidden_states.dim() not in (2, 3):
        raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(hidden_states.shape)}")
    if tuple(input_ids.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(f"input_ids shape {tuple(input_ids.shape)} must match hidden_states shape "
                         f"{tuple(hidden_states.shape[:-1])}")
    h, w = head_operands(hidden_states, vocab_weights)
    with torch.autocast(h.device.type, enabled=False):
        out = fused_logprobs(h, w, input_ids.to(torch.int64), temperature=t, **_truncated())
    entropy = out.entropy
    if entropy_dtype is not None and entropy.dtype != entropy_dtype:
        entropy = entropy.to(entropy_dtype)
    return TokenLogProbs(out.logprobs, entropy)
