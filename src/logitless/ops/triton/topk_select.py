"""Top-k selection in the statistics pass: the k largest logits per token, their ids, lse and the mass outside them,
from one GEMM over the vocabulary, without the logits in memory.

Stage 1 (``_candidates_kernel``), one program per [BLOCK_M tokens x BLOCK_N vocabulary rows] tile, as the forward
statistics kernel: the float32 logits tile on the tensor cores, tempered (softcapped first), then per row

- the tile's C largest logits ("candidates", C a small compile-time constant), written as int64 *keys*: the
  logit's float32 bits mapped to an order-preserving signed integer in the high word, 2^31 - 1 - id in the low
  word. Keys are distinct and their order is the selection's order: larger value first, equal values to the lower
  id. C float32 rounds of (row max, the lowest column holding it, that column taken out): three passes over the
  float32 tile each, the keys formed for the [BLOCK_M, C] winners only (an int64 tile of keys doubled the
  registers of the logits and spilled; 64-bit compares are two 32-bit ones);
- the rest of the tile (its columns that are not candidates): the largest key (the "residual bound") and
  sum exp(z - that max), relative to its own max (>= 1 once a column is there, no underflow).

With STATS (``select_with_stats``: the one-pass top-k distillation, ``losses/distill_topk_function.py``) the same
program also writes the fused policy pass's statistics of its tile (``policy_stats``' m, s, t and e), so the
selection and the pass's statistics share one GEMM.

Stage 2: ``torch.topk`` of the keys of the row's T x C candidates (a selection: no arithmetic, and keys are
distinct, so the result is unique whatever the batch) gives the row's top k. Stage 3 (``_finish_kernel``, one
program per token, tiles read in a fixed order): lse, and the tail = the rest of every tile plus the candidates
left out, summed as positive terms relative to their own max (never 1 - sum: a tail of e^-40 stays exact).

Exactness: the union of the candidates holds the row's true top k iff no tile's rest holds a key above the k-th
selected key: the finish kernel checks k-th key > every residual bound (exact, ties included, since keys carry the
id). A row that fails (a tile holding more than C of its top k: rare on real distributions) is recomputed by the
same kernels with C >= k (exact by construction: a tile's rest then lies below k of its own keys); no row is ever
answered from an incomplete candidate set.

Batch invariance (docs/determinism.md): tiles of a fixed shape, token counts not specialised, the selection exact,
the finish's order fixed by the vocabulary size: a token's ids, log-probs and tail are the same bits in any batch
and chunking. Memory: candidates 8 C T + residuals 8 T bytes per token of a chunk (``chunk_rows``), outputs
O(tokens x k).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from ..label_sets import SetPartial, sorted_distinct
from .common import LOG2E, Tiles, choose_tiles, int32_safe, launch_options, on_device, tl_dtype
from .given_set import GivenBuffers, given_rest
from .operands import tile_operands
from .tile import program_tile, store_row_stats, tempered_logits, tempered_tile_stats

# k of the fast path (larger k takes the torch pass): the finish kernel holds a row's k keys in registers (2048
# int64 over 128 threads: 16 each). C = CANDIDATES a tile up to k ~ 600 at V 151936; a larger k raises C so that
# a tile's expected share of the k stays at most a quarter of its candidates (``first_candidates``): a top-p
# nucleus of ~2000 ids is selected by these kernels, not by the torch pass
MAX_K = 2048
CANDIDATES = 4
# C >= SHARE x (k / full tiles): the share of a tile that overflows C (and sends its row to a redo round) small
SHARE = 4
# candidates a tile from which the kernel stores each round's keys as it finds them (no [BLOCK_M, C] tile of them;
# the given set's epilogue keeps the tile: it puts the candidates back)
EACH_FROM = 16
# the key of no column (padding, a column already taken): the key of -inf with the largest id; every real logit's
# key lies above it. ord(-inf) = 0xFF800000 ^ 0x7FFFFFFF = -2139095041 as int32, in the high word.
NO_KEY = -2139095041 * (1 << 32)
# bytes of one chunk's candidates and residuals (tokens per chunk follow from it)
DEFAULT_BYTES = 128 << 20


@triton.jit
def _round(zf, cols, BIG: tl.constexpr):
    """(row max [M], the lowest of its columns [M] int32, BIG where the row is all -inf) of float32 zf [M, N]."""
    top = tl.max(zf, axis=1)
    at = tl.min(tl.where(zf == top[:, None], cols[None, :], BIG), axis=1)
    return top, at


@triton.jit
def _row_key(top, at, NO_KEY_: tl.constexpr):
    """The int64 key of float32 value top [M] at column at [M]: order(top) in the high word (the float32 bits
    mapped to an order-preserving signed integer), 2^31 - 1 - id in the low one; -0.0 is taken as +0.0 (they
    compare equal as floats: the lower id must win); NO_KEY where top is -inf (no column left)."""
    bits = top.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (order.to(tl.int64) << 32) | (2147483647 - at.to(tl.int64))
    return tl.where(top == float("-inf"), NO_KEY_, key)


@triton.jit
def _values(keys):
    """float32 values of int64 keys (the inverse of the high word of ``_row_key``)."""
    hi = (keys >> 32).to(tl.int32)
    return tl.where(hi < 0, hi ^ 0x7FFFFFFF, hi).to(tl.float32, bitcast=True)


# n_rows not specialised: one build for every token count (docs/determinism.md)
@triton.jit(do_not_specialize=["n_rows"])
def _candidates_kernel(h_ptr, w_ptr, inv_temp_ptr, cand_ptr, rest_key_ptr, rest_sum_ptr,
                       part_m_ptr, part_s_ptr, part_t_ptr, e_ptr, ids_ptr, vals_ptr, given_m_ptr, given_s_ptr,
                       n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, n_tiles, s_en,
                       C: tl.constexpr, NO_KEY_: tl.constexpr, BIG: tl.constexpr,
                       STATS: tl.constexpr, STORE_E: tl.constexpr, E_DTYPE: tl.constexpr,
                       GIVEN: tl.constexpr, N_IDS: tl.constexpr, ID_STEPS: tl.constexpr, EACH: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                       USE_TMA: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr,
                       SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    acc, rows, cols, row_ok, inv_t, pid_n = program_tile(
        h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)
    if STATS:
        # the fused policy pass's statistics of this tile from the same products (``policy_stats``' epilogue:
        # per-tile m, s, t in the [vocab tiles, rows] layout ``combine_tiles`` reads, and, with STORE_E,
        # e = exp(z - m) into the pass's workspace for ``dlogits_in_place``); never with a softcap (the host refuses)
        m, e, d2 = tempered_tile_stats(acc, cols, n_cols, inv_t, pid_n, BLOCK_N)
        store_row_stats(part_m_ptr, part_s_ptr, part_t_ptr, m, e, d2, rows, row_ok, n_rows, pid_n, True)
        if STORE_E:
            e_ptrs = e_ptr + rows.to(tl.int64)[:, None] * s_en + cols[None, :]
            tl.store(e_ptrs, e.to(E_DTYPE), mask=row_ok[:, None] & (cols < n_cols)[None, :])
    z = tempered_logits(acc, inv_t, SOFTCAP, CAP)   # one rounding, as the label's logit elsewhere
    # float32 rounds, not int64 keys: a [BLOCK_M, BLOCK_N] int64 tile is twice the registers of the logits (it
    # spilled on Hopper) and every 64-bit max / compare is two 32-bit ones. Each round: the row max (float32), the
    # lowest column holding it (an int32 min over the columns equal to it: ties to the lower id, as the keys
    # order them), that one column taken out (-inf). Keys are formed for the [BLOCK_M, C] winners only.
    zf = tl.where((cols < n_cols)[None, :], z, float("-inf"))
    slot = tl.arange(0, C)
    r64 = rows.to(tl.int64)
    if EACH:
        # many candidates (a redo round, a large k): each round's keys stored as they are found, no [BLOCK_M, C]
        # int64 tile (at C 64 it spilled 11.7 KB of registers a thread at 128 x 256 on sm_90)
        for i in range(C):
            top, at = _round(zf, cols, BIG)
            tl.store(cand_ptr + r64 * (n_tiles * C) + pid_n * C + i, _row_key(top, at, NO_KEY_), mask=row_ok)
            zf = tl.where(cols[None, :] == at[:, None], float("-inf"), zf)
    else:
        cand = tl.full((BLOCK_M, C), NO_KEY_, tl.int64)
        for i in tl.static_range(C):
            top, at = _round(zf, cols, BIG)
            cand = tl.where(slot[None, :] == i, _row_key(top, at, NO_KEY_)[:, None], cand)
            zf = tl.where(cols[None, :] == at[:, None], float("-inf"), zf)
        tl.store(cand_ptr + r64[:, None] * (n_tiles * C) + pid_n * C + slot[None, :], cand, mask=row_ok[:, None])
    # the rest: its largest key (the residual bound) and its sum relative to its own max (taken columns: 0)
    rest_max, rest_at = _round(zf, cols, BIG)
    rest_key = _row_key(rest_max, rest_at, NO_KEY_)
    ref = tl.where(rest_max == float("-inf"), 0.0, rest_max)
    ref = tl.where(ref == 0.0, 0.0, ref)     # -0.0 as +0.0, as its key says (the same sums either way)
    rest_sum = tl.sum(tl.exp2((zf - ref[:, None]) * LOG2E), axis=1)
    tl.store(rest_key_ptr + r64 * n_tiles + pid_n, rest_key, mask=row_ok)
    tl.store(rest_sum_ptr + r64 * n_tiles + pid_n, rest_sum, mask=row_ok)
    if GIVEN:
        # a given set's logits and the mass outside it from the same products (``given_set``: the tail bucket
        # beside the student's own top k). The tile is z again once the C candidates taken out are put back (their
        # keys hold each value's float32 bits and its column; an empty slot's column matches none): one [M, N] tile
        # live throughout, where keeping z beside zf spilled registers at 128 x 256 on sm_90
        for i in tl.static_range(C):
            key = tl.sum(tl.where(slot[None, :] == i, cand, 0), axis=1)
            col = 2147483647 - (key & 0xFFFFFFFF)
            zf = tl.where(cols[None, :].to(tl.int64) == col[:, None], _values(key)[:, None], zf)
        given_rest(zf, rows, cols, row_ok, n_cols, pid_n, ids_ptr, vals_ptr, given_m_ptr, given_s_ptr, n_tiles,
                   N_IDS, ID_STEPS, BLOCK_N)


# token count, tiles and candidates per row not specialised; the trip counts are compile-time (one build per
# vocabulary size and k), so a token's sums run in one order in every batch
@triton.jit(do_not_specialize=["n", "n_tiles", "n_cand"])
def _finish_kernel(cand_ptr, sel_ptr, rest_key_ptr, rest_sum_ptr, lse_ptr, m_ptr, s_ptr, ok_ptr,
                   n, n_tiles, n_cand, K: tl.constexpr, KP: tl.constexpr, NO_KEY_: tl.constexpr,
                   CB: tl.constexpr, C_STEPS: tl.constexpr, TB: tl.constexpr, T_STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kk = tl.arange(0, KP)
    sel = tl.load(sel_ptr + row * K + kk, mask=kk < K, other=NO_KEY_)
    kth = tl.load(sel_ptr + row * K + (K - 1))
    sel_v = _values(sel)
    top_v = tl.max(sel_v, axis=0)          # the row's largest logit (finite: k <= the real columns)
    cb = tl.arange(0, CB)
    tb = tl.arange(0, TB)
    # pass 1: the largest logit of the tail (left-out candidates, every tile's rest) and the largest residual
    m = tl.full((), float("-inf"), tl.float32)
    worst = tl.full((), NO_KEY_, tl.int64)
    for step in range(C_STEPS):
        idx = step * CB + cb
        key = tl.load(cand_ptr + row * n_cand + idx, mask=idx < n_cand, other=NO_KEY_)
        m = tl.maximum(m, tl.max(tl.where(key < kth, _values(key), float("-inf")), axis=0))
    for step in range(T_STEPS):
        idx = step * TB + tb
        rk = tl.load(rest_key_ptr + row * n_tiles + idx, mask=idx < n_tiles, other=NO_KEY_)
        worst = tl.maximum(worst, tl.max(rk, axis=0))
        m = tl.maximum(m, tl.max(_values(rk), axis=0))
    ref = tl.where(m == float("-inf"), 0.0, m)
    # pass 2: the tail's sum relative to m (every term <= 1, >= 1 in all when m is finite)
    s = tl.zeros((), tl.float32)
    for step in range(C_STEPS):
        idx = step * CB + cb
        key = tl.load(cand_ptr + row * n_cand + idx, mask=idx < n_cand, other=NO_KEY_)
        left = (key < kth) & (key != NO_KEY_)
        s += tl.sum(tl.exp2(tl.where(left, (_values(key) - ref) * LOG2E, float("-inf"))), axis=0)
    for step in range(T_STEPS):
        idx = step * TB + tb
        rk = tl.load(rest_key_ptr + row * n_tiles + idx, mask=idx < n_tiles, other=NO_KEY_)
        rs = tl.load(rest_sum_ptr + row * n_tiles + idx, mask=idx < n_tiles, other=0.0)
        w = tl.where(rk == NO_KEY_, 0.0, tl.exp2((_values(rk) - ref) * LOG2E))
        s += tl.sum(rs * w, axis=0)
    # lse = top + log(sum over the k of e^(v - top) + e^(lse_tail - top)), from positive terms only
    head = tl.sum(tl.where(kk < K, tl.exp2((sel_v - top_v) * LOG2E), 0.0), axis=0)
    tail_w = tl.where(s > 0, s * tl.exp2((ref - top_v) * LOG2E), 0.0)
    lse = top_v + tl.log(head + tail_w)
    tl.store(lse_ptr + row, lse)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(ok_ptr + row, (kth > worst).to(tl.int8))


class Selection(NamedTuple):
    """The top k of one token chunk over this weight's rows: vals float32 [n, k] (descending, ties to the lower id),
    ids int64 [n, k] (rows of this weight), lse [n], and the tail (the columns outside the k) as m [n] (its largest
    logit, -inf for none) and s [n] (sum exp(z - m) over it, 0 for none); ``fallback`` rows recomputed with C >= k."""
    vals: Tensor
    ids: Tensor
    lse: Tensor
    m: Tensor
    s: Tensor
    fallback: int


def tiles_for(dtype: torch.dtype, device) -> Tiles:
    """The candidate kernel's tiles: LOGITLESS_TRITON_TOPK (six integers, benchmarking), else the forward's."""
    env = knobs.triton_tiles("TOPK")
    return Tiles(*env) if env is not None else choose_tiles("FWD", dtype, torch.device(device))


def candidates(k: int) -> int:
    """C of the first pass for a top k (LOGITLESS_TOPK_CANDIDATES: a power of two, benchmarking)."""
    c = knobs.topk_candidates(CANDIDATES)
    if c & (c - 1):
        raise ValueError(f"LOGITLESS_TOPK_CANDIDATES={c} must be a power of two")
    return c


def first_candidates(k: int, vocab: int, tiles: Tiles) -> int:
    """C of the first pass: ``candidates(k)``, raised to the power of two whose candidates, the ragged last tile's
    aside, hold at least k (a small vocabulary) and, for a large k, at least SHARE x k (``MAX_K``), at most the
    tile's width."""
    c = min(candidates(k), tiles.block_n)
    full = max(1, triton.cdiv(vocab, tiles.block_n) - 1)
    need = k if k <= 128 else SHARE * k
    while c < tiles.block_n and full * c < need:
        c *= 2
    return c


def fast_path_ok(k: int, vocab: int, dtype: torch.dtype, device) -> bool:
    """Whether the kernels select this k over ``vocab`` columns: 1 <= k <= MAX_K, some column left outside the k
    (k < vocab), and the full tiles' candidates (``first_candidates``) at least k."""
    tiles = tiles_for(dtype, device)
    n_tiles = triton.cdiv(vocab, tiles.block_n)
    return 1 <= k <= MAX_K and k < vocab and (n_tiles - 1) * first_candidates(k, vocab, tiles) >= k


def shares_given(k: int, vocab: int, dtype: torch.dtype, device) -> bool:
    """Whether a selection of k may run the given set's epilogue in its first pass (``select_with_given``): at most
    EACH_FROM candidates a tile, since the epilogue puts them back from a [BLOCK_M, C] int64 tile (beyond that it
    spills, as the rounds' own tile did; a small vocabulary with a large k reaches C 128). Otherwise the given set
    takes its own GEMM (``given_set``)."""
    return first_candidates(k, vocab, tiles_for(dtype, device)) <= EACH_FROM


def chunk_rows(vocab: int, k: int, dtype: torch.dtype, device, c: Optional[int] = None, given_k: int = 0) -> int:
    """Tokens of one chunk so that its candidates (``c`` a tile, default the first pass's) and residuals, and the
    buffers of a given set of ``given_k`` ids (``select_with_given``), fit LOGITLESS_TOPK_BYTES (a multiple of the
    token tile)."""
    tiles = tiles_for(dtype, device)
    n_tiles = triton.cdiv(vocab, tiles.block_n)
    c = first_candidates(k, vocab, tiles) if c is None else c
    per_token = 8 * n_tiles * c + 12 * n_tiles + ((8 * n_tiles + 4 * given_k) if given_k else 0)
    rows = knobs.topk_bytes(DEFAULT_BYTES) // per_token
    return max(tiles.block_m, rows // tiles.block_m * tiles.block_m)


class PassStats(NamedTuple):
    """Where the candidates kernel also writes the fused policy pass's statistics of a chunk (``policy_stats``'
    outputs): part_m / part_s / part_t float32 [vocab tiles, n] and e ([n, V] view with unit column stride, float16
    or float32; None: not stored)."""
    part_m: Tensor
    part_s: Tensor
    part_t: Tensor
    e: Optional[Tensor]


def _first_pass(hidden: Tensor, weight: Tensor, inv_temp: Tensor, c: int, softcap: Optional[float], tiles: Tiles,
                stats: Optional[PassStats] = None, given: Optional[tuple[Tensor, GivenBuffers]] = None):
    """The candidates kernel over one chunk -> (cand, rest_key, rest_sum); with ``stats`` it also writes the policy
    pass's statistics, with ``given`` (local ids [c, k], the buffers) a given set's logits and per-tile rests."""
    n, h = hidden.shape
    vocab = weight.shape[0]
    hidden, weight = int32_safe(hidden, tiles.block_k), int32_safe(weight, tiles.block_k)
    n_tiles = triton.cdiv(vocab, tiles.block_n)
    dev = hidden.device
    cand = torch.empty((n, n_tiles * c), dtype=torch.int64, device=dev)
    rest_key = torch.empty((n, n_tiles), dtype=torch.int64, device=dev)
    rest_sum = torch.empty((n, n_tiles), dtype=torch.float32, device=dev)
    h_op, w_op, use_tma = tile_operands(hidden, weight, tiles)
    grid = (triton.cdiv(n, tiles.block_m) * n_tiles,)
    if stats is not None and softcap is not None:
        raise ValueError("the candidates kernel writes the policy pass's statistics without a softcap only")
    store_e = stats is not None and stats.e is not None
    # without stats, the float32 outputs stand in for the unused pointers (never written)
    sm, ss, st = (rest_sum, rest_sum, rest_sum) if stats is None else stats[:3]
    ids, vals, gm, gs = (rest_key, rest_sum, rest_sum, rest_sum) if given is None else (given[0], *given[1])
    _candidates_kernel[grid](h_op, w_op, inv_temp, cand, rest_key, rest_sum, sm, ss, st,
                             stats.e if store_e else rest_sum, ids, vals, gm, gs, n, vocab, h,
                             hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), n_tiles,
                             stats.e.stride(0) if store_e else 0,
                             C=c, NO_KEY_=NO_KEY, BIG=2147483647, STATS=stats is not None, STORE_E=store_e,
                             GIVEN=given is not None, N_IDS=1 if given is None else given[0].shape[1],
                             ID_STEPS=1 if given is None else given[0].shape[1].bit_length(),
                             EACH=c > EACH_FROM and given is None,
                             E_DTYPE=tl_dtype(stats.e.dtype) if store_e else tl.float32, USE_TMA=use_tma,
                             **launch_options(tiles, hidden, softcap))
    return cand, rest_key, rest_sum


def _finish(cand: Tensor, rest_key: Tensor, rest_sum: Tensor, k: int):
    """(vals, ids, lse, m, s, ok) of the rows of one first pass."""
    n, n_cand = cand.shape
    n_tiles = rest_key.shape[1]
    dev = cand.device
    sel = cand.topk(k, dim=1).values.contiguous()        # distinct keys: the one top k, sorted descending
    f32 = dict(dtype=torch.float32, device=dev)
    lse, m, s = torch.empty(n, **f32), torch.empty(n, **f32), torch.empty(n, **f32)
    ok = torch.empty(n, dtype=torch.int8, device=dev)
    if n:
        cb = min(1024, triton.next_power_of_2(n_cand))
        tb = min(1024, triton.next_power_of_2(n_tiles))
        _finish_kernel[(n,)](cand, sel, rest_key, rest_sum, lse, m, s, ok, n, n_tiles, n_cand, K=k,
                             KP=triton.next_power_of_2(k), NO_KEY_=NO_KEY, CB=cb, C_STEPS=triton.cdiv(n_cand, cb),
                             TB=tb, T_STEPS=triton.cdiv(n_tiles, tb), num_warps=4)
    vals, ids = decode(sel)
    return vals, ids, lse, m, s, ok


def encode(values: Tensor, ids: Tensor) -> Tensor:
    """int64 keys of float32 values and ids (torch; what the kernel's ``_row_key`` forms, -0.0 as +0.0)."""
    bits = values.view(torch.int32)
    bits = torch.where(bits == -2147483648, torch.zeros_like(bits), bits)
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (order.to(torch.int64) << 32) | (2147483647 - ids.to(torch.int64))


def decode(keys: Tensor) -> tuple[Tensor, Tensor]:
    """(float32 values, int64 ids) of int64 keys (torch; the inverse of the kernel's ``_row_key``)."""
    hi = (keys >> 32).to(torch.int32)
    vals = torch.where(hi < 0, hi ^ 0x7FFFFFFF, hi).view(torch.float32)
    ids = 2147483647 - (keys & 0xFFFFFFFF)
    return vals, ids


def select(hidden: Tensor, weight: Tensor, inv_temp: Tensor, k: int, softcap: Optional[float] = None,
           rows: Optional[Tensor] = None) -> Selection:
    """The top k of softmax(z) per row of hidden [N, H] (or of its rows ``rows`` [n], gathered a chunk at a time)
    over weight [V, H]'s rows (``fast_path_ok`` holds); inv_temp [n]. In token chunks of ``chunk_rows``: every
    chunk's first pass, then the rows their candidates could not hold redone together (``_redo``). One host read
    per redo round (which rows are left)."""
    return _select(hidden, weight, inv_temp, k, softcap, rows, None)[0]


def select_with_given(hidden: Tensor, weight: Tensor, inv_temp: Tensor, k: int, local: Tensor, ids: Tensor,
                      softcap: Optional[float] = None, rows: Optional[Tensor] = None) -> tuple[Selection, SetPartial]:
    """``select`` and, from the same GEMM, ``given_set.given_set``'s partial of the given ids local [n, k'] (their
    rows in this weight, -1 elsewhere; ``ids`` the global ids it carries): the student's own top k beside the mass
    outside a teacher's ids. The given buffers (8 bytes per tile and token) count in the selection's chunks.
    ``shares_given`` holds."""
    kernel_ids, back, _ = sorted_distinct(local)
    sel, part = _select(hidden, weight, inv_temp, k, softcap, rows, kernel_ids)
    return sel, SetPartial(part.m, part.rest, part.vals.gather(1, back), ids)


def _select(hidden, weight, inv_temp, k, softcap, rows, given) -> tuple[Selection, Optional[SetPartial]]:
    with on_device(hidden):
        return _select_on_device(hidden, weight, inv_temp, k, softcap, rows, given)


def _select_on_device(hidden, weight, inv_temp, k, softcap, rows, given):
    n = inv_temp.shape[0]
    tiles = tiles_for(hidden.dtype, hidden.device)
    c = first_candidates(k, weight.shape[0], tiles)
    if n == 0:
        f32 = dict(dtype=torch.float32, device=hidden.device)
        empty = torch.empty(0, **f32)
        none = None if given is None else SetPartial(empty, empty, torch.empty(given.shape, **f32), given)
        return Selection(torch.empty((0, k), **f32), torch.empty((0, k), dtype=torch.int64, device=hidden.device),
                         empty, empty.clone(), empty.clone(), 0), none

    def take(idx: Tensor) -> Tensor:
        return hidden.index_select(0, idx if rows is None else rows.index_select(0, idx))

    step = chunk_rows(weight.shape[0], k, hidden.dtype, hidden.device, c, 0 if given is None else given.shape[1])
    n_tiles = triton.cdiv(weight.shape[0], tiles.block_n)
    parts, given_parts = [], []
    for start in range(0, n, step):
        stop = min(n, start + step)
        h = hidden[start:stop] if rows is None else hidden.index_select(0, rows[start:stop])
        buffers = None if given is None else (given[start:stop], GivenBuffers.empty(stop - start, given.shape[1],
                                                                                   n_tiles, hidden.device))
        parts.append(_finish(*_first_pass(h, weight, inv_temp[start:stop], c, softcap, tiles, given=buffers), k))
        if buffers is not None:
            given_parts.append(buffers[1].finish(buffers[0]))
    vals, ids, lse, m, s, ok = parts[0] if len(parts) == 1 else (torch.cat(f) for f in zip(*parts, strict=True))
    fallback = _redo(take, weight, inv_temp, k, softcap, tiles, c, (vals, ids, lse, m, s), ok)
    part = None
    if given_parts:
        part = given_parts[0] if len(given_parts) == 1 else SetPartial(
            *(torch.cat([getattr(p, f) for p in given_parts]) for f in SetPartial._fields))
    return Selection(vals, ids, lse, m, s, fallback), part


def select_with_stats(hidden: Tensor, weight: Tensor, inv_temp: Tensor, k: int, stats: PassStats) -> Tensor:
    """The top-k ids [c, k] of the rows of one chunk hidden [c, H] (``fast_path_ok`` holds; no softcap), the
    candidates kernel also writing the fused policy pass's statistics of the chunk into ``stats`` (its tiles:
    ``tiles_for``, whose BLOCK_N the statistics' layout follows). Rows whose candidates do not hold their top k are
    redone by the selection alone (``_redo``; the statistics are complete from the first pass)."""
    tiles = tiles_for(hidden.dtype, hidden.device)
    c = first_candidates(k, weight.shape[0], tiles)
    with on_device(hidden):
        vals, ids, lse, m, s, ok = _finish(*_first_pass(hidden, weight, inv_temp, c, None, tiles, stats), k)
        _redo(lambda idx: hidden.index_select(0, idx), weight, inv_temp, k, None, tiles, c, (vals, ids, lse, m, s),
              ok)
    return ids


class SelectingStats:
    """``policy_backend.StatsStage`` of a pass with no labels that also wants each token's top-k ids: per chunk
    ``select_with_stats`` (one GEMM for the statistics and the selection), the ids kept in ``ids`` [n, k]."""

    def __init__(self, weight: Tensor, k: int, n: int, dtype: torch.dtype):
        self.weight, self.k = weight, k
        self.block_n = tiles_for(dtype, weight.device).block_n
        self.ids = torch.empty((n, k), dtype=torch.int64, device=weight.device)

    def __call__(self, start: int, stop: int, hidden: Tensor, inv_temp: Tensor, part_m: Tensor, part_s: Tensor,
                 part_t: Tensor, e: Optional[Tensor]) -> None:
        self.ids[start:stop] = select_with_stats(hidden, self.weight, inv_temp, self.k,
                                                 PassStats(part_m, part_s, part_t, e))


def _redo(take, weight, inv_temp, k, softcap, tiles: Tiles, c: int, outs, ok: Tensor) -> int:
    """Recompute, in place in ``outs``, the rows whose first pass is not exact (``ok`` 0) with 4x the candidates a
    round, until C >= min(k, BLOCK_N) (exact by construction: a tile's rest then lies below k of its own keys).
    A row's answer comes from the first round whose check it passes, a function of the row alone (batch
    invariant). ``take(idx)``: the hidden rows of positions idx. Returns the number of rows redone."""
    redo = (ok == 0).nonzero().squeeze(1)
    fallback = int(redo.numel())
    exact = min(triton.next_power_of_2(k), tiles.block_n)
    while redo.numel():
        c = min(exact, 4 * c)
        step = chunk_rows(weight.shape[0], k, weight.dtype, weight.device, c)
        left = []
        for start in range(0, redo.numel(), step):
            rows = redo[start:start + step]
            part = _first_pass(take(rows), weight, inv_temp.index_select(0, rows), c, softcap, tiles)
            *new, r_ok = _finish(*part, k)
            del part
            for out, value in zip(outs, new, strict=True):
                out.index_copy_(0, rows, value)
            if c < exact:
                left.append(rows[r_ok == 0])        # the host read of this round
        redo = torch.cat(left) if left else redo[:0]
    return fallback
