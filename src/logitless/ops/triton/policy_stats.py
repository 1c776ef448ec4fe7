"""Policy loss, stage 1: one GEMM pass over the vocabulary for a chunk of tokens, whose epilogue writes
the per-(token, vocab tile) statistics, the label's logit and the tile e = exp(z - tile max).

Each program computes a float32 [BLOCK_M x BLOCK_N] logits tile on the tensor cores (``logits_tile``) and
writes: m (the tile's max tempered logit), s = sum e and t = sum e * (z - m) into [vocab tiles, c] float32
workspaces (the same layout as ``forward_stats``, so ``combine_tiles`` gives lse and entropy), the label's
logit from the tile that holds it, and, with STORE_E, e itself into the chunk's [c, V] workspace (float16
for half-precision inputs: e lies in (0, 1], where float16 has 8 times bfloat16's precision; float32 for
float32 inputs). The logits never reach HBM; e is all the gradient stage needs (p = e * exp(m - lse)).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from .common import INTERPRETING, choose_tiles, launch_options, tl_dtype
from .operands import tile_operands
from .tile import logits_tile, store_label_logit, store_row_stats, tempered_tile_stats, tile_coords

# On Hopper the same outputs come from a hand-scheduled Gluon kernel (policy_stats_gluon: 1.02-1.15x cuBLAS
# against this kernel's 1.18-1.31x on the H200, one 4096-token chunk). Gluon is experimental in triton: where
# it does not import (a triton without it, or the interpreter, which does not run it) this kernel is the only
# path.
gluon_stats = None
if not INTERPRETING:
    try:
        from . import policy_stats_gluon as gluon_stats
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
        gluon_stats = None


@triton.jit
def _stats_epilogue(acc, rows, cols, pid_n, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr,
                    e_ptr, n_rows, n_cols, s_en, STORE_E: tl.constexpr, E_DTYPE: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    row_ok = rows < n_rows
    inv_t = tl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
    m, e, d2 = tempered_tile_stats(acc, cols, n_cols, inv_t, pid_n, BLOCK_N)
    store_row_stats(part_m_ptr, part_s_ptr, part_t_ptr, m, e, d2, rows, row_ok, n_rows, pid_n, True)
    store_label_logit(labels_ptr, zy_ptr, acc, inv_t, rows, cols, row_ok, pid_n, n_cols, BLOCK_N)
    if STORE_E:
        # bulk-copy (TMA) stores of e (whole or half tiles) measured no gain on the H200 (benchmarks/DESIGN.md)
        ptrs = e_ptr + rows.to(tl.int64)[:, None] * s_en + cols[None, :]
        tl.store(ptrs, e.to(E_DTYPE), mask=row_ok[:, None] & (cols < n_cols)[None, :])


@triton.jit
def _stats_tile(tile_id, h_ptr, w_ptr, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr, e_ptr,
                n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, s_en,
                STORE_E: tl.constexpr, E_DTYPE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                K_TILES: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
                SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr):
    pid_m, pid_n = tile_coords(tile_id, n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    acc, rows, cols = logits_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, pid_m, pid_n,
                                  BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT,
                                  INTERP, FLUSH_K)
    _stats_epilogue(acc, rows, cols, pid_n, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr,
                    zy_ptr, e_ptr, n_rows, n_cols, s_en, STORE_E, E_DTYPE, BLOCK_N)


# n_rows (the chunk's tokens) is not specialised, so every batch runs the same build (docs/determinism.md)
@triton.jit(do_not_specialize=["n_rows"])
def _policy_stats_kernel(h_ptr, w_ptr, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr, e_ptr,
                         n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, s_en,
                         STORE_E: tl.constexpr, E_DTYPE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         K_TILES: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
                         SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr,
                         SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    # one program per tile. SOFTCAP / CAP come with launch_options; the policy loss refuses a softcap before
    # any launch.
    _stats_tile(tl.program_id(0), h_ptr, w_ptr, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr,
                zy_ptr, e_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, s_en, STORE_E, E_DTYPE,
                BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)


def chunk_stats(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, part_m: Tensor, part_s: Tensor,
                part_t: Tensor, zy: Tensor, e: Tensor | None) -> None:
    """Fill the statistics of the tokens ``hidden`` [c, H] over ``weight`` [V, H]: part_m / part_s / part_t
    float32 [ceil(V / BLOCK_N), c], zy float32 [c] (0 for rows whose label is -1; every row written),
    and, when ``e`` is given ([c, V] view with unit column stride, float16 or float32), e = exp(z - m).
    On Hopper with half-precision operands and e float16, the Gluon kernel (``policy_stats_gluon``) writes
    them, bit for bit the same; LOGITLESS_POLICY_STATS_KERNEL=triton keeps this kernel there too."""
    n, k = hidden.shape
    vocab = weight.shape[0]
    tiles = choose_tiles("POLICY", hidden.dtype, hidden.device)
    kernel = knobs.policy_stats_kernel()      # read everywhere: a bad value is an error on every machine
    if gluon_stats is not None and kernel == "auto" and gluon_stats.usable(hidden, weight, e, tiles.block_n):
        gluon_stats.chunk_stats_gluon(hidden, weight, labels, inv_temp, part_m, part_s, part_t, zy, e,
                                        tiles.block_n)
        return
    n_tiles = triton.cdiv(n, tiles.block_m) * triton.cdiv(vocab, tiles.block_n)
    h_op, w_op, use_tma = tile_operands(hidden, weight, tiles)
    store = e is not None
    _policy_stats_kernel[(n_tiles,)](
        h_op, w_op, labels, inv_temp, part_m, part_s, part_t, zy, e if store else part_m,
        n, vocab, k, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        e.stride(0) if store else 0,
        STORE_E=store, E_DTYPE=tl_dtype(e.dtype) if store else tl.float32, USE_TMA=use_tma,
        **launch_options(tiles, hidden, None))
