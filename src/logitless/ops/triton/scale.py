"""Scale a gradient buffer in place by the upstream gradient of a 0-d loss, read on the device.

The fused policy loss forms its gradients in the forward; its backward only multiplies them by the
upstream gradient g (1 for a plain ``loss.backward()``). Reading g on the host would synchronise with
the GPU at the end of every backward (the host then idles the GPU while it launches whatever comes
next); this kernel reads g itself, and when g == 1 each program returns after that one load.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, on_device

BLOCK = 256 if INTERPRETING else 4096
# blocks per program, unrolled (a compile-time trip count: see tile.py): 64 Ki elements per program keeps
# the grid of a 1.2 GiB gradient under 10 thousand programs, which is what the no-op case costs
UNROLL = 2 if INTERPRETING else 16


@triton.jit
def _scale_kernel(x_ptr, g_ptr, n, BLOCK: tl.constexpr, UNROLL: tl.constexpr):
    g = tl.load(g_ptr).to(tl.float32)
    if g != 1.0:
        base = tl.program_id(0).to(tl.int64) * (BLOCK * UNROLL)
        for i in tl.static_range(UNROLL):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            ok = offs < n
            x = tl.load(x_ptr + offs, mask=ok)
            tl.store(x_ptr + offs, (x.to(tl.float32) * g).to(x.dtype), mask=ok)


def scale_in_place(x: Tensor, g: Tensor) -> Tensor:
    """x *= g in place, computed in float32 and rounded to x's dtype (as ``x.mul_(g)``). x: contiguous
    float tensor; g: one-element float tensor on x's device. Returns x."""
    if not x.is_contiguous():
        raise ValueError("scale_in_place needs a contiguous tensor")
    if g.numel() != 1 or g.device != x.device:
        raise ValueError(f"g must be a one-element tensor on {x.device}, got shape {tuple(g.shape)} on {g.device}")
    n = x.numel()
    if n:
        with on_device(x):
            _scale_kernel[(triton.cdiv(n, BLOCK * UNROLL),)](x, g, n, BLOCK=BLOCK, UNROLL=UNROLL, num_warps=4)
    return x
