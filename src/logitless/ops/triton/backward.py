"""Backward: recompute logits chunk by chunk, write dlogits, and let cuBLAS do the two big products.

For each chunk of C vocabulary rows, a Triton kernel recomputes the float32 logits tiles and writes
dlogits [N, C] in the inputs' dtype (the only [N x C] buffer, reused across chunks and bounded by
LOGITLESS_TRITON_DLOGITS_ELEMENTS); then
    d_hidden (float32 [N, H]) += dlogits @ weight[chunk]      (accumulated in place)
    d_weight[chunk]            = dlogits.T @ hidden           (written once, weight.dtype)
The two products run at cuBLAS speed; a fully fused kernel would need float32 atomics on d_hidden
from every vocabulary tile (see benchmarks/DESIGN.md).

One call takes at most ``token_rows`` tokens (LOGITLESS_TRITON_BWD_TOKENS, 16384 by default: a float32
d_hidden of 256 MiB at H = 4096); ``ops/token_chunks.py`` feeds larger inputs in token chunks, each call
adding its d_weight into one float32 [V, H] accumulator (``dw_acc``) instead of writing it.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import knobs
from ..maths import accumulate_mm, accumulate_product
from ..precision import GradOperands
from ..tail_backward import TailTerms
from . import tail_dlogits
from .common import LN2, LOG2E, choose_tiles, int32_safe, launch_options, on_device, tl_dtype
from .operands import kernel_hidden, tile_operands
from .tile import program_tile, softcap_tanh

# 128 Mi elements: 256 MiB of bf16 dlogits, whatever N is (C = this / N, rounded to the tile). Each vocabulary
# chunk reads and writes the float32 d_hidden [N, H] once (accumulate_mm), so wider chunks halve that traffic: on
# the H200, 2^27 against 2^26 measured forward+backward 1.058x against 1.080x the 4-GEMM floor at
# 16384 x 4096 x 151936 and 1.070x against 1.081x at 8192 x 4096 x 131072 (benchmarks/results/
# gpu-invariance-2026-12-04.md); LOGITLESS_TRITON_DLOGITS_ELEMENTS=67108864 gives back the 128 MiB.
DEFAULT_DLOGITS_ELEMENTS = 1 << 27
# Tokens of one call. Its float32 d_hidden [T, H] is read and written once per vocabulary chunk, and the
# chunks narrow as T grows (C = 2^26 / T columns), so that traffic grows like T^2: on the H200, N = 131072
# in one call ran at 1.29x the 4-GEMM floor, in chunks of 16384 at 1.06x (benchmarks/DESIGN.md). 16384
# keeps the published shapes (docs/performance.md; N <= 16384) in one call, the path measured there.
DEFAULT_BWD_TOKENS = 16384


@triton.jit
def _dlogits_kernel(h_ptr, w_ptr, labels_ptr, inv_temp_ptr, lse_ptr, ent_ptr, g_lp_ptr, g_ent_ptr, dl_ptr,
                    member_ptr, n_rows, n_cols, n_k, col0, s_hn, s_hk, s_wv, s_wk, s_dn,
                    WITH_ENTROPY: tl.constexpr, MEMBER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, K_TILES: tl.constexpr, GROUP_M: tl.constexpr,
                    EVEN_K: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
                    SPLIT: tl.constexpr, INTERP: tl.constexpr, FLUSH_K: tl.constexpr,
                    OUT_DTYPE: tl.constexpr, SOFTCAP: tl.constexpr, CAP: tl.constexpr):
    """dl[i, j] = inv_t_i * (g_lp_i * ([j + col0 == label_i] - p_ij) - g_ent_i * p_ij * (x_ij + ent_i)),
    x = z - lse = log p, for the chunk of vocabulary rows starting at col0 (w_ptr points at that chunk).
    SOFTCAP: z = tanh(raw / CAP) * CAP * inv_t, and dl is further multiplied by 1 - tanh^2 (compile-time
    branch; without it the kernel is unchanged). MEMBER: p is taken as 0 where z <= member[i] (a truncated
    distribution's kept set, lse and ent then its own: ``truncation_dense``), the label's term kept. A masked
    pointer store writes the tile (a bulk-copy store measured no gain: benchmarks/DESIGN.md)."""
    acc, rows, cols, row_ok, inv_t, pid_n = program_tile(
        h_ptr, w_ptr, inv_temp_ptr, n_rows, n_cols, n_k, s_hn, s_hk, s_wv, s_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, K_TILES, GROUP_M, EVEN_K, UPCAST, IEEE, USE_TMA, SPLIT, INTERP, FLUSH_K)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_lp = tl.load(g_lp_ptr + rows, mask=row_ok, other=0.0)
    z_scale = inv_t            # z = acc * z_scale
    if SOFTCAP:
        acc, dcap = softcap_tanh(acc, CAP)     # acc now holds t = tanh(raw / CAP); dcap = 1 - t^2
        z_scale = inv_t * CAP
    # x2 = log2 p = (z - lse) * log2(e): one fused multiply-add per element
    x2 = acc * (z_scale * LOG2E)[:, None] - (lse * LOG2E)[:, None]
    p = tl.exp2(x2)
    if MEMBER:
        bound = tl.load(member_ptr + rows, mask=row_ok, other=float("inf"))
        p = tl.where(acc * z_scale[:, None] > bound[:, None], p, 0.0)
    if WITH_ENTROPY:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        g_ent = tl.load(g_ent_ptr + rows, mask=row_ok, other=0.0)
        # -inv_t * (g_lp + g_ent * (x + ent)) with x = x2 * ln 2, as c1 * x2 + c0 per row
        c1 = -inv_t * g_ent * LN2
        c0 = -inv_t * (g_lp + g_ent * ent)
        dl = p * (x2 * c1[:, None] + c0[:, None])
    else:
        dl = p * (-inv_t * g_lp)[:, None]
    label = tl.load(labels_ptr + rows, mask=row_ok, other=-1) - col0
    first = pid_n * BLOCK_N
    here = row_ok & (label >= first) & (label < first + BLOCK_N)
    if tl.max(here.to(tl.int32), axis=0) > 0:   # most tiles hold no label
        dl += tl.where(cols[None, :] == label[:, None], (g_lp * inv_t)[:, None], 0.0)
    if SOFTCAP:
        dl = dl * dcap     # chain rule through the cap: d z / d raw = inv_t * (1 - t^2)
    ptrs = dl_ptr + rows.to(tl.int64)[:, None] * s_dn + cols[None, :]
    tl.store(ptrs, dl.to(OUT_DTYPE), mask=row_ok[:, None] & (cols < n_cols)[None, :])


def dlogits_chunk(hidden: Tensor, w_chunk: Tensor, col0: int, labels: Tensor, inv_temp: Tensor, lse: Tensor,
                  ent: Optional[Tensor], g_lp: Tensor, g_ent: Optional[Tensor], out: Tensor,
                  softcap: Optional[float] = None, member: Optional[Tensor] = None,
                  parts: Optional[Tensor] = None) -> Tensor:
    """Fill ``out`` [N, C] (hidden.dtype, unit column stride) with the dlogits of vocabulary rows
    col0 .. col0 + C, where w_chunk = weight[col0 : col0 + C] (d raw logits when softcap is set). member [N]
    float32: only the logits above it count (the kernel's MEMBER). parts: ``operands.kernel_hidden(hidden)``,
    made once for all chunks (None: made here)."""
    n, k = hidden.shape
    cols = w_chunk.shape[0]
    tiles = choose_tiles("BWD", hidden.dtype, hidden.device)
    with_entropy = g_ent is not None
    grid = (triton.cdiv(n, tiles.block_m) * triton.cdiv(cols, tiles.block_n),)
    h_op, w_op, use_tma = tile_operands(hidden, w_chunk, tiles, parts)
    _dlogits_kernel[grid](
        h_op, w_op, labels, inv_temp, lse, ent if with_entropy else lse, g_lp,
        g_ent if with_entropy else g_lp, out, lse if member is None else member,
        n, cols, k, col0, hidden.stride(0), hidden.stride(1), w_chunk.stride(0), w_chunk.stride(1), out.stride(0),
        WITH_ENTROPY=with_entropy, MEMBER=member is not None, USE_TMA=use_tma, OUT_DTYPE=tl_dtype(out.dtype),
        **launch_options(tiles, hidden, softcap))
    return out


def chunk_columns(n_tokens: int, vocab: int, block_n: int) -> int:
    """Vocabulary rows per dlogits chunk: the element budget over N, a multiple of the tile, <= V."""
    budget = knobs.dlogits_elements(DEFAULT_DLOGITS_ELEMENTS)
    cols = max(block_n, (budget // max(n_tokens, 1)) // block_n * block_n)
    return min(cols, vocab)


def token_rows(hidden: Tensor) -> int:
    """Most tokens one ``grads`` call takes (LOGITLESS_TRITON_BWD_TOKENS), a multiple of the token tile.
    Depends on hidden's dtype and device only, as contract.py requires."""
    block_m = choose_tiles("BWD", hidden.dtype, hidden.device).block_m
    return max(block_m, knobs.triton_bwd_tokens(DEFAULT_BWD_TOKENS) // block_m * block_m)


def grads(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, lse: Tensor, ent: Optional[Tensor],
          g_lp: Tensor, g_ent: Optional[Tensor], need_dh: bool, need_dw: bool, softcap: Optional[float] = None,
          dw_acc: Optional[Tensor] = None, grad_operands: Optional[GradOperands] = None,
          tail: Optional[TailTerms] = None, member: Optional[Tensor] = None):
    """(d_hidden float32 [N, H] or None, d_weight [V, H] or None), chunk by chunk.
    softcap: None or c > 0, see logitless.ops.contract (the cap's derivative is applied in the kernel).
    dw_acc: None, or a float32 [V, H] accumulator into which d_weight is added (then None is returned).
    grad_operands: the gradient products (``ops/precision.py``) when hidden / weight are a precision's
    statistics operands; None: the products of hidden and weight themselves.
    tail: the k ids and tail of an op with a tail output (``tail_backward.TailTerms``; g_lp is then G, labels and
    the entropy unused): its closed form's dlogits (``tail_dlogits``), the same products after.
    member: None, or float32 [N]: a truncated distribution's gradients (lse and ent its kept set's), only the
    logits above member[i] in the kept set (``truncation_dense``).

    Workspace: one dlogits buffer [N, C] (256 MiB in bf16 by default) besides the outputs.
    dlogits are rounded to the inputs' dtype before the cuBLAS products (bf16: ~2e-3 relative error in
    the gradients, the same as any bf16 backward; float32 inputs stay float32 throughout)."""
    with on_device(hidden):
        return _grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw, softcap, dw_acc,
                      grad_operands, tail, member)


def _grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw, softcap, dw_acc,
           grad_operands, tail, member):
    go = grad_operands or GradOperands.plain(hidden, weight)
    n, k = hidden.shape[0], go.hidden_size
    vocab = weight.shape[0]
    tiles = choose_tiles("BWD", hidden.dtype, hidden.device)
    step = chunk_columns(n, vocab, tiles.block_n)
    h_kernel, w_kernel = int32_safe(hidden, tiles.block_k), int32_safe(weight, tiles.block_k)
    dh = torch.zeros((n, k), dtype=torch.float32, device=hidden.device) if need_dh else None
    dw = torch.empty((vocab, k), dtype=go.out_dtype, device=weight.device) if need_dw and dw_acc is None else None
    buf = torch.empty((n, step), dtype=go.dl_dtype, device=hidden.device)
    parts = kernel_hidden(h_kernel, tiles)      # (a split precision's parts of hidden: once, not per chunk)
    for start in range(0, vocab, step):
        stop = min(start + step, vocab)
        if tail is None:
            dl = dlogits_chunk(h_kernel, w_kernel[start:stop], start, labels, inv_temp, lse, ent, g_lp, g_ent,
                               buf[:, :stop - start], softcap, member, parts)
        else:
            dl = tail_dlogits.dlogits_chunk(h_kernel, w_kernel[start:stop], start, tail, inv_temp, lse, g_lp,
                                            buf[:, :stop - start], softcap, parts)
        if dh is not None:
            for a, b in go.products(dl, go.weight_rows(start, stop)):
                accumulate_mm(dh, a, b)
        if need_dw:
            out = dw[start:stop] if dw is not None else dw_acc[start:stop]
            for i, (a, b) in enumerate(go.products(dl.t(), go.hidden_parts)):
                accumulate_product(out, a, b, first=dw is not None and i == 0)
    return dh, dw
