"""The settings of a sampler's truncation (top-k, top-p, min-p, or the kept ids it logged) and what
``fused_logprobs(..., truncation=...)`` returns under them: the log-prob of the distribution the rollout sampled
from (docs/truncation.md)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from . import checks
from .ops.truncation_select import RowSettings

__all__ = ["Truncation", "TruncatedLogProbs"]

Setting = Union[int, float, Tensor, None]


class TruncatedLogProbs(NamedTuple):
    """Per token, each of ``labels.shape``:

    logprobs: float32, z_y - logsumexp(z over the kept set): the label's log-prob under the truncated,
        renormalised distribution; the same formula for a label outside the kept set (finite; ``inside`` is False;
        in the settings form at most the log of the least kept probability, since the kept set is a most probable
        prefix; in the replay form unbounded: the given ids need not be the most probable). 0 where ignored.
    entropy: float32, the truncated distribution's entropy (None with ``with_entropy=False``).
    inside: bool, whether the label is in the kept set (False where ignored).
    kept_count: int64, the kept set's size (0 where ignored).
    kept_logprob: float32, log of the kept set's mass under the full softmax (<= 0; not differentiated); None in
        the replay form, which does not pass over the vocabulary.
    """
    logprobs: Tensor
    entropy: Optional[Tensor]
    inside: Tensor
    kept_count: Tensor
    kept_logprob: Optional[Tensor]


def _broadcast(value: Tensor, name: str, labels: Tensor) -> Tensor:
    if value.device != labels.device:
        raise ValueError(f"{name} is on {value.device}, labels on {labels.device}")
    if value.dim() == 1 and value.numel() > 1 and labels.dim() >= 2:
        raise ValueError(f"{name} of shape {tuple(value.shape)} is ambiguous for labels of shape "
                         f"{tuple(labels.shape)}: pass [b, 1] for one per sequence or the labels' full shape")
    try:
        return torch.broadcast_to(value, labels.shape).reshape(-1)
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(value.shape)} does not broadcast to the labels' shape "
                         f"{tuple(labels.shape)}") from None


def _top_k(value, labels: Tensor) -> Tensor:
    rule = "top_k must be -1 (off) or an int >= 1"
    if isinstance(value, Tensor):
        if value.dtype not in checks.INDEX_DTYPES:
            raise TypeError(f"top_k must be an int or an int32 / int64 tensor, got {value.dtype}")
        k = _broadcast(value, "top_k", labels).long()        # (integer tensors cannot require grad)
        bad = (k == 0) | (k < -1)
        if bool(bad.any()):
            raise ValueError(f"{rule}, got {int(k[bad][0])}")
        return k
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"top_k must be an int or an int tensor, got {type(value).__name__}")
    if value == 0 or value < -1:
        raise ValueError(f"{rule}, got {value}")
    return torch.full((labels.numel(),), value, dtype=torch.int64, device=labels.device)


def _fraction(value, name: str, labels: Tensor, low_open: bool) -> Tensor:
    rule = f"{name} must lie in {'(0, 1]' if low_open else '[0, 1]'}"
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a float or a floating-point tensor, got {value.dtype}")
        if value.requires_grad:
            raise ValueError(f"{name} must not require grad: it is a setting, not differentiated")
        v = _broadcast(value, name, labels).double()
        bad = ~((v > 0) if low_open else (v >= 0)) | ~(v <= 1)      # NaN fails both
        if bool(bad.any()):
            raise ValueError(f"{rule}, got {float(v[bad][0])}")
        return v
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    v = float(value)
    if not ((v > 0) if low_open else (v >= 0)) or not v <= 1 or math.isnan(v):
        raise ValueError(f"{rule}, got {v!r}")
    return torch.full((labels.numel(),), v, dtype=torch.float64, device=labels.device)


@dataclass(frozen=True)
class Truncation:
    """How the rollout's sampler truncated each token's distribution (vLLM's order: temperature, min_p, top_k,
    top_p; ``logitless.ops.truncation_select``). Each setting is a number for every token, or a tensor
    broadcastable to the labels' shape (per sequence [b, 1] or per token), as vLLM takes them per request.

    top_k: -1 / None (off) or k >= 1: the k most probable ids (ties at the k-th value kept).
    top_p: 1.0 / None (off) or p in (0, 1]: the smallest prefix by probability whose mass reaches p (the most
        probable id always kept).
    min_p: 0.0 / None (off) or m in [0, 1]: the ids with probability >= m times the largest.
    kept_ids: the replay form, exclusive with the three settings: [..., K] int32 / int64, the labels' shape plus
        the kept ids of each token (global ids; -1 pads), as a sampler logged them (vLLM's sampling mask). No
        pass over the vocabulary then: the cost is that of the kept ids.
    """
    top_k: Setting = None
    top_p: Setting = None
    min_p: Setting = None
    kept_ids: Optional[Tensor] = None

    def replay(self) -> bool:
        return self.kept_ids is not None

    def row_settings(self, labels: Tensor) -> RowSettings:
        """Per-token settings [N] (labels flattened), checked: TypeError / ValueError naming the field."""
        n = labels.numel()
        top_k = (torch.full((n,), -1, dtype=torch.int64, device=labels.device) if self.top_k is None
                 else _top_k(self.top_k, labels))
        top_p = (torch.ones(n, dtype=torch.float64, device=labels.device) if self.top_p is None
                 else _fraction(self.top_p, "top_p", labels, low_open=True))
        min_p = (torch.zeros(n, dtype=torch.float64, device=labels.device) if self.min_p is None
                 else _fraction(self.min_p, "min_p", labels, low_open=False))
        return RowSettings(top_k, top_p, min_p)

    def replay_ids(self, labels: Tensor, vocab: int, valid: Tensor) -> Tensor:
        """kept_ids as [N, K] int64 (labels flattened), checked: ids in [0, V) or -1, none repeated within a
        token, at least one per scored token (``valid`` [N])."""
        ids = checks.index_tensor(self.kept_ids, "truncation.kept_ids")
        if ids.device != labels.device:
            raise ValueError(f"truncation.kept_ids is on {ids.device}, labels on {labels.device}")
        if ids.dim() != labels.dim() + 1 or ids.shape[:-1] != labels.shape or ids.shape[-1] < 1:
            raise ValueError(f"truncation.kept_ids must have shape labels.shape + (K,) = {tuple(labels.shape)} + "
                             f"(K,), got {tuple(ids.shape)}")
        ids = ids.reshape(labels.numel(), ids.shape[-1]).long()
        bad = (ids < -1) | (ids >= vocab)
        if bool(bad.any()):
            raise ValueError(f"truncation.kept_ids must lie in [0, V={vocab}) or be -1 (padding), got "
                             f"{int(ids[bad][0])}")
        s, _ = ids.sort(dim=1)
        if bool(((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any()):
            raise ValueError("truncation.kept_ids repeats an id within a token")
        empty = valid & (ids < 0).all(dim=1)
        if bool(empty.any()):
            raise ValueError(f"truncation.kept_ids holds no id for scored token {int(empty.nonzero()[0])} "
                             f"(flattened index): a kept set is never empty")
        return ids

    def describe(self) -> str:
        """The settings in words, for the record (``logitless.record.PathRecord.truncation``): "top_k=50 top_p=0.95"
        (the settings given, "per-token" for a tensor), or "kept_ids" (the replay form)."""
        if self.replay():
            return "kept_ids"
        parts = [f"{name}={'per-token' if isinstance(value, Tensor) else value}"
                 for name, value in (("top_k", self.top_k), ("top_p", self.top_p), ("min_p", self.min_p))
                 if value is not None]
        return " ".join(parts) or "none"

    def check(self) -> "Truncation":
        if self.kept_ids is not None and not (self.top_k is None and self.top_p is None and self.min_p is None):
            raise ValueError("truncation: kept_ids (the replay form) excludes top_k / top_p / min_p")
        if self.kept_ids is not None:
            checks.tensor(self.kept_ids, "truncation.kept_ids")
        return self
