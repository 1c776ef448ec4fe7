"""The combine over vocabulary tiles: per-token lse and entropy from the per-tile statistics, in one kernel.

Input: the [vocab tiles, N] float32 workspaces of the statistics kernels (``forward_stats``,
``policy_stats``): per token and tile the tile max m_i, s_i = sum e^(z - m_i) and t_i = sum e^(z - m_i) (z - m_i).
With M = max_i m_i (an exact float32 value: no rounding enters the shift),

    S = sum_i s_i e^(m_i - M),   T = sum_i e^(m_i - M) (t_i + (m_i - M) s_i),
    lse = M + log S,             entropy = log S - T / S,

every term relative to M, so no large terms cancel whatever the logits' magnitude. One program per block of
tokens walks the tiles twice (the max, then the sums); the inputs are only read (the policy loss still needs
the tile maxima afterwards). Replaces a dozen torch reductions and elementwise kernels over [tiles, N]
whose launch latency, not their bytes, was their cost (H200, 9344 tokens at V = 151936: 96 us against 152 us;
benchmarks/results/gpu-policy-loss-2026-12-03.md).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRETING, LN2, LOG2E

# tokens per program (contiguous float32 in each tile's row), and the most vocabulary tiles read in one step:
# hundreds of tiles are loaded at once, so the kernel waits on memory a few times per pass rather than once
# per 32 tiles (the H200 measured 64 us a 4096-token chunk at V = 151936 for 32 tokens x 32 tiles a step)
TOKENS = 16 if INTERPRETING else 8
MAX_TILE_ROWS = 8 if INTERPRETING else 512
WARPS = 8


@triton.jit
def _tile_block(step, n, n_tiles, cols, col_ok, TILE_ROWS: tl.constexpr):
    """(mask, offsets) of the [TILE_ROWS tiles, TOKENS] block of step ``step`` in a [n_tiles, n] workspace."""
    tiles = step * TILE_ROWS + tl.arange(0, TILE_ROWS)
    ok = (tiles < n_tiles)[:, None] & col_ok[None, :]
    return ok, tiles.to(tl.int64)[:, None] * n + cols[None, :]


# n and n_tiles are not specialised: triton would otherwise compile one kernel for n = 1, one for n % 16 == 0 and
# one for the rest, and the block's layout (which threads hold which tiles, hence the order in which a token's
# tiles are summed) differs between them: a token's lse and entropy would depend on how many tokens share its
# call (docs/determinism.md). One build per vocabulary size instead, for every batch.
@triton.jit(do_not_specialize=["n", "n_tiles"])
def _combine_kernel(part_m_ptr, part_s_ptr, part_t_ptr, lse_ptr, ent_ptr, n, n_tiles,
                    WITH_T: tl.constexpr, STEPS: tl.constexpr, TOKENS: tl.constexpr, TILE_ROWS: tl.constexpr):
    cols = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    col_ok = cols < n
    big = tl.full((TOKENS,), float("-inf"), tl.float32)
    for step in range(STEPS):
        ok, offs = _tile_block(step, n, n_tiles, cols, col_ok, TILE_ROWS)
        m = tl.load(part_m_ptr + offs, mask=ok, other=float("-inf"))
        big = tl.maximum(big, tl.max(m, axis=0))
    big = tl.where(col_ok, big, 0.0)     # padding columns: finite, never stored
    total = tl.zeros((TOKENS,), tl.float32)
    t_sum = tl.zeros((TOKENS,), tl.float32)
    for step in range(STEPS):
        ok, offs = _tile_block(step, n, n_tiles, cols, col_ok, TILE_ROWS)
        shift = tl.load(part_m_ptr + offs, mask=ok, other=float("-inf")) - big[None, :]   # m_i - M <= 0
        w = tl.exp2(shift * LOG2E)                                                        # 0 where masked
        s = tl.load(part_s_ptr + offs, mask=ok, other=0.0)
        total += tl.sum(s * w, axis=0)
        if WITH_T:
            t = tl.load(part_t_ptr + offs, mask=ok, other=0.0)
            # masked entries: w = 0, and shift -inf is kept out of the product (0 * -inf)
            t_sum += tl.sum(w * (t + tl.where(ok, shift, 0.0) * s), axis=0)
    # S >= 1 exactly (the max tile's own max term is e^0); its float32 sum can land an ulp under 1, which
    # would put lse under the label's logit for a near-certain token: clamp
    total = tl.where(col_ok, total, 1.0)     # padding columns: no log of 0
    log_total = tl.maximum(tl.log2(total) * LN2, 0.0)
    tl.store(lse_ptr + cols, big + log_total, mask=col_ok)
    if WITH_T:
        tl.store(ent_ptr + cols, log_total - t_sum / total, mask=col_ok)


def combine_tiles(part_m: Tensor, part_s: Tensor, part_t: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """(lse, entropy or None) float32 [N] from the contiguous float32 [n_tiles, N] statistics (part_t None:
    no entropy). The inputs are left as they are."""
    n_tiles, n = part_m.shape
    lse = torch.empty(n, dtype=torch.float32, device=part_m.device)
    ent = torch.empty_like(lse) if part_t is not None else None
    if n == 0:
        return lse, ent
    tile_rows = min(triton.next_power_of_2(n_tiles), MAX_TILE_ROWS)
    steps = triton.cdiv(n_tiles, tile_rows)    # compile-time trip count: one build per vocabulary size
    _combine_kernel[(triton.cdiv(n, TOKENS),)](
        part_m, part_s, part_t if part_t is not None else part_s, lse, ent if ent is not None else lse,
        n, n_tiles, WITH_T=part_t is not None, STEPS=steps, TOKENS=TOKENS, TILE_ROWS=tile_rows, num_warps=WARPS)
    return lse, ent
