"""The dlogits of an op with a tail output (``ops/tail_backward.py``'s closed form) for one vocabulary chunk: the
backward's kernel stage for k ids per token and the mass outside them; ``backward.grads`` runs it in place of the
plain dlogits kernel and forms the two gradient products from its output as for any other dlogits.

Each tile recomputes its logits from the statistics operands (as ``backward._dlogits_kernel``) and writes
    dl_ij = inv_t_i * sum over k with id_ik = j of c_ik                       at the row's ids
    dl_ij = inv_t_i * (g_tail_i exp(z_ij - lse_tail_i) - G_i p_ij)            elsewhere
(times 1 - tanh^2 with a softcap), c_ik = g_ik - G_i exp(lp_ik) from ``tail_backward.terms``, each row's ids
distinct and ascending (``tail_backward.unique_ids``: a repeated id's c summed into one entry). A tile finds its
rows' ids among its columns by a binary search over them (``tile.ids_in_tile``), then takes one step per id there:
as many steps as the most any row has in the tile (a handful at k 2048, where testing every id of every row cost
a tile-wide reduction each). At the ids the terms of the columns outside are replaced, never subtracted:
exp(z_j - lse_tail) there can exceed float32 (a tiny tail), and cancelling it is what the closed form avoids. One
[M, N] tile is live through the ids' loop (two with a softcap: its derivative's), so that the 128 x 256 tiles do
not spill registers on sm_90 (they did, 5.3 KB a thread, with a tile for the ids' terms and one for their
membership beside it).
"""
from __future__ import annotations

from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from ..tail_backward import TailTerms
from .common import LOG2E, choose_tiles, launch_options, tl_dtype
from .operands import tile_operands
from .tile import ids_in_tile, program_tile, softcap_tanh


@triton.jit
def _tail_dlogits_kernel(h_ptr, w_ptr, ids_ptr, at_ids_ptr, inv_temp_ptr, lse_ptr, lse_tail_ptr, g_all_ptr,
                         g_tail_ptr, dl_ptr, n_rows, n_cols, n_k, col0, s_hn, s_hk, s_wv, s_wk, s_dn,
                         N_IDS: tl.constexpr, ID_STEPS: tl.constexpr, TAIL_GRAD: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         USE_TMA: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr,
                         OUT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    """The module's dl for the chunk of vocabulary rows starting at col0 (w_ptr points at that chunk). ids
    [n_rows, N_IDS] int64 (row-major): the ids' rows in the whole weight, distinct and ascending within a row,
    holes (``label_sets.ID_HOLE``) last; at_ids alike, float32: each id's dz c_k; g_all = G; TAIL_GRAD False:
    g_tail is 0 (no exponential of the tail term). A masked pointer store."""
    acc, rows, cols, row_ok, inv_t, pid_n = program_tile(
        h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_all = tl.load(g_all_ptr + rows, mask=row_ok, other=0.0)
    z_scale = inv_t            # z = acc * z_scale
    if SOFTCAP:
        acc, dcap = softcap_tanh(acc, CAP)     # acc now holds t = tanh(raw / CAP); dcap = 1 - t^2
        z_scale = inv_t * CAP
    z = acc * z_scale[:, None]
    # outside the ids: -G p, in natural units first (z - lse, then base 2: near a large logit, as at a tiny tail's
    # ids, z log2(e) - lse log2(e) would round each term at that size)
    dz = tl.exp2((z - lse[:, None]) * LOG2E) * (-g_all)[:, None]
    if TAIL_GRAD:
        lse_tail = tl.load(lse_tail_ptr + rows, mask=row_ok, other=0.0)
        g_tail = tl.load(g_tail_ptr + rows, mask=row_ok, other=0.0)
        # exp(z - lse_tail) <= 1 outside the ids (lse_tail = +inf, no column outside them: exp2(-inf) = 0; the
        # clamp only absorbs rounding there); at the ids it would exceed float32 at a tiny tail and is not taken
        # (a select below, never a subtraction)
        dz += tl.exp2(tl.minimum(z - lse_tail[:, None], 0.0) * LOG2E) * g_tail[:, None]
    # at the ids: their c_k in place of the terms above (the ids distinct: one replacement a column), the rows'
    # ids among the tile's columns found by a binary search (sorted ids, ``tile.ids_in_tile``), then one step for
    # each j-th of them (as ``given_set.given_rest``)
    first = col0 + pid_n * BLOCK_N
    id_rows = rows.to(tl.int64) * N_IDS
    lo, count, steps = ids_in_tile(ids_ptr, id_rows, row_ok, first, BLOCK_N, N_IDS, ID_STEPS)
    j = 0
    while j < steps:        # a while loop: the interpreter refuses a for loop to a loaded bound
        at = lo + j
        inside = j < count
        col = tl.load(ids_ptr + id_rows + at, mask=inside, other=-1) - col0
        c_j = tl.load(at_ids_ptr + id_rows + at, mask=inside, other=0.0)
        dz = tl.where((cols[None, :] == col[:, None]) & inside[:, None], c_j[:, None], dz)
        j += 1
    dl = dz * inv_t[:, None]
    if SOFTCAP:
        dl = dl * dcap     # chain rule through the cap: d z / d raw = inv_t * (1 - t^2)
    ptrs = dl_ptr + rows.to(tl.int64)[:, None] * s_dn + cols[None, :]
    tl.store(ptrs, dl.to(OUT_DTYPE), mask=row_ok[:, None] & (cols < n_cols)[None, :])


def dlogits_chunk(hidden: Tensor, w_chunk: Tensor, col0: int, tail: TailTerms, inv_temp: Tensor, lse: Tensor,
                  g_all: Tensor, out: Tensor, softcap=None, parts: Optional[Tensor] = None) -> Tensor:
    """Fill ``out`` [N, C] (unit column stride) with the dlogits of vocabulary rows col0 .. col0 + C of the tail's
    closed form, where w_chunk = weight[col0 : col0 + C] and g_all [N] is G (d raw logits with a softcap). parts:
    ``operands.kernel_hidden(hidden)``, made once for all chunks (None: made here)."""
    n, k = hidden.shape
    cols = w_chunk.shape[0]
    tiles = choose_tiles("BWD", hidden.dtype, hidden.device)
    grid = (triton.cdiv(n, tiles.block_m) * triton.cdiv(cols, tiles.block_n),)
    h_op, w_op, use_tma = tile_operands(hidden, w_chunk, tiles, parts)
    tail_grad = tail.g_tail is not None
    _tail_dlogits_kernel[grid](
        h_op, w_op, tail.ids, tail.at_ids, inv_temp, lse, tail.lse_tail, g_all,
        tail.g_tail if tail_grad else g_all, out,
        n, cols, k, col0, hidden.stride(0), hidden.stride(1), w_chunk.stride(0), w_chunk.stride(1), out.stride(0),
        N_IDS=tail.ids.shape[1], ID_STEPS=tail.ids.shape[1].bit_length(), TAIL_GRAD=tail_grad, USE_TMA=use_tma,
        OUT_DTYPE=tl_dtype(out.dtype),
        **launch_options(tiles, hidden, softcap))
    return out
