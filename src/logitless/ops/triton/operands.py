"""What the tile kernels read (``tile.logits_tile``): tensor descriptors or pointers of hidden and the weight, and
under a split precision hidden's bfloat16 parts in place of hidden."""
from __future__ import annotations

from typing import Optional

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ... import knobs
from ..maths import split_code
from . import common
from .common import INTERPRETING, Tiles, tma_layout_ok
from .split import split_concat


def split_operands(hidden: torch.Tensor, split: int, block_k: int) -> torch.Tensor:
    """hidden's bfloat16 parts for the kernels that split float32 operands (``tile._split_tile``, SPLIT = ``split``):
    [N, P * KP] contiguous, hi | lo (P = 2 for SPLIT 3 and 4, whose products take hidden's low part), or hi alone,
    each part KP = H rounded up to ``block_k`` columns, zeros past H (a part's K tiles start at 16-byte aligned
    columns, as the bulk copy engine needs, and a ragged last one reads zeros). N x P x KP bfloat16 (256 MiB at
    N 16384, H 4096, P 2): the weight, V rows, is split in the kernels' registers."""
    width = -(-hidden.shape[1] // block_k) * block_k
    return split_concat(hidden, (0, 1) if split >= 3 else (0,), width)


def kernel_hidden(hidden: torch.Tensor, tiles: Tiles) -> torch.Tensor:
    """What the tile kernels read for ``hidden``: under ``maths.split_in_kernel`` float32 hidden's parts
    (``split_operands``), else hidden itself. Made once where several launches read it (the backward's vocabulary
    chunks) and passed to ``tile_operands`` as ``parts``."""
    split = split_code() if hidden.dtype == torch.float32 else 0
    return split_operands(hidden, split, tiles.block_k) if split else hidden


def tile_operands(hidden: torch.Tensor, weight: torch.Tensor, tiles: Tiles, parts: Optional[torch.Tensor] = None):
    """(hidden operand, weight operand, USE_TMA) for logits_tile: tensor descriptors on Hopper or newer
    (and in the interpreter) where the layout allows and LOGITLESS_TRITON_TMA is not "0", else the
    tensors themselves (pointer loads). Hidden is first replaced by what the kernels read of it (``kernel_hidden``;
    ``parts``: that, made by the caller)."""
    hidden = kernel_hidden(hidden, tiles) if parts is None else parts
    engine = INTERPRETING or common.hopper_or_newer(hidden.device)      # (looked up here: tests patch it)
    if knobs.triton_tma() and engine and tma_layout_ok(hidden) and tma_layout_ok(weight):
        h = TensorDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [tiles.block_m, tiles.block_k])
        w = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [tiles.block_n, tiles.block_k])
        return h, w, True
    return hidden, weight, False
