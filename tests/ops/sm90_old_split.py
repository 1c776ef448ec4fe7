"""The split kernel as it was before it was fixed: a name annotated ``tl.constexpr`` bound in every iteration of a
``tl.static_range`` loop. Triton's interpreter runs it (and gets the right numbers); triton's compiler refuses it
("constexpr cannot be reassigned"): on an H100 every bf16x3 / bf16x6 product failed while the interpreter's tests
passed. ``sm90_launches --drive sm90_old_split`` must report its build as failed, or the check proves nothing."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from logitless.ops.precision import split_concat_reference
from logitless.ops.triton.split import _round_bf16


@triton.jit
def _old_split_kernel(x_ptr, out_ptr, rows, cols, stride_r, stride_c, out_stride,
                      BLOCKS: tl.constexpr, CODE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(x_ptr + r[:, None] * stride_r + c[None, :].to(tl.int64) * stride_c, mask=ok, other=0.0)
    p0, f0 = _round_bf16(x)
    rest = x - f0
    p1, f1 = _round_bf16(rest)
    p2, _ = _round_bf16(rest - f1)
    dst = out_ptr + r[:, None] * out_stride + c[None, :]
    for b in tl.static_range(BLOCKS):
        which: tl.constexpr = (CODE >> (2 * b)) & 3
        if which == 0:
            tl.store(dst + b * cols, p0, mask=ok)
        elif which == 1:
            tl.store(dst + b * cols, p1, mask=ok)
        else:
            tl.store(dst + b * cols, p2, mask=ok)


def drive(case, record_only):
    """One launch as bf16x3's weight operand (blocks 0, 1, 2), checked against the split's definition."""
    case[0] = "old split kernel"
    x = torch.randn(37, 96, generator=torch.Generator().manual_seed(0))
    blocks = (0, 1, 2)
    out = torch.empty((37, 3 * 96), dtype=torch.bfloat16)
    code = sum(p << (2 * b) for b, p in enumerate(blocks))
    _old_split_kernel[(triton.cdiv(37, 8), triton.cdiv(96, 512))](
        x, out, 37, 96, x.stride(0), x.stride(1), out.stride(0), BLOCKS=3, CODE=code, BLOCK_R=8, BLOCK_C=512)
    # the interpreter accepts it, with the right numbers
    assert torch.equal(out, split_concat_reference(x, blocks)), "the interpreter's run of the old kernel differs"
