"""A given set of k ids per token in the statistics pass: the ids' logits and the mass outside them, from one GEMM
over the vocabulary, without the logits in memory (the triton backend's ``label_sets.vocab_pass`` with ``given``:
the tail bucket of ``forward_kl_topk_tail`` and ``fused_logprobs_k(with_tail=True)``).

Stage 1 (``_given_kernel``), one program per [BLOCK_M tokens x BLOCK_N vocabulary rows] tile, as the forward
statistics kernel: the float32 logits tile on the tensor cores, tempered (softcapped first), then per row

- the ids that fall among the tile's columns, as the tail's dlogits kernel finds them (``tail_dlogits.py``): each
  row's ids sorted (``label_sets.sorted_distinct``), a binary search for the first and last among the tile's
  columns (``tile.ids_in_tile``), then one step per id there; each such id's logit is stored (an id lies in one
  tile: one store, no race);
- the rest (the columns outside the ids): its max and sum exp(z - that max), relative to its own max (>= 1 once a
  column is there: no underflow), stored per (token, tile).

Stage 2 (``_finish_kernel``, one program per token, tiles read in a fixed order): the rest of every tile as one
(max, sum). Nothing is 1 - sum: a tail of e^-40 stays exact, as in the torch pass it replaces.

Batch invariance (docs/determinism.md): tiles of a fixed shape, token counts not specialised, the finish's order
fixed by the vocabulary size: a token's numbers are the same bits in any batch and chunking. Memory: 8 bytes per
token and tile of a chunk (``chunk_rows``), outputs O(tokens x k).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from ..label_sets import SetPartial, sorted_distinct
from .common import LOG2E, choose_tiles, int32_safe, launch_options, on_device
from .operands import tile_operands
from .tile import ids_in_tile, program_tile, tempered_logits

# bytes of one chunk's per-tile rests (tokens per chunk follow from it)
DEFAULT_BYTES = 128 << 20


@triton.jit
def given_rest(z, rows, cols, row_ok, n_cols, pid_n, ids_ptr, vals_ptr, rest_m_ptr, rest_s_ptr, n_tiles,
               N_IDS: tl.constexpr, ID_STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 1's epilogue on the tempered logits z [M, N] of a tile (also run by the selection kernel's, with
    GIVEN: ``topk_select._candidates_kernel``): store the logit of each of the rows' ids that falls among the
    tile's columns and the max and sum of the tile's other columns. ids / vals [n_rows, N_IDS] (each row's ids
    distinct and ascending, holes last: ``label_sets.sorted_distinct``; vals -inf before the launch), rest_m /
    rest_s [n_rows, n_tiles]."""
    # the rows' ids among the tile's columns, found by a binary search (``tile.ids_in_tile``: sorted ids), then one step
    # for each j-th of them on one [M, N] tile: each id's logit read from the rest before its column is taken out
    # (-inf), as a sum over the one matching column (tl.max would drop a NaN). The steps are as many as the most
    # ids any row has in the tile (a handful at k 2048, where testing every id cost a tile-wide reduction each); a
    # second tile (z kept beside the rest) spilled 3x the registers at 128 x 256 on sm_90
    first = pid_n * BLOCK_N
    id_rows = rows.to(tl.int64) * N_IDS
    rest = tl.where((cols < n_cols)[None, :], z, float("-inf"))
    lo, count, steps = ids_in_tile(ids_ptr, id_rows, row_ok, first, BLOCK_N, N_IDS, ID_STEPS)
    j = 0
    while j < steps:        # a while loop: the interpreter refuses a for loop to a loaded bound
        at = lo + j
        inside = j < count
        col = tl.load(ids_ptr + id_rows + at, mask=inside, other=-1)
        hit = (cols[None, :] == col[:, None]) & inside[:, None]
        tl.store(vals_ptr + id_rows + at, tl.sum(tl.where(hit, rest, 0.0), axis=1), mask=inside)
        rest = tl.where(hit, float("-inf"), rest)
        j += 1
    # its max and its sum relative to it (no column left: -inf and 0); a NaN logit makes the sum NaN (tl.max drops
    # it from the max), which the finish carries to the tail
    m = tl.max(rest, axis=1)
    ref = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp2((rest - ref[:, None]) * LOG2E), axis=1)
    out = rows.to(tl.int64) * n_tiles + pid_n
    tl.store(rest_m_ptr + out, m, mask=row_ok)
    tl.store(rest_s_ptr + out, s, mask=row_ok)


# n_rows not specialised: one build for every token count (docs/determinism.md)
@triton.jit(do_not_specialize=["n_rows"])
def _given_kernel(h_ptr, w_ptr, inv_temp_ptr, ids_ptr, vals_ptr, rest_m_ptr, rest_s_ptr,
                  n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, n_tiles,
                  N_IDS: tl.constexpr, ID_STEPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr,
                  INTERP: tl.constexpr, FLUSH_K: tl.constexpr, SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    """ids [n_rows, N_IDS] int64 (row-major): the ids' rows in this weight, ascending, holes last
    (``given_rest``)."""
    acc, rows, cols, row_ok, inv_t, pid_n = program_tile(
        h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)
    z = tempered_logits(acc, inv_t, SOFTCAP, CAP)   # one rounding, as the label's logit elsewhere
    given_rest(z, rows, cols, row_ok, n_cols, pid_n, ids_ptr, vals_ptr, rest_m_ptr, rest_s_ptr, n_tiles,
               N_IDS, ID_STEPS, BLOCK_N)


# token count and tiles not specialised; the trip count is compile-time (one build per vocabulary size), so a
# token's sums run in one order in every batch
@triton.jit(do_not_specialize=["n_tiles"])
def _finish_kernel(rest_m_ptr, rest_s_ptr, m_ptr, s_ptr, n_tiles, TB: tl.constexpr, T_STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tb = tl.arange(0, TB)
    m = tl.full((), float("-inf"), tl.float32)
    for step in range(T_STEPS):
        idx = step * TB + tb
        m = tl.maximum(m, tl.max(tl.load(rest_m_ptr + row * n_tiles + idx, mask=idx < n_tiles,
                                         other=float("-inf")), axis=0))
    ref = tl.where(m == float("-inf"), 0.0, m)
    s = tl.zeros((), tl.float32)
    for step in range(T_STEPS):
        idx = step * TB + tb
        tm = tl.load(rest_m_ptr + row * n_tiles + idx, mask=idx < n_tiles, other=float("-inf"))
        ts = tl.load(rest_s_ptr + row * n_tiles + idx, mask=idx < n_tiles, other=0.0)
        # a tile with no rest column (m -inf, sum 0) adds 0, never 0 * exp(nan); a NaN tile's sum is NaN and
        # carries through (its NaN max is dropped by tl.max above)
        s += tl.sum(tl.where(ts == 0.0, 0.0, ts * tl.exp2((tm - ref) * LOG2E)), axis=0)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)


def chunk_rows(vocab: int, dtype: torch.dtype, device) -> int:
    """Tokens of one chunk so that its per-tile rests fit LOGITLESS_GIVEN_SET_BYTES (a multiple of the token
    tile)."""
    tiles = choose_tiles("FWD", dtype, torch.device(device))
    per_token = 8 * triton.cdiv(vocab, tiles.block_n)
    rows = knobs.given_set_bytes(DEFAULT_BYTES) // per_token
    return max(tiles.block_m, rows // tiles.block_m * tiles.block_m)


class GivenBuffers(NamedTuple):
    """One chunk's outputs of stage 1: vals [c, k] float32 (-inf until a tile writes an id's logit; in the order of
    the kernel ids, ``label_sets.sorted_distinct``'s, which the callers map back), rest_m and rest_s [c, tiles]
    float32."""
    vals: Tensor
    rest_m: Tensor
    rest_s: Tensor

    @staticmethod
    def empty(n: int, k: int, n_tiles: int, device) -> "GivenBuffers":
        f32 = dict(dtype=torch.float32, device=device)
        return GivenBuffers(torch.full((n, k), float("-inf"), **f32), torch.empty((n, n_tiles), **f32),
                            torch.empty((n, n_tiles), **f32))

    def finish(self, local: Tensor) -> SetPartial:
        """Stage 2: the chunk's partial (m, rest of the columns outside the ids; vals and ids ``local`` in the kernel
        ids' order: the callers gather them back, ``label_sets.sorted_distinct``)."""
        n, n_tiles = self.rest_m.shape
        f32 = dict(dtype=torch.float32, device=self.vals.device)
        m, s = torch.empty(n, **f32), torch.empty(n, **f32)
        if n:
            tb = min(1024, triton.next_power_of_2(n_tiles))
            _finish_kernel[(n,)](self.rest_m, self.rest_s, m, s, n_tiles, TB=tb, T_STEPS=triton.cdiv(n_tiles, tb),
                                 num_warps=4)
        return SetPartial(m, s, self.vals, local)


def _pass(hidden: Tensor, weight: Tensor, inv_temp: Tensor, local: Tensor, softcap: Optional[float]
          ) -> SetPartial:
    n, h = hidden.shape
    vocab = weight.shape[0]
    tiles = choose_tiles("FWD", hidden.dtype, hidden.device)
    hidden, weight = int32_safe(hidden, tiles.block_k), int32_safe(weight, tiles.block_k)
    n_tiles = triton.cdiv(vocab, tiles.block_n)
    out = GivenBuffers.empty(n, local.shape[1], n_tiles, hidden.device)
    h_op, w_op, use_tma = tile_operands(hidden, weight, tiles)
    _given_kernel[(triton.cdiv(n, tiles.block_m) * n_tiles,)](
        h_op, w_op, inv_temp, local, out.vals, out.rest_m, out.rest_s, n, vocab, h,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), n_tiles,
        N_IDS=local.shape[1], ID_STEPS=local.shape[1].bit_length(), USE_TMA=use_tma,
        **launch_options(tiles, hidden, softcap))
    return out.finish(local)


def given_set(hidden: Tensor, weight: Tensor, inv_temp: Tensor, local: Tensor, ids: Tensor,
              softcap: Optional[float] = None, rows: Optional[Tensor] = None) -> SetPartial:
    """``label_sets.vocab_pass(given=ids, given_local=local)``'s partial by the kernels: (m, rest) of the columns
    outside the ids, the ids' logits (-inf where local is -1: another rank holds the id) and ids [n, k] (global).
    hidden [N, H] (or its rows ``rows`` [n], gathered a chunk at a time), weight [V, H], inv_temp [n], local [n, k]
    int64 (the ids' rows in this weight, -1 elsewhere). In token chunks of ``chunk_rows``; no host read."""
    n = local.shape[0]
    kernel_ids, back, _ = sorted_distinct(local)
    step = chunk_rows(weight.shape[0], hidden.dtype, hidden.device)
    parts = []
    with on_device(hidden):
        for start in range(0, n, step):
            stop = min(n, start + step)
            h = hidden[start:stop] if rows is None else hidden.index_select(0, rows[start:stop])
            parts.append(_pass(h, weight, inv_temp[start:stop].contiguous(), kernel_ids[start:stop], softcap))
    if len(parts) == 1:
        m, s, vals, _ = parts[0]
    elif parts:
        m, s, vals = (torch.cat([getattr(p, f) for p in parts]) for f in ("m", "rest", "vals"))
    else:
        f32 = dict(dtype=torch.float32, device=hidden.device)
        m, s, vals = torch.empty(0, **f32), torch.empty(0, **f32), torch.empty(local.shape, **f32)
    return SetPartial(m, s, vals.gather(1, back), ids)
