"""Policy loss, stage 3: turn the chunk's e = exp(z - tile max) into dlogits, in place.

Elementwise over the chunk's [c, V] workspace, once the global lse, entropy and the loss gradients of its
tokens are known. With m the tile max of the element's vocabulary tile (stage 1's part_m), p = e * exp(m - lse)
and x = log p = log e + m - lse, the formula of ``ops/policy.py`` becomes, per element,

    dlogits = inv_t * (g_lp * (onehot - p) - g_ent * p * (x + ent))
            = e * (a + b * log2 e) + [label] g_lp * inv_t,
    with per (token, tile) a = -inv_t * exp(m - lse) * (g_lp + g_ent * (m - lse + ent)) and
    b = -inv_t * exp(m - lse) * g_ent * ln 2.

One read of e (float16 or float32) and one write of dlogits (the inputs' dtype, same element size, same
memory) per element. e = 0 (underflowed) gives 0, never 0 * -inf.

Speed (H200, one 4096-token chunk, benchmarks/gpu_dlogits.py): a plain copy of the same bytes runs at 4.2 TB/s.
With tl.log2 (a polynomial: a dozen FMAs an element) this pass ran at 1.43-1.45x the copy's time: bound by its
instructions, not by the memory. The multiprocessor's lg2.approx (one special-function op) brings it to
1.23-1.25x, and loading the next tile before storing this one to 1.18-1.21x.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, LN2, LOG2E, tl_dtype

# rows x (TILES statistics tiles) per program, and warps. H200 sweeps on one 4096-token chunk (benchmarks/DESIGN.md):
# 4 rows x 4 tiles of 256 columns with 4 warps against 8 x 4, 8 x 1, 32 x 1 (8 warps), one [rows, tiles, columns]
# block, 1-16 rows, 8 tiles, programs along the columns first, and the label term without its block-wide test: none
# faster.
ROWS_PER_PROGRAM = 16 if INTERPRETING else 4
TILES_PER_PROGRAM = 2 if INTERPRETING else 4
WARPS = 4
# PTX lg2.approx on NVIDIA GPUs: absolute error about 2^-22 on log2 e, far below e's own float16 rounding (2^-11
# relative, 7e-4 on log2 e). The interpreter has no inline assembly: tl.log2 there.
FAST_LOG2 = not INTERPRETING


@triton.jit
def _log2(x, FAST: tl.constexpr):
    """log2 of float32 x > 0: one lg2.approx where FAST, else tl.log2."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _load_e(e_ptr, tile, rows64, row_ok, n_cols, s_en, BLOCK_N: tl.constexpr, pred):
    """The e of statistics tile ``tile`` for the program's rows (0 where masked or where ``pred`` is false)."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    # "!= 0": triton 3.9's interpreter makes the & of an int1 tensor with a scalar (a Python bool, a 0-d compare) an
    # int32 array, which tl.load refuses as a mask ("mask has unsupported dtype"; .to(tl.int1) keeps it int32);
    # compiled, and under 3.6, it is the same int1
    ok = (row_ok[:, None] & (cols < n_cols)[None, :] & pred) != 0
    return tl.load(e_ptr + rows64[:, None] * s_en + cols[None, :], mask=ok, other=0.0)


@triton.jit
def _policy_dlogits_kernel(e_ptr, dl_ptr, part_m_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, inv_temp_ptr,
                           labels_ptr, n_rows, n_cols, s_en, s_dn,
                           WITH_ENTROPY: tl.constexpr, OUT_DTYPE: tl.constexpr, FAST_LOG2_: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    # the per-row factors, once for all of the program's tiles
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    inv_t = tl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
    label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
    n_tiles = tl.cdiv(n_cols, BLOCK_N)
    first_tile = tl.program_id(1) * TILES
    # each tile's e is loaded before the previous tile's dlogits are stored: two loads in flight (different
    # columns, so in place is safe)
    e_next = _load_e(e_ptr, first_tile, rows64, row_ok, n_cols, s_en, BLOCK_N, True)
    for j in range(TILES):
        tile = first_tile + j      # = the statistics tile: BLOCK_N is its width
        e = e_next.to(tl.float32)
        e_next = _load_e(e_ptr, tile + 1, rows64, row_ok, n_cols, s_en, BLOCK_N, j + 1 < TILES)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        m_ok = (row_ok & (tile < n_tiles)) != 0    # a bool mask under triton 3.9's interpreter too (see _load_e)
        m = tl.load(part_m_ptr + tile.to(tl.int64) * n_rows + rows, mask=m_ok, other=0.0)
        shift = m - lse                                  # <= 0: log of the tile's share of the mass
        scale = -inv_t * tl.exp2(shift * LOG2E)         # -inv_t * exp(m - lse)
        if WITH_ENTROPY:
            a = scale * (g_lp + g_ent * (shift + ent))
            b = scale * g_ent * LN2
            # log2 of an underflowed e would be -inf and 0 * -inf NaN: floor e at 1e-30 inside the log (an e
            # that small contributes at most 1e-30 * |b| * 100 either way)
            dl = e * (a[:, None] + b[:, None] * _log2(tl.maximum(e, 1e-30), FAST_LOG2_))
        else:
            dl = e * (scale * g_lp)[:, None]
        first = tile * BLOCK_N
        here = row_ok & (label >= first) & (label < first + BLOCK_N)
        if tl.max(here.to(tl.int32), axis=0) > 0:
            dl += tl.where(cols[None, :] == label[:, None], (g_lp * inv_t)[:, None], 0.0)
        tl.store(dl_ptr + rows64[:, None] * s_dn + cols[None, :], dl.to(OUT_DTYPE), mask=ok)


def dlogits_in_place(e: Tensor, dl: Tensor, part_m: Tensor, lse: Tensor, ent: Tensor, g_lp: Tensor,
                     g_ent: Optional[Tensor], inv_temp: Tensor, labels: Tensor, tile_cols: int) -> Tensor:
    """Write the dlogits of the chunk into ``dl`` ([c, V], the inputs' dtype), reading e ([c, V], float16
    or float32; ``dl`` may be the same memory viewed in another dtype of the same size). part_m: float32
    [ceil(V / tile_cols), c] from stage 1, whose statistics tiles are ``tile_cols`` wide. Returns dl."""
    n, vocab = e.shape
    grid = (triton.cdiv(n, ROWS_PER_PROGRAM), triton.cdiv(triton.cdiv(vocab, tile_cols), TILES_PER_PROGRAM))
    with_entropy = g_ent is not None
    _policy_dlogits_kernel[grid](
        e, dl, part_m, lse, ent, g_lp, g_ent if with_entropy else g_lp, inv_temp, labels, n, vocab,
        e.stride(0), dl.stride(0), WITH_ENTROPY=with_entropy, OUT_DTYPE=tl_dtype(dl.dtype),
        FAST_LOG2_=FAST_LOG2 and dl.is_cuda and torch.version.hip is None,
        BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=tile_cols, TILES=TILES_PER_PROGRAM, num_warps=WARPS)
    return dl
