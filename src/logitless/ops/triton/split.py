"""The float32 -> bfloat16 split of the split precisions (bf16x3 / bf16x6), written straight into the
concatenated operand in one pass: read each float32 element once, write each bfloat16 block of K.

``ops.precision.split_concat_reference`` defines the split (``split_parts``: each part is what the earlier
parts leave, rounded to nearest-even bfloat16); this kernel computes the same numbers bit for bit (tested
under the interpreter and on CUDA) without the torch path's passes over the operand (to, float, sub, to,
cat: ~40 bytes moved per element instead of 4 + 2 per block).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, on_device

# a [BLOCK_R, BLOCK_C] tile per program; small in the interpreter so that tests reach the masked edges
BLOCK_R = 4 if INTERPRETING else 8
BLOCK_C = 32 if INTERPRETING else 512


@triton.jit
def _round_bf16(x):
    """(x rounded to nearest-even bfloat16, the same value as float32), on the bits: the same numbers compiled and
    in the interpreter (whose float32 -> bfloat16 cast truncates), as torch's conversion (nan: a quiet nan)."""
    bits = x.to(tl.uint32, bitcast=True)
    top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    top = tl.where(x != x, 0x7FC0, top)
    return top.to(tl.uint16).to(tl.bfloat16, bitcast=True), (top << 16).to(tl.float32, bitcast=True)


@triton.jit
def _split_kernel(x_ptr, out_ptr, rows, cols, width, stride_r, stride_c, out_stride,
                  BLOCKS: tl.constexpr, CODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # CODE: the part each block of K holds, two bits per block, block 0 lowest; a block is ``width`` columns, those
    # past ``cols`` zeros
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    x = tl.load(x_ptr + r[:, None] * stride_r + c[None, :].to(tl.int64) * stride_c,
                mask=(r[:, None] < rows) & (c[None, :] < cols), other=0.0)
    ok = (r[:, None] < rows) & (c[None, :] < width)
    p0, f0 = _round_bf16(x)
    rest = x - f0
    p1, f1 = _round_bf16(rest)
    p2, _ = _round_bf16(rest - f1)
    dst = out_ptr + r[:, None] * out_stride + c[None, :]
    # the part of block b is read inline: a name annotated tl.constexpr cannot be bound again in the next unrolled
    # iteration (the compiler refuses it; the interpreter does not)
    for b in tl.static_range(BLOCKS):
        if ((CODE >> (2 * b)) & 3) == 0:
            tl.store(dst + b * width, p0, mask=ok)
        elif ((CODE >> (2 * b)) & 3) == 1:
            tl.store(dst + b * width, p1, mask=ok)
        else:
            tl.store(dst + b * width, p2, mask=ok)


def split_concat(x: Tensor, blocks: tuple, width: int = 0) -> Tensor:
    """[rows, len(blocks) * W] bfloat16 whose block b of columns is part ``blocks[b]`` (0, 1 or 2) of the split
    of x [rows, H] (float32, any strides), as ``ops.precision.split_concat_reference``. W: ``width`` (>= H; 0: H),
    each block's columns past H zeros (the in-kernel split aligns its blocks to its K tiles)."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"split_concat needs a 2-d float32 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    if not blocks or len(blocks) > 16 or any(p not in (0, 1, 2) for p in blocks):
        raise ValueError(f"blocks must be 1 to 16 part indices in (0, 1, 2), got {blocks}")
    rows, cols = x.shape
    width = width or cols
    if width < cols:
        raise ValueError(f"width must be at least x's {cols} columns, got {width}")
    out = torch.empty((rows, len(blocks) * width), dtype=torch.bfloat16, device=x.device)
    if out.numel() == 0:
        return out
    code = sum(p << (2 * b) for b, p in enumerate(blocks))
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(width, BLOCK_C))
    with on_device(x):
        _split_kernel[grid](x, out, rows, cols, width, x.stride(0), x.stride(1), out.stride(0),
                            BLOCKS=len(blocks), CODE=code, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4)
    return out
