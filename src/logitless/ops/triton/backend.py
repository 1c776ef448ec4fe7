"""The Triton backend, behind the contract of ``logitless.ops.contract``.

Runs on CUDA tensors; on CPU tensors only when TRITON_INTERPRET=1 was set before triton was imported
(the real kernels then run in triton's interpreter: that is how CI tests them).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from . import backward, forward_stats
from .common import INTERPRETING, on_device

name = "triton"


def unavailable_reason(hidden: Tensor, weight: Tensor) -> Optional[str]:
    if hidden.is_cuda and weight.is_cuda:
        return None
    if hidden.device.type == "cpu" and weight.device.type == "cpu":
        if INTERPRETING:
            return None
        return ("CPU tensors need triton's interpreter: set TRITON_INTERPRET=1 before triton is imported, "
                "or use backend='chunked'")
    return f"triton needs CUDA tensors, got {hidden.device.type} and {weight.device.type}"


def stats(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, with_entropy: bool,
          softcap: Optional[float] = None):
    """(lse, entropy or None, zy), float32 [N]; see logitless.ops.contract."""
    with on_device(hidden):
        return forward_stats.stats(hidden, weight, labels, inv_temp, with_entropy, softcap)


def grads(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, lse: Tensor, ent: Optional[Tensor],
          g_lp: Tensor, g_ent: Optional[Tensor], need_dh: bool, need_dw: bool, softcap: Optional[float] = None,
          dw_acc: Optional[Tensor] = None, grad_operands=None, tail=None):
    """(d_hidden float32 [N, H] or None, d_weight [V, H] or None); see logitless.ops.contract (``tail``: this
    backend's closed form of an op with a tail output)."""
    return backward.grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw, softcap,
                          dw_acc, grad_operands, tail)     # on hidden's GPU (backward.grads)


def token_rows(stage: str, hidden: Tensor, weight: Tensor, with_entropy: bool) -> int:
    """Most tokens per call: the forward's statistics workspace (LOGITLESS_TRITON_STATS_BYTES) or the
    backward's LOGITLESS_TRITON_BWD_TOKENS (16384) bounds it."""
    if stage == "forward":
        return forward_stats.token_rows(hidden, weight, with_entropy)
    return backward.token_rows(hidden)


