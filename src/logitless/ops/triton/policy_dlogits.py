"""Policy loss, stage 3: turn the chunk's e = exp(z - tile max) into dlogits, in place.

Elementwise over the chunk's [c, V] workspace, once the global lse, entropy and the loss gradients of its
tokens are known. With m the tile max of the element's vocabulary tile (stage 1's part_m), p = e * exp(m - lse)
and x = log p = log e + m - lse, the formula of ``ops/policy.py`` becomes, per element,

    dlogits = inv_t * (g_lp * (onehot - p) - g_ent * p * (x + ent))
            = e * (a + b * log2 e) + [label] g_lp * inv_t,
    with per (token, tile) a = -inv_t * exp(m - lse) * (g_lp + g_ent * (m - lse + ent)) and
    b = -inv_t * exp(m - lse) * g_ent * ln 2.

One read of e (float16 or float32) and one write of dlogits (the inputs' dtype, same element size, same
memory) per element: this pass is memory-bound. e = 0 (underflowed) gives 0, never 0 * -inf.
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, LN2, LOG2E, tl_dtype

# rows x (TILES statistics tiles) per program, and warps. H200 sweep on one 4096-token chunk at V = 151936
# (benchmarks/LAB-LOG.md, 2026-12-03, fourth entry): 4 rows x 4 tiles of 256 columns, 4 warps 0.80 ms (3.1 TB/s);
# 8 x 4 tiles 0.84, 8 x 1 tile (the former default) 0.97, 32 x 1 tile with 8 warps 0.92. One [rows, tiles, columns]
# block a program (a single load and store instead of a loop over the tiles; 2026-12-03, fifth entry): 0.82-0.91
# over seven shapes, against 0.82-0.99 for this loop in the same sweep as the card's clock drifted: no gain, removed
ROWS_PER_PROGRAM = 16 if INTERPRETING else 4
TILES_PER_PROGRAM = 2 if INTERPRETING else 4
WARPS = 4


@triton.jit
def _policy_dlogits_kernel(e_ptr, dl_ptr, part_m_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, inv_temp_ptr,
                           labels_ptr, n_rows, n_cols, s_en, s_dn,
                           WITH_ENTROPY: tl.constexpr, OUT_DTYPE: tl.constexpr,
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
    for j in range(TILES):
        tile = tl.program_id(1) * TILES + j      # = the statistics tile: BLOCK_N is its width
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        m = tl.load(part_m_ptr + tile.to(tl.int64) * n_rows + rows, mask=row_ok & (tile < n_tiles), other=0.0)
        e = tl.load(e_ptr + rows64[:, None] * s_en + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        shift = m - lse                                  # <= 0: log of the tile's share of the mass
        scale = -inv_t * tl.exp2(shift * LOG2E)         # -inv_t * exp(m - lse)
        if WITH_ENTROPY:
            a = scale * (g_lp + g_ent * (shift + ent))
            b = scale * g_ent * LN2
            # log2 of an underflowed e would be -inf and 0 * -inf NaN: floor e at 1e-30 inside the log (an e
            # that small contributes at most 1e-30 * |b| * 100 either way)
            dl = e * (a[:, None] + b[:, None] * tl.log2(tl.maximum(e, 1e-30)))
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
        BLOCK_M=ROWS_PER_PROGRAM, BLOCK_N=tile_cols, TILES=TILES_PER_PROGRAM, num_warps=WARPS)
    return dl
