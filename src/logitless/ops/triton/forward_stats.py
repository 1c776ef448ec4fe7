"""Forward: per-token lse, entropy and the label's logit, streaming the vocabulary in tiles.

One program per [BLOCK_M tokens x BLOCK_N vocab rows] tile: it computes the float32 logits tile on
the tensor cores, scales it by 1/temperature, and reduces it to three numbers per token (tile max m,
sum exp(z - m), sum exp(z - m) * (z - m)) written to a [vocab tiles, N] float32 workspace; the label's
logit is written by the one tile that holds it. Logits never reach HBM. A combine over the tiles then
gives the global statistics. With a softcap c the tile is first mapped to t = tanh(raw / c) and scaled
by c / temperature instead of 1 / temperature (a compile-time branch: without it the kernel is unchanged).

On Hopper (half precision, no softcap) the policy loss's Gluon statistics kernel computes the same per-tile
statistics bit for bit, its epilogues overlapped with the next tile's main loop (``policy_stats_gluon``, without
its e store; LOGITLESS_TRITON_FWD_KERNEL=triton keeps the kernel below).

Batch invariance: a token's statistics depend on its own row only. Every kernel here reduces a row inside one
tile whose shape is fixed (never a function of N), and the token count is not specialised at compile time, so a
call of 1 token and one of a million run the same build (docs/determinism.md).

Workspace: 4 bytes x (3, or 2 without entropy) x ceil(V / BLOCK_N) per token. ``token_rows`` caps the
tokens of one call so that it stays under LOGITLESS_TRITON_STATS_BYTES (64 MiB by default: 9344 tokens at
V = 151936, a whole 8192-token batch at V = 131072); ``ops/token_chunks.py`` feeds larger inputs in chunks.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from .combine import combine_tiles
from .common import INTERPRETING, choose_tiles, int32_safe, launch_options
from .operands import tile_operands
from .tile import program_tile, softcap_tanh, store_label_logit, store_row_stats, tempered_tile_stats

# On Hopper the policy loss's Gluon statistics kernel (ping-pong consumers: one tile's epilogue runs during the
# next tile's main loop) computes the same numbers bit for bit, without its e store; the Triton kernel below is
# the path elsewhere, with a softcap, and in the interpreter (which does not run Gluon).
gluon_stats = None
if not INTERPRETING:
    try:
        from . import policy_stats_gluon as gluon_stats
    except (ImportError, AttributeError):  # pragma: no cover - depends on the installed triton
        gluon_stats = None

# The per-tile statistics of one call: 64 MiB, whatever N is.
DEFAULT_STATS_BYTES = 64 << 20


# n_rows (the tokens of the call) is not specialised, so every batch runs the same build (docs/determinism.md)
@triton.jit(do_not_specialize=["n_rows"])
def _tile_stats_kernel(h_ptr, w_ptr, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr,
                       n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
                       WITH_ENTROPY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
                       SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr,
                       SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    acc, rows, cols, row_ok, inv_t, pid_n = program_tile(
        h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)
    if SOFTCAP:
        # z = tanh(raw / CAP) * (CAP / T): below, acc holds t and inv_t the per-row factor CAP / T
        # (> 0, so the max argument that follows holds unchanged)
        acc, _ = softcap_tanh(acc, CAP)
        inv_t = inv_t * CAP
    # padded columns of the last vocabulary tile carry no probability mass (e = 0 there)
    m, e, d2 = tempered_tile_stats(acc, cols, n_cols, inv_t, pid_n, BLOCK_N)
    store_row_stats(part_m_ptr, part_s_ptr, part_t_ptr, m, e, d2, rows, row_ok, n_rows, pid_n, WITH_ENTROPY)
    store_label_logit(labels_ptr, zy_ptr, acc, inv_t, rows, cols, row_ok, pid_n, n_cols, BLOCK_N)


def tile_stats(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, with_entropy: bool,
               softcap: Optional[float] = None):
    """Per-tile partial statistics. Returns (part_m, part_s, part_t or None, zy); part_* are float32
    [ceil(V / BLOCK_N), N], zy float32 [N] (0.0 where the label is -1). softcap: None or c > 0 (the cap
    is a compile-time constant: one build per distinct value, a model has one)."""
    n, k = hidden.shape
    vocab = weight.shape[0]
    tiles = choose_tiles("FWD", hidden.dtype, hidden.device)
    hidden, weight = int32_safe(hidden, tiles.block_k), int32_safe(weight, tiles.block_k)
    n_tiles = triton.cdiv(vocab, tiles.block_n)
    dev = hidden.device
    part_m = torch.empty((n_tiles, n), dtype=torch.float32, device=dev)
    part_s = torch.empty_like(part_m)
    part_t = torch.empty_like(part_m) if with_entropy else part_m   # unused pointer when False
    zy = torch.empty(n, dtype=torch.float32, device=dev)      # the kernel writes every row
    if _gluon_usable(hidden, weight, softcap, tiles.block_n):
        gluon_stats.chunk_stats_gluon(hidden, weight, labels, inv_temp, part_m, part_s,
                                      part_t if with_entropy else None, zy, None, tiles.block_n)
        return part_m, part_s, part_t if with_entropy else None, zy
    grid = (triton.cdiv(n, tiles.block_m) * n_tiles,)
    h_op, w_op, use_tma = tile_operands(hidden, weight, tiles)
    _tile_stats_kernel[grid](
        h_op, w_op, labels, inv_temp, part_m, part_s, part_t, zy,
        n, vocab, k, hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        WITH_ENTROPY=with_entropy, USE_TMA=use_tma, **launch_options(tiles, hidden, softcap))
    return part_m, part_s, part_t if with_entropy else None, zy


def _gluon_usable(hidden: Tensor, weight: Tensor, softcap, block_n: int) -> bool:
    """The Gluon kernel where it runs (``usable_operands``), unless a softcap (which it does not apply), tiles
    set by LOGITLESS_TRITON_FWD (they tune the Triton kernel) or LOGITLESS_TRITON_FWD_KERNEL=triton say otherwise."""
    kernel = knobs.forward_stats_kernel()     # read everywhere: a bad value is an error on every machine
    if gluon_stats is None or softcap is not None or knobs.triton_tiles("FWD") is not None:
        return False
    return kernel == "auto" and gluon_stats.usable_operands(hidden, weight, block_n)


def token_rows(hidden: Tensor, weight: Tensor, with_entropy: bool) -> int:
    """Most tokens one ``stats`` call takes so that its workspace fits LOGITLESS_TRITON_STATS_BYTES: a
    multiple of the token tile (at least one tile)."""
    block_m, block_n = _tile_shape(hidden)
    n_tiles = triton.cdiv(weight.shape[0], block_n)
    per_token = 4 * (3 if with_entropy else 2) * n_tiles
    rows = knobs.triton_stats_bytes(DEFAULT_STATS_BYTES) // per_token
    return max(block_m, rows // block_m * block_m)


def _tile_shape(hidden: Tensor) -> tuple[int, int]:
    tiles = choose_tiles("FWD", hidden.dtype, hidden.device)
    return tiles.block_m, tiles.block_n


def stats(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, with_entropy: bool,
          softcap: Optional[float] = None):
    """(lse, entropy or None, zy) float32 [N] of one token chunk (workspace 4 x 3 x n_tiles bytes per
    token: callers keep N <= token_rows)."""
    part_m, part_s, part_t, zy = tile_stats(hidden, weight, labels, inv_temp, with_entropy, softcap)
    lse, ent = combine_tiles(part_m, part_s, part_t)
    return lse, ent, zy
