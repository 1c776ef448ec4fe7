"""The building blocks of the kernels: a float32 tile of hidden @ weight.T kept in registers, its tempered
per-row statistics, and the epilogue stores they share."""
from __future__ import annotations

import triton
import triton.language as tl

from .common import LN2, LOG2E


@triton.jit
def tile_coords(pid, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(token block, vocab block) of program ``pid``. GROUP_M token blocks walk the vocabulary
    together, so each weight tile is read from HBM once per group and then hit in L2."""
    num_m = tl.cdiv(n_rows, BLOCK_M)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b.T in float32."""
    if UPCAST:   # interpreter only: its bf16 dot is wrong
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(b), acc)


@triton.jit
def _round_bf16(x):
    """x rounded to nearest-even bfloat16, as a float32 value, on the bits: the interpreter's float32 -> bfloat16
    cast truncates (``split._round_bf16``'s rounding; nan is no concern here: the op checks hidden is finite)."""
    bits = x.to(tl.uint32, bitcast=True)
    return (((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _hi(x, INTERP: tl.constexpr):
    """x (float32) rounded to bfloat16: a bfloat16 tile for the tensor cores, or under the interpreter (whose
    bfloat16 dot is wrong) the same values in float32 (their products are exact in float32 either way)."""
    if INTERP:
        return _round_bf16(x)
    return x.to(tl.bfloat16)


@triton.jit
def _lo(x, hi, INTERP: tl.constexpr):
    """What x leaves after its part ``hi`` (``_hi``'s), rounded to bfloat16 (as ``_hi``)."""
    return _hi(x - hi.to(tl.float32), INTERP)


@triton.jit
def _split_dots(w, h_hi, h_lo, acc_t, acc_lo_t, SPLIT: tl.constexpr, INTERP: tl.constexpr, ONE_ACC: tl.constexpr):
    """(acc_t, acc_lo_t) [N, M] + the products of SPLIT (``maths.SPLIT_CODES``) of the weight's float32 tile w
    [N, K], split in registers into bfloat16 parts w = w_hi + w_lo, and hidden's bfloat16 parts h_hi, h_lo [M, K]
    (``split_operands``' copy): 1 w_hi h_hi (both operands bfloat16 values); 2 also w_lo h_hi (hidden is); 3 also
    w_hi h_lo (the weight is); 4 both corrections. The weight's parts are the tensor cores' A operand, which they
    read from registers; hidden's, the B operand, which they read from shared memory, come from the copy as loaded
    (a B operand split in registers would go back through shared memory at every K step).
    On the tensor cores each dot's sum is truncated relative to the accumulator it lands on, so the small
    products must not be added onto a logit-sized one: ONE_ACC, every product onto acc_t, the corrections first
    (``_split_tile`` flushes acc_t into acc_lo_t every few K tiles, so it never grows logit-sized); otherwise the
    corrections onto their own accumulator ``acc_lo_t``, added once at the end (the concatenated split orders them
    first along K for the same reason, ``ops/precision.py``)."""
    w_hi = _hi(w, INTERP)
    if ONE_ACC:
        lo = acc_t
    else:
        lo = acc_lo_t
    if SPLIT == 2 or SPLIT == 4:
        lo = _dot(_lo(w, w_hi, INTERP), h_hi, lo, False, INTERP)
    if SPLIT == 3 or SPLIT == 4:
        lo = _dot(w_hi, h_lo, lo, False, INTERP)
    if ONE_ACC:
        acc_t = _dot(w_hi, h_hi, lo, False, INTERP)
    else:
        acc_lo_t = lo
        acc_t = _dot(w_hi, h_hi, acc_t, False, INTERP)
    return acc_t, acc_lo_t


@triton.jit
def _flush(acc_t, acc_sum_t, k, FLUSH_TILES: tl.constexpr):
    """After K tile k: acc_t added onto acc_sum_t and restarted from 0 every FLUSH_TILES tiles (0: never). The
    tensor cores truncate each dot's sum relative to the accumulator (biased, up to ~ulp(logit) per 16-deep step:
    the H100's 2.4e-4 of log-prob at logit std 8 over K 4096, which ``benchmarks/cpu_accumulation_model.py``
    reproduces); a float32 add on the CUDA cores rounds to nearest, and the restarted accumulator stays a few K
    tiles' size."""
    if FLUSH_TILES > 0:
        if ((k + 1) // FLUSH_TILES) * FLUSH_TILES == k + 1:   # (k + 1) % F: the interpreter's constexpr has no rmod
            acc_sum_t += acc_t
            acc_t = tl.zeros_like(acc_t)
    return acc_t, acc_sum_t


@triton.jit
def _split_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_wv, s_wk, pid_m, pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr,
                FLUSH_K: tl.constexpr):
    """``logits_tile``'s acc [M, N] for float32 operands split into bfloat16 parts (``_split_dots``), computed as
    its transpose [N, M] (the weight's tile as the A operand) and transposed once after the K loop. h_ptr: hidden's
    parts (``split_operands``), [n_rows, P * KP] bfloat16, contiguous, part p in columns p * KP .. (p + 1) * KP,
    KP = K_TILES * BLOCK_K, zeros past n_k (P = 2 for SPLIT 3 and 4, else 1)."""
    # FLUSH_K (``common.SPLIT_FLUSH_K``): the accumulator's flush depth, 0 never. SPLIT 1 (both operands bfloat16
    # values) keeps the bfloat16 head's accumulation: its statistics are that head's, bit for bit
    FLUSH_TILES: tl.constexpr = (FLUSH_K + BLOCK_K - 1) // BLOCK_K if SPLIT > 1 else 0
    ONE_ACC: tl.constexpr = FLUSH_TILES > 0
    acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_lo_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if USE_TMA:
        for k in range(0, K_TILES):
            w = w_ptr.load([pid_n * BLOCK_N, k * BLOCK_K])
            h_hi = h_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
            h_lo = h_hi                 # (not read below 3)
            if SPLIT >= 3:
                h_lo = h_ptr.load([pid_m * BLOCK_M, (K_TILES + k) * BLOCK_K])
            if INTERP:      # the interpreter's bfloat16 dot is wrong: the parts' values in float32
                h_hi = h_hi.to(tl.float32)
                h_lo = h_lo.to(tl.float32)
            acc_t, acc_lo_t = _split_dots(w, h_hi, h_lo, acc_t, acc_lo_t, SPLIT, INTERP, ONE_ACC)
            acc_t, acc_lo_t = _flush(acc_t, acc_lo_t, k, FLUSH_TILES)
    else:
        rows_in = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % n_rows).to(tl.int64)
        cols_in = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % n_cols).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + rows_in[:, None] * (K_TILES * BLOCK_K * (2 if SPLIT >= 3 else 1)) + ks[None, :]
        w_ptrs = w_ptr + cols_in[:, None] * s_wv + ks[None, :] * s_wk
        for k in range(0, K_TILES):
            if EVEN_K:
                w = tl.load(w_ptrs)
                h_hi = tl.load(h_ptrs)
                h_lo = h_hi             # (not read below 3)
                if SPLIT >= 3:
                    h_lo = tl.load(h_ptrs + K_TILES * BLOCK_K)
            else:
                k_ok = ks < n_k - k * BLOCK_K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                h_hi = tl.load(h_ptrs)          # (the parts are zeros past n_k)
                h_lo = h_hi
                if SPLIT >= 3:
                    h_lo = tl.load(h_ptrs + K_TILES * BLOCK_K)
            if INTERP:
                h_hi = h_hi.to(tl.float32)
                h_lo = h_lo.to(tl.float32)
            acc_t, acc_lo_t = _split_dots(w, h_hi, h_lo, acc_t, acc_lo_t, SPLIT, INTERP, ONE_ACC)
            acc_t, acc_lo_t = _flush(acc_t, acc_lo_t, k, FLUSH_TILES)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * s_wk
    if SPLIT > 1:
        acc_t = acc_t + acc_lo_t
    return tl.trans(acc_t)


@triton.jit
def _plain_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, pid_m, pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr):
    """``logits_tile``'s acc [M, N] of the operands' own dots."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k in range(0, K_TILES):
            a = h_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_ptr.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = _dot(a, b, acc, UPCAST, IEEE)
    else:
        rows_in = ((pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % n_rows).to(tl.int64)
        cols_in = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % n_cols).to(tl.int64)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows_in[:, None] * s_hn + ks[None, :] * s_hk
        b_ptrs = w_ptr + cols_in[:, None] * s_wv + ks[None, :] * s_wk
        for k in range(0, K_TILES):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = ks < n_k - k * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[None, :], other=0.0)
            acc = _dot(a, b, acc, UPCAST, IEEE)
            a_ptrs += BLOCK_K * s_hk
            b_ptrs += BLOCK_K * s_wk
    return acc


@triton.jit
def logits_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, pid_m, pid_n,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
                SPLIT: tl.constexpr = 0, INTERP: tl.constexpr = False, FLUSH_K: tl.constexpr = 0):
    """acc[i, j] = sum_k h[rows[i], k] * w[cols[j], k] in float32, for the tile (pid_m, pid_n).

    USE_TMA: h_ptr / w_ptr are tensor descriptors ([BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K] blocks):
    the bulk copy engine fetches the tiles and fills out-of-range rows, columns and K with zeros.
    Otherwise they are pointers: rows >= n_rows and cols >= n_cols are clamped onto valid ones so the
    main loop needs no masks, and a ragged last K tile is masked unless EVEN_K.
    Either way the caller masks rows/cols out of range from whatever it reduces or stores.
    K_TILES = cdiv(n_k, BLOCK_K) is a compile-time trip count (one build per hidden size; the
    interpreter cannot loop to a run-time bound under numpy >= 2.4). SPLIT (``maths.SPLIT_CODES``; 0: none):
    float32 operands as bfloat16 parts (``_split_tile``: h_ptr is then hidden's parts, ``split_operands``, and
    s_hn / s_hk are not read); INTERP: under the interpreter; FLUSH_K: the split's accumulator flush depth
    (``common.SPLIT_FLUSH_K``, ``_flush``).
    Returns (acc, rows, cols).
    """
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT > 0:
        acc = _split_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_wv, s_wk, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                          K_TILES, EVEN_K, USE_TMA, SPLIT, INTERP, FLUSH_K)
    else:
        acc = _plain_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, pid_m, pid_n, BLOCK_M, BLOCK_N,
                          BLOCK_K, K_TILES, EVEN_K, UPCAST, IEEE, USE_TMA)
    return acc, rows, cols


@triton.jit
def program_tile(h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
                 GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                 USE_TMA: tl.constexpr, SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr):
    """The prologue of every one-tile-a-program kernel: this program's tile (``tile_coords``), its float32 products
    (``logits_tile``) and its rows' inverse temperatures. Returns (acc, rows, cols, row_ok, inv_t, pid_n), inv_t 1.0
    on rows past n_rows."""
    pid_m, pid_n = tile_coords(tl.program_id(0), n_rows, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    acc, rows, cols = logits_tile(h_ptr, w_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk, pid_m, pid_n,
                                  BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP,
                                  FLUSH_K)
    row_ok = rows < n_rows
    inv_t = tl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
    return acc, rows, cols, row_ok, inv_t, pid_n


@triton.jit
def _ids_below(ids_ptr, id_rows, row_ok, target, N_IDS: tl.constexpr, ID_STEPS: tl.constexpr):
    """[M] int64: how many of each row's N_IDS ids lie below ``target`` (a column), the row's ids at
    ids_ptr + id_rows [M] ascending with their holes (``label_sets.ID_HOLE``) last. A binary search: ID_STEPS =
    N_IDS.bit_length() loads a row (2^ID_STEPS > N_IDS), the largest prefix whose last id is below the target
    grown by halving widths. Rows past n_rows (``row_ok`` False): 0."""
    pos = tl.zeros_like(id_rows)
    for s in tl.static_range(ID_STEPS):
        cand = pos + (1 << (ID_STEPS - 1 - s))
        inside = row_ok & (cand <= N_IDS)
        last = tl.load(ids_ptr + id_rows + tl.minimum(cand, N_IDS) - 1, mask=inside, other=0)
        pos = tl.where(inside & (last < target), cand, pos)
    return pos


@triton.jit
def ids_in_tile(ids_ptr, id_rows, row_ok, first, BLOCK_N: tl.constexpr, N_IDS: tl.constexpr,
                ID_STEPS: tl.constexpr):
    """(lo [M], count [M], steps): each row's ids among the columns first .. first + BLOCK_N are its sorted ids
    lo .. lo + count (``_ids_below``, twice); steps, the largest count, is how many steps a loop over the j-th id
    of every row takes."""
    lo = _ids_below(ids_ptr, id_rows, row_ok, first, N_IDS, ID_STEPS)
    count = _ids_below(ids_ptr, id_rows, row_ok, first + BLOCK_N, N_IDS, ID_STEPS) - lo
    return lo, count, tl.max(count, axis=0)


@triton.jit
def softcap_tanh(acc, CAP: tl.constexpr):
    """(t, 1 - t^2) with t = tanh(acc / CAP), elementwise, float32.

    From one exp2 of a non-positive argument, e = exp(-2|x|) in (0, 1] (no overflow, no inf / inf):
    |t| = (1 - e) / (1 + e) and 1 - t^2 = 4e / (1 + e)^2, the latter with full relative precision even
    where |t| rounds to 1. Absolute error of t ~1e-7, like float32 tanh. Written out because triton 3.6
    has no tl.tanh and its interpreter cannot run libdevice.tanh; the same code runs on both."""
    e = tl.exp2(tl.abs(acc) * (-2.0 * LOG2E / CAP))
    r = 1.0 / (1.0 + e)
    t_abs = (1.0 - e) * r
    if CAP > 64.0:
        # near 0, 1 - e cancels (absolute error ~6e-8, so z = t * CAP / T is off by ~6e-8 * CAP: 4e-6 at
        # CAP = 64, 0.06 at 1e6): there the series x - x^3 / 3 + 2 x^5 / 15, whose next term is below
        # float32's precision for |x| < 0.05. Compile-time: the usual caps (Gemma's 30) keep the short path.
        x = tl.abs(acc) * (1.0 / CAP)
        x2 = x * x
        t_abs = tl.where(x < 0.05, x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0))), t_abs)
    t = tl.where(acc < 0, -t_abs, t_abs)
    return t, 4.0 * e * r * r


@triton.jit
def tempered_logits(acc, inv_t, SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    """z [M, N] = the tempered logits of the float32 products acc [M, N] (softcapped first) at inverse temperatures
    inv_t [M]: one rounding after the cap. The selection kernels that must agree bit for bit (``topk_select``'s
    candidates, ``above_select``) both form z here."""
    if SOFTCAP:
        acc, _ = softcap_tanh(acc, CAP)
        inv_t = inv_t * CAP
    return acc * inv_t[:, None]


@triton.jit
def tempered_tile_stats(acc, cols, n_cols, inv_t, pid_n, BLOCK_N: tl.constexpr):
    """The per-row statistics of a raw logits tile ``acc`` [BLOCK_M, BLOCK_N] (float32) tempered by
    ``inv_t`` [BLOCK_M] (> 0): (m, e, d2) with m [BLOCK_M] the tile's largest tempered logit,
    e = exp(z - m) and d2 = log2(e) = (z - m) * log2(e) [BLOCK_M, BLOCK_N]; padded columns (>= n_cols, only
    in the last vocabulary tile) get e = 0 and d2 = -inf.

    The max is taken of the raw products: as inv_t > 0 and rounding is monotonic, max(acc) * inv_t is
    exactly the largest tempered logit (so label logit <= m <= lse hold in float32 too). The differences
    to the max are one fused multiply-add per element in base 2 (exp2 is the hardware's exponential)."""
    padded = (pid_n + 1) * BLOCK_N > n_cols
    if padded:
        acc = tl.where((cols < n_cols)[None, :], acc, float("-inf"))
    m_acc = tl.max(acc, axis=1)     # finite: every tile has at least one real column
    scale2 = inv_t * LOG2E
    d2 = acc * scale2[:, None] - (m_acc * scale2)[:, None]
    return m_acc * inv_t, tl.exp2(d2), d2


@triton.jit
def store_row_stats(part_m_ptr, part_s_ptr, part_t_ptr, m, e, d2, rows, row_ok, n_rows, pid_n,
                    WITH_T: tl.constexpr):
    """Write one tile's per-row statistics to the [vocab tiles, n_rows] float32 workspaces: m, s = sum e
    and (WITH_T) t = sum e * (z - m), relative to the tile max so large logits do not cancel. The clamp
    turns padding's 0 * -inf into 0 * -1e30 = 0 without a branch (a branch there cost 11% on the H200)."""
    out = pid_n.to(tl.int64) * n_rows + rows
    tl.store(part_m_ptr + out, m, mask=row_ok)
    tl.store(part_s_ptr + out, tl.sum(e, axis=1), mask=row_ok)
    if WITH_T:
        tl.store(part_t_ptr + out, tl.sum(e * tl.maximum(d2, -1e30), axis=1) * LN2, mask=row_ok)


@triton.jit
def store_label_logit(labels_ptr, zy_ptr, acc, inv_t, rows, cols, row_ok, pid_n, n_cols, BLOCK_N: tl.constexpr):
    """zy[row] = acc[row, label] * inv_t[row] from the one tile that holds the row's label; the first
    vocabulary tile writes 0 for rows whose label no tile holds (-1: not in this vocabulary shard), so
    every row of zy is written and the caller need not clear it. Most tiles hold no label: they skip the
    pick."""
    label = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    first = pid_n * BLOCK_N
    here = row_ok & (label >= first) & (label < first + BLOCK_N)
    if tl.max(here.to(tl.int32), axis=0) > 0:
        zy = tl.sum(tl.where(cols[None, :] == label[:, None], acc, 0.0), axis=1) * inv_t
        tl.store(zy_ptr + rows, zy, mask=here)
    if pid_n == 0:
        tl.store(zy_ptr + rows, tl.zeros_like(inv_t), mask=row_ok & ((label < 0) | (label >= n_cols)))
