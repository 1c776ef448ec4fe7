"""Whether a float32 operand holds bfloat16 values only (``ops.precision.bf16_exact_all`` on CUDA): one read of
the operand, the low 16 bits of every element's pattern OR-ed per program into a small buffer, reduced by torch on
the device. No host read, no temporary of the operand's size (a torch expression would make a [V, H] int32 one:
2.3 GiB for a 151936 x 4096 head)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, on_device

# a [BLOCK_R, BLOCK_C] tile per program; small in the interpreter so that tests reach the masked edges
BLOCK_R = 4 if INTERPRETING else 16
BLOCK_C = 32 if INTERPRETING else 256


@triton.jit
def _low_bits_kernel(x_ptr, out_ptr, rows, cols, stride_r, stride_c,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_r + c[None, :].to(tl.int64) * stride_c, mask=ok, other=0.0)
    low = x.to(tl.int32, bitcast=True) & 0xFFFF
    tl.store(out_ptr + tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1), tl.max(tl.max(low, 1), 0))


def bf16_exact_all(x: Tensor) -> Tensor:
    """0-d bool on x's device: every element of x (float32 [R, C], any strides) is a bfloat16 value."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"bf16_exact_all needs a 2-d float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    rows, cols = x.shape
    if x.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(cols, BLOCK_C))
    low = torch.empty(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    with on_device(x):
        _low_bits_kernel[grid](x, low, rows, cols, x.stride(0), x.stride(1), BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C,
                               num_warps=4)
    return low.amax() == 0
