"""The kept pairs' products and their gradients (``kept_pairs``) as Triton kernels: each pair reads its weight row
(and hidden row) once, in its own dtype, upcast in registers and summed in float32 by IEEE FMAs (no tensor cores,
no tf32): memory-bound work, P x H elements, where the torch path gathers float32 copies of the rows.

- ``pair_products``: raw[p] = <hidden[rows[p]], weight[ids[p]]>, a block of pairs per program, H in tiles.
- ``add_pairs_dh``: dh[r] += sum over the pairs of row r of coef[p] * weight[ids[p]]: the pairs sorted by row
  (offsets of each row's segment found on the device), one program per (row, H tile) adding into dh once.
- ``add_pairs_dw``: dw[i] += sum over the pairs of id i of coef[p] * hidden[rows[p]]: the pairs sorted by id, one
  program per (distinct id, H tile) summing in float32 and writing dw once (one rounding of a half-precision dw).

A row's or an id's segment is walked in a loop of BLOCK_P pairs, so a row with thousands of pairs, or an id every
token keeps, runs in one program per H tile (no atomics, a fixed summation order: the same numbers every run; an
id kept by every token makes its programs the last to finish: not balanced, a loop over the segment).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from .common import INTERPRETING, on_device

# Not tuned on a GPU: pairs per step and H per tile (a [16, 128] float32 accumulator: 16 registers a thread);
# LOGITLESS_TRITON_PAIRS overrides them for a sweep
BLOCK_P = 16
BLOCK_H = 128
NUM_WARPS = 4


def _blocks() -> tuple[int, int, int]:
    return knobs.triton_pairs() or (BLOCK_P, BLOCK_H, NUM_WARPS)


# the pairs of a call are not specialised: every batch runs the same build (one per hidden size and dtype)
@triton.jit(do_not_specialize=["n_pairs"])
def _products_kernel(h_ptr, w_ptr, rows_ptr, ids_ptr, out_ptr, n_pairs, n_h, s_hn, s_hk, s_wv, s_wk,
                     BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, H_TILES: tl.constexpr):
    pairs = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = pairs < n_pairs
    row = tl.load(rows_ptr + pairs, mask=live, other=0)
    idx = tl.load(ids_ptr + pairs, mask=live, other=-1)
    use = idx >= 0                      # -1: another rank's id, nothing read
    safe = tl.maximum(idx, 0)
    acc = tl.zeros((BLOCK_P, BLOCK_H), dtype=tl.float32)
    for t in range(0, H_TILES):
        offs = t * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = use[:, None] & (offs < n_h)[None, :]
        a = tl.load(h_ptr + row[:, None] * s_hn + offs[None, :] * s_hk, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + safe[:, None] * s_wv + offs[None, :] * s_wk, mask=ok, other=0.0).to(tl.float32)
        acc += a * b
    total = tl.sum(acc, axis=1)
    tl.store(out_ptr + pairs, tl.where(use, total, 0.0), mask=live)


@triton.jit
def _segment_step(acc, p, end, src_ptr, s_sn, s_sk, index_ptr, coef_ptr, offs, ok, BLOCK_P: tl.constexpr):
    """acc [BLOCK_P, BLOCK_H] plus coef[q] * src[index[q], offs] for the pairs q = p .. p + BLOCK_P (< end;
    index -1: skipped, nothing read)."""
    pairs = p + tl.arange(0, BLOCK_P)
    live = pairs < end
    idx = tl.load(index_ptr + pairs, mask=live, other=-1)
    use = idx >= 0
    c = tl.where(use, tl.load(coef_ptr + pairs, mask=live, other=0.0), 0.0)
    safe = tl.maximum(idx, 0)
    x = tl.load(src_ptr + safe[:, None] * s_sn + offs[None, :] * s_sk, mask=use[:, None] & ok[None, :],
                other=0.0).to(tl.float32)
    return acc + c[:, None] * x


@triton.jit
def _segment_sum(src_ptr, s_sn, s_sk, index_ptr, coef_ptr, start, end, offs, ok,
                 BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, WHILE_LOOP_: tl.constexpr):
    """sum over the pairs start..end of coef[p] * src[index[p], offs] in float32 (index -1: skipped). A ``for``
    loop on the GPU (software-pipelined: the next pairs' rows load while these are summed); the interpreter
    refuses a ``for`` whose bound is a loaded value, so there the same steps run in a ``while`` loop."""
    acc = tl.zeros((BLOCK_P, BLOCK_H), dtype=tl.float32)
    if WHILE_LOOP_:
        p = start
        while p < end:
            acc = _segment_step(acc, p, end, src_ptr, s_sn, s_sk, index_ptr, coef_ptr, offs, ok, BLOCK_P)
            p += BLOCK_P
    else:
        for p in range(start, end, BLOCK_P):
            acc = _segment_step(acc, p, end, src_ptr, s_sn, s_sk, index_ptr, coef_ptr, offs, ok, BLOCK_P)
    return tl.sum(acc, axis=0)


@triton.jit
def _dh_kernel(dh_ptr, w_ptr, ids_ptr, coef_ptr, offsets_ptr, n_h, s_dn, s_dk, s_wv, s_wk,
               BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, WHILE_LOOP_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < n_h
    start = tl.load(offsets_ptr + row)
    end = tl.load(offsets_ptr + row + 1)
    total = _segment_sum(w_ptr, s_wv, s_wk, ids_ptr, coef_ptr, start, end, offs, ok, BLOCK_P, BLOCK_H,
                         WHILE_LOOP_)
    dst = dh_ptr + row * s_dn + offs * s_dk
    tl.store(dst, tl.load(dst, mask=ok, other=0.0) + total, mask=ok)


@triton.jit
def _bf16_rtne(x):
    """float32 -> bfloat16 rounded to the nearest, ties to even, from the bits (finite x): the interpreter's own
    cast truncates, which would hide a second rounding from the tests."""
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dw_kernel(dw_ptr, h_ptr, uniq_ptr, rows_ptr, coef_ptr, offsets_ptr, n_vocab, n_h, s_dv, s_dk, s_hn, s_hk,
               BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, WHILE_LOOP_: tl.constexpr, BF16_BITS: tl.constexpr):
    seg = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    idx = tl.load(uniq_ptr + seg)
    mine = idx < n_vocab                # the last segment may hold the dropped pairs (key n_vocab)
    ok = (offs < n_h) & mine
    start = tl.load(offsets_ptr + seg)
    end = tl.where(mine, tl.load(offsets_ptr + seg + 1), start)
    total = _segment_sum(h_ptr, s_hn, s_hk, rows_ptr, coef_ptr, start, end, offs, ok, BLOCK_P, BLOCK_H,
                         WHILE_LOOP_)
    dst = dw_ptr + tl.minimum(idx, n_vocab - 1) * s_dv + offs * s_dk
    old = tl.load(dst, mask=ok, other=0.0).to(tl.float32)
    if BF16_BITS:
        tl.store(dst, _bf16_rtne(old + total), mask=ok)
    else:       # the hardware's conversion: round to nearest even
        tl.store(dst, (old + total).to(dw_ptr.dtype.element_ty), mask=ok)


def pair_products(hidden: Tensor, weight: Tensor, rows: Tensor, ids: Tensor) -> Tensor:
    """raw [P] float32 = <hidden[rows[p]], weight[ids[p]]>, 0 where ids[p] == -1 (``kept_pairs.pair_products``)."""
    n_pairs = rows.numel()
    out = torch.empty(n_pairs, dtype=torch.float32, device=hidden.device)
    if n_pairs == 0:
        return out
    h = hidden.shape[1]
    block_p, block_h, warps = _blocks()
    with on_device(hidden):
        _products_kernel[(triton.cdiv(n_pairs, block_p),)](
            hidden, weight, rows.contiguous(), ids.contiguous(), out, n_pairs, h, hidden.stride(0),
            hidden.stride(1), weight.stride(0), weight.stride(1), BLOCK_P=block_p, BLOCK_H=block_h,
            H_TILES=triton.cdiv(h, block_h), num_warps=warps)
    return out


def add_pairs_dh(dh: Tensor, weight: Tensor, rows: Tensor, ids: Tensor, coef: Tensor) -> None:
    """dh [N, H] float32 += coef[p] * weight[ids[p]] at row rows[p], for ids >= 0 (``kept_pairs.add_pairs_dh``).
    The pairs need not arrive grouped by row: a stable sort groups them, and each row's segment is found with
    searchsorted on the device (no host read)."""
    n, h = dh.shape
    if rows.numel() == 0 or n == 0:
        return
    by_row, order = torch.sort(rows, stable=True)
    offsets = torch.searchsorted(by_row, torch.arange(n + 1, dtype=by_row.dtype, device=rows.device))
    ids_s = ids.index_select(0, order)
    coef_s = coef.float().index_select(0, order)
    block_p, block_h, warps = _blocks()
    with on_device(dh):
        _dh_kernel[(n, triton.cdiv(h, block_h))](
            dh, weight, ids_s, coef_s, offsets, h, dh.stride(0), dh.stride(1), weight.stride(0), weight.stride(1),
            BLOCK_P=block_p, BLOCK_H=block_h, WHILE_LOOP_=INTERPRETING, num_warps=warps)


def add_pairs_dw(dw: Tensor, hidden: Tensor, rows: Tensor, ids: Tensor, coef: Tensor) -> None:
    """dw [V_local, H] += coef[p] * hidden[rows[p]] at row ids[p], for ids >= 0 and coef != 0 (the pairs
    ``label_sets.add_onehot_dw`` adds): each id's pairs summed in float32 and added to dw once (one rounding of a
    half-precision dw)."""
    vocab, h = dw.shape
    if rows.numel() == 0 or vocab == 0:
        return
    coef = coef.float()
    keys = torch.where((ids >= 0) & (coef != 0), ids, vocab)      # dropped pairs: one segment past the last id
    by_id, order = torch.sort(keys, stable=True)
    # the one host read: the number of distinct ids sizes the grid
    uniq, counts = torch.unique_consecutive(by_id, return_counts=True)
    offsets = torch.zeros(uniq.numel() + 1, dtype=torch.int64, device=dw.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    rows_s = rows.index_select(0, order)
    coef_s = coef.index_select(0, order)
    block_p, block_h, warps = _blocks()
    with on_device(dw):
        _dw_kernel[(uniq.numel(), triton.cdiv(h, block_h))](
            dw, hidden, uniq, rows_s, coef_s, offsets, vocab, h, dw.stride(0), dw.stride(1), hidden.stride(0),
            hidden.stride(1), BLOCK_P=block_p, BLOCK_H=block_h, WHILE_LOOP_=INTERPRETING,
            BF16_BITS=INTERPRETING and dw.dtype == torch.bfloat16, num_warps=warps)

