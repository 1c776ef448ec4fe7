"""Every logit at or above a per-token threshold, from one GEMM over the vocabulary, without the logits in memory:
what a wide kept set (a top-p nucleus of thousands of ids, a low min-p) needs once a token's threshold is known.

One program per [BLOCK_M tokens x BLOCK_N vocabulary rows] tile, as the selection's candidates kernel
(``topk_select``): the float32 logits tile on the tensor cores, tempered (softcapped first) exactly as there, so a
logit has the same bits in both passes; then per row the columns with z >= tau[row] are appended to the row's slots:
one atomic add per row and tile reserves a run of slots (the count of the tile's matches), a prefix sum over the
tile's columns places each match in it. A row's matches beyond its ``cap`` slots are counted, not written (the
count is exact: the caller asks again with that many slots). The order of a row's slots depends on the tiles'
schedule; the caller sorts them by (value descending, id ascending), so the result is a function of the row alone.

Outputs: values float32 [n, cap] and ids int32 [n, cap] (slots past a row's count untouched), count int32 [n].
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from .common import Tiles, int32_safe, launch_options, on_device
from .operands import tile_operands
from .tile import program_tile, tempered_logits
from .topk_select import tiles_for

# slot offsets below this are int32 in the kernel (tests lower it to run the int64 ones)
INT32_OFFSETS_BELOW = 2 ** 31


# token count and slots not specialised: one build per vocabulary size, hidden size and dtype
@triton.jit(do_not_specialize=["n_rows", "cap"])
def _above_kernel(h_ptr, w_ptr, inv_temp_ptr, tau_ptr, vals_ptr, ids_ptr, count_ptr,
                  n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, cap,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                  GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  USE_TMA: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr,
                  SOFTCAP: tl.constexpr, CAP: tl.constexpr, WIDE_OFFSETS: tl.constexpr):
    acc, rows, cols, row_ok, inv_t, pid_n = program_tile(
        h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)
    tau = tl.load(tau_ptr + rows, mask=row_ok, other=float("inf"))
    z = tempered_logits(acc, inv_t, SOFTCAP, CAP)   # as the candidates kernel forms it (the same bits)
    hit = row_ok[:, None] & (cols < n_cols)[None, :] & (z >= tau[:, None])
    hits = hit.to(tl.int32)
    count = tl.sum(hits, axis=1)
    # one atomic a row reserves the tile's run of slots; rows without a match add 0 (no atomic needed, but a
    # masked atomic keeps the launch simple)
    base = tl.atomic_add(count_ptr + rows, count, mask=row_ok & (count > 0))
    slot = base[:, None] + tl.cumsum(hits, axis=1) - 1
    keep = hit & (slot < cap)
    # the slots' offsets in int32 where every one fits, the last tile's padded rows too (the wide round's blocks:
    # rows x slots <= 2^24): half the registers of an int64 tile of them (ptxas on sm_90 at 128 x 256: spills of
    # 4.3 KB a thread -> 3.3 KB)
    if WIDE_OFFSETS:
        out = rows.to(tl.int64)[:, None] * cap + slot
    else:
        out = rows[:, None] * cap + slot
    tl.store(vals_ptr + out, z, mask=keep)
    tl.store(ids_ptr + out, cols[None, :] + tl.zeros_like(hits), mask=keep)


class Above(NamedTuple):
    """values float32 [n, cap], ids int32 [n, cap] (a row's first count[row] slots, in no order), count int32
    [n] (every match, also those past cap)."""
    values: Tensor
    ids: Tensor
    count: Tensor


def above(hidden: Tensor, weight: Tensor, inv_temp: Tensor, tau: Tensor, cap: int,
          softcap: Optional[float] = None) -> Above:
    """The tempered logits z >= tau [n] of hidden [n, H] over weight [V, H] (inv_temp [n] float32), at most
    ``cap`` a row written; the candidates kernel's tiles and operands (``topk_select.tiles_for``), or
    LOGITLESS_TRITON_ABOVE's (benchmarking: ptxas spills 4.3 KB a thread in this epilogue at the forward's
    128 x 256 tiles on sm_90, 0.4 KB at 128 x 128; which runs faster is a GPU measurement)."""
    n, h = hidden.shape
    vocab = weight.shape[0]
    dev = hidden.device
    values = torch.empty((n, cap), dtype=torch.float32, device=dev)
    ids = torch.empty((n, cap), dtype=torch.int32, device=dev)
    count = torch.zeros(n, dtype=torch.int32, device=dev)
    if n == 0 or cap == 0:
        return Above(values, ids, count)
    env = knobs.triton_tiles("ABOVE")
    tiles = Tiles(*env) if env is not None else tiles_for(hidden.dtype, dev)
    hidden, weight = int32_safe(hidden, tiles.block_k), int32_safe(weight, tiles.block_k)
    h_op, w_op, use_tma = tile_operands(hidden, weight, tiles)
    grid = (triton.cdiv(n, tiles.block_m) * triton.cdiv(vocab, tiles.block_n),)
    with on_device(hidden):
        _above_kernel[grid](h_op, w_op, inv_temp.contiguous(), tau.contiguous(), values, ids, count, n, vocab, h,
                            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), cap,
                            USE_TMA=use_tma, WIDE_OFFSETS=(n + tiles.block_m) * cap >= INT32_OFFSETS_BELOW,
                            **launch_options(tiles, hidden, softcap))
    return Above(values, ids, count)

