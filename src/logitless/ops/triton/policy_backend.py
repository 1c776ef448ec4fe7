"""The triton backend of the fused policy-loss pass (contract: ``logitless.ops.policy_parts``): three GEMMs.

Per chunk of c token rows (c from LOGITLESS_POLICY_WORKSPACE_BYTES, a multiple of the token tile):
1. ``policy_stats``: one Triton GEMM pass over the vocabulary; its epilogue writes per-(token, tile)
   statistics, the label's logit, and e = exp(z - tile max) into the [c, V] workspace (never the logits);
2. ``combine_tiles`` (one kernel) + the caller's ``combine``: lse, entropy, log-prob (exact float32, as
   fused_logprobs), the per-token loss terms and their gradients (one more kernel, ``policy_terms``; tensor
   parallelism: one all-gather of three floats per token and rank here);
3. ``policy_dlogits``: e -> dlogits in place (memory-bound, one read and one write per element);
4. cuBLAS: dh[chunk] = dlogits @ weight, written once (a token's whole vocabulary is in its chunk), and
   dw += dlogits.T @ hidden[chunk], accumulated in the gradient buffer (beta = 1: one rounding to its
   dtype per chunk) or, with LOGITLESS_POLICY_DW_FP32=1, in a float32 buffer rounded once at the end.

Memory besides the gradient buffers: the workspace (1.25 GiB by default; for chunks cut at sequence boundaries,
grown to the longest sequence up to LOGITLESS_POLICY_WORKSPACE_MAX_BYTES, ``max_chunk_rows``) and the statistics
(12 bytes per token and vocabulary tile of a chunk).
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import triton
from torch import Tensor

from ... import knobs
from ..policy_parts import Combine, SetDlogits, accumulate_product, balanced_chunks, product_into
from ..precision import GradOperands
from .backend import unavailable_reason  # noqa: F401  (the same rule as fused_logprobs' triton backend)
from .combine import combine_tiles
from .common import choose_tiles, on_device
from .policy_dlogits import dlogits_in_place
from .policy_stats import chunk_stats

# 1.25 GiB: 4096-token chunks at V = 131072 to 151936 (one group of 32 token tiles; fewer, larger GEMMs)
DEFAULT_WORKSPACE_BYTES = 5 << 28
ROW_ALIGN = 64        # workspace rows start 128-byte aligned (float16): aligned vector stores, cuBLAS-friendly
# rows per chunk when no gradient is wanted: only the statistics, 12 bytes per token and tile
STATS_ONLY_BYTES = 1 << 28


def workspace_dtype(dtype: torch.dtype) -> torch.dtype:
    """e lies in (0, 1]: float16 keeps 3 more bits there than bfloat16; float32 inputs stay float32."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def row_stride(vocab: int) -> int:
    return -(-vocab // ROW_ALIGN) * ROW_ALIGN


def chunk_rows(n: int, plan_vocab: int, dtype: torch.dtype, block_m: int, block_n: int, with_grad: bool) -> int:
    """Token rows per chunk for a vocabulary (shard) of ``plan_vocab`` rows: the workspace budget over
    the bytes of one workspace row, balanced across chunks, a multiple of the token tile."""
    if with_grad:
        per_row = row_stride(plan_vocab) * workspace_dtype(dtype).itemsize
        budget = knobs.policy_workspace_bytes(DEFAULT_WORKSPACE_BYTES)
    else:
        per_row = 12 * triton.cdiv(plan_vocab, block_n)
        budget = STATS_ONLY_BYTES
    return balanced_chunks(n, max(block_m, budget // per_row), block_m)


def max_chunk_rows(n: int, plan_vocab: int, dtype: torch.dtype, device: torch.device, longest: int = 1) -> int:
    """The most token rows one chunk (with gradients) may hold, for groups of tokens (sequences) that must stay
    whole, the longest of ``longest`` rows: the workspace budget's rows (unbalanced) or, when the longest group
    is more than that, its length, if its workspace fits LOGITLESS_POLICY_WORKSPACE_MAX_BYTES (default twice the
    budget: 2.5 GiB, 8833 tokens at V = 151936 in half precision). Otherwise the budget's rows, which the longest
    group exceeds (the caller then takes the two-pass path)."""
    tiles = choose_tiles("POLICY", dtype, device)
    per_row = row_stride(plan_vocab) * workspace_dtype(dtype).itemsize
    budget = knobs.policy_workspace_bytes(DEFAULT_WORKSPACE_BYTES)
    rows = max(tiles.block_m, budget // per_row)
    if longest > rows and longest * per_row <= knobs.policy_workspace_max_bytes(2 * budget):
        return longest
    return rows


def policy_pass(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, combine: Combine,
                dh: Optional[Tensor], dw: Optional[Tensor], plan_vocab: Optional[int] = None,
                bounds: Optional[list] = None, grad_operands: Optional[GradOperands] = None,
                set_dlogits: Optional[SetDlogits] = None, stats_stage: Optional[StatsStage] = None) -> None:
    """See ``logitless.ops.policy_parts`` (``set_dlogits`` too; ``stats_stage``: ``StatsStage``). plan_vocab:
    the largest vocabulary shard of the tensor-parallel group (every rank must cut the same chunks); None: this
    weight's. bounds: the chunks' boundaries [0, ..., n], each chunk at most ``max_chunk_rows`` rows; None:
    balanced chunks. grad_operands: the gradient products of a precision's statistics operands
    (``ops/precision.py``); None: of hidden and weight."""
    with on_device(hidden):
        _policy_pass(hidden, weight, labels, inv_temp, combine, dh, dw, plan_vocab or weight.shape[0], bounds,
                     grad_operands or GradOperands.plain(hidden, weight), set_dlogits, stats_stage)


class StatsStage(Protocol):
    """Stage 1 in place of ``chunk_stats`` for a pass with no labels (the top-k distillation's, whose statistics
    come from the selection kernel's GEMM: ``topk_select.select_with_stats``): called as
    stage(start, stop, hidden[start:stop], inv_temp[start:stop], part_m, part_s, part_t, e) to fill what
    ``chunk_stats`` fills but zy; ``block_n``: the width of its statistics' vocabulary tiles."""
    block_n: int

    def __call__(self, start: int, stop: int, hidden: Tensor, inv_temp: Tensor, part_m: Tensor, part_s: Tensor,
                 part_t: Tensor, e: Optional[Tensor]) -> None: ...


def _policy_pass(hidden, weight, labels, inv_temp, combine, dh, dw, plan_vocab, bounds, go, set_dlogits=None,
                 stats_stage=None):
    n = hidden.shape[0]
    vocab = weight.shape[0]
    dev = hidden.device
    tiles = choose_tiles("POLICY", hidden.dtype, dev)
    # the workspace holds e, then the dlogits in place (the same element size): float32 when the products take
    # float32 dlogits, else float16 for e and the products' half dtype for the dlogits
    ws_kind = go.dl_dtype
    with_grad = dh is not None or dw is not None
    block_n = tiles.block_n if stats_stage is None else stats_stage.block_n
    if bounds is None:
        step = chunk_rows(n, plan_vocab, ws_kind, tiles.block_m, block_n, with_grad)
        bounds = list(range(0, n, step)) + [n]
    else:
        step = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    n_tiles = triton.cdiv(vocab, block_n)
    # the three per-tile statistics and the label logits of a chunk, in one allocation
    stats = torch.empty(3 * n_tiles * step + step, dtype=torch.float32, device=dev)
    parts, zy_buf = stats[:3 * n_tiles * step].view(3, -1), stats[3 * n_tiles * step:]
    stride = row_stride(vocab)
    ws = torch.empty(step * stride, dtype=workspace_dtype(ws_kind), device=dev) if with_grad else None
    # the dlogits, in the products' dtype, overwrite e in place (same element size)
    dl_dtype = go.dl_dtype
    ws_dl = None if ws is None else (ws if ws.dtype == dl_dtype else ws.view(dl_dtype))
    acc = dw
    if dw is not None and dw.dtype != torch.float32 and knobs.policy_dw_fp32():
        acc = torch.empty(dw.shape, dtype=torch.float32, device=dev)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        c = stop - start
        h, lab, it = hidden[start:stop], labels[start:stop], inv_temp[start:stop]
        part_m, part_s, part_t = (parts[i, :n_tiles * c].view(n_tiles, c) for i in range(3))
        zy = zy_buf[:c]      # written whole by the statistics kernel
        e = None if ws is None else ws[:c * stride].view(c, stride)[:, :vocab]
        if stats_stage is None:
            chunk_stats(h, weight, lab, it, part_m, part_s, part_t, zy, e)
        else:
            stats_stage(start, stop, h, it, part_m, part_s, part_t, e)
            zy.zero_()      # no labels
        lse, ent = combine_tiles(part_m, part_s, part_t)     # leaves part_m: stage 3 needs the tile maxima
        lse, ent, g_lp, g_ent = combine(start, stop, lse, ent, zy)
        if not with_grad:
            continue
        dl = ws_dl[:c * stride].view(c, stride)[:, :vocab]
        dlogits_in_place(e, dl, part_m, lse, ent, g_lp, g_ent, it, lab, block_n)
        if set_dlogits is not None:
            set_dlogits(start, stop, dl)
        if dh is not None:
            _hidden_gradient(dh[start:stop], dl, go, vocab)
        if acc is not None:
            h_parts = go.rows(slice(start, stop)).hidden_parts
            for i, (a, b) in enumerate(go.products(dl.t(), h_parts)):
                accumulate_product(acc, a, b, first=start == 0 and i == 0)
    if acc is not None and acc is not dw:
        dw.copy_(acc)


def _hidden_gradient(dh: Tensor, dl: Tensor, go: GradOperands, vocab: int) -> None:
    """dh = dl @ weight for one chunk's dlogits dl [c, V], summed over the precision's products and over the
    weight's row blocks (``GradOperands.weight_blocks``: one block, or, for float32 operands split in the kernels,
    blocks whose bfloat16 part is made one at a time and dropped before the next: no [V, H] copy of the weight)."""
    first = True
    for b0, b1 in go.weight_blocks(vocab):
        parts = go.weight_rows(b0, b1)
        for a, b in go.products(dl[:, b0:b1], parts):
            if first:
                product_into(dh, a, b)
            else:
                accumulate_product(dh, a, b, first=False)
            first = False
        del parts, a, b     # this block's parts go before the next block's are made
