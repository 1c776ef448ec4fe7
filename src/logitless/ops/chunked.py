"""The chunked backend: pure torch, any device.

The vocabulary is streamed in chunks of rows of ``weight``; each chunk's float32 logits
[T, chunk] are folded into per-token running statistics (online logsumexp) and dropped. On CPU the forward's
chunks have one width for every batch (``stats_columns``), so a token's bits depend on the batch only through
the BLAS and torch's reductions (docs/determinism.md); on CUDA by default the width is the budget over N
(LOGITLESS_CHUNKED_COLUMNS chooses).
Backward recomputes each chunk and produces that chunk's d_weight rows whole, while d_hidden
is accumulated in float32. One call takes at most T = LOGITLESS_CHUNK_ELEMENTS / 1024 tokens
(``token_rows``); ``ops/token_chunks.py`` feeds it larger inputs in chunks of T tokens. Peak extra
memory per call: one [T, chunk] tile (a few of them in flight) and the float32 d_hidden [T, H].
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import knobs
from .maths import (
    accumulate_mm,
    accumulate_product,
    apply_softcap_derivative,
    block_scratch,
    dlogits_in_blocks,
    label_logits,
    logits_from_products,
    mm_fp32,
    row_blocks,
)
from .precision import GradOperands

name = "chunked"

# Elements of one float32 logits chunk; override with LOGITLESS_CHUNK_ELEMENTS.
# CUDA: 64 MiB keeps the GEMMs large; the caching allocator recycles the tiles.
# CPU: 8 MiB. Larger tiles exceed glibc's mmap threshold, so every temporary is a fresh mapping whose
# pages fault in on first touch (measured: 1.59x the 4-GEMM floor at 64 MiB, 1.08-1.15x at 4-8 MiB).
DEFAULT_CHUNK_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 21}

# Where the forward cuts the vocabulary (LOGITLESS_CHUNKED_COLUMNS=auto): "fixed", at the same columns for every
# batch; "batch", the budget over N (wider products, so fewer and larger GEMMs, for small batches).
DEFAULT_COLUMNS = {"cuda": "batch", "cpu": "fixed"}


def unavailable_reason(hidden: Tensor, weight: Tensor) -> Optional[str]:
    return None


# A tile keeps at least this many vocabulary columns: more tokens than budget / MIN_COLUMNS are taken in
# token chunks, so the products stay wide enough for the BLAS (an [N, 16] tile at N = 1M would not be).
MIN_COLUMNS = 1024


def _tile_budget(device: torch.device) -> int:
    return knobs.chunk_elements(DEFAULT_CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"])


def chunk_rows(n_tokens: int, vocab: int, device: torch.device) -> int:
    """Vocabulary rows per chunk, so that one float32 [n_tokens, rows] tile fits the budget."""
    return max(1, min(vocab, _tile_budget(device) // max(n_tokens, 1)))


def _max_tokens(device: torch.device) -> int:
    return max(1, _tile_budget(device) // MIN_COLUMNS)


def stats_columns(n_tokens: int, vocab: int, device: torch.device) -> int:
    """Vocabulary rows per forward chunk. "fixed" columns (CPU's default): a function of the vocabulary and the
    budget alone (the budget over the most tokens of a call, ``token_rows``: MIN_COLUMNS by default), so a token's
    online logsumexp rescales at the same columns in every batch and its bits depend on the batch only through the
    BLAS and the row reductions (docs/determinism.md). "batch" columns (CUDA's default): the budget over N
    (``chunk_rows``), wider products for small batches. LOGITLESS_CHUNKED_COLUMNS overrides the device's rule."""
    rule = knobs.chunked_columns()
    if rule == "auto":
        rule = DEFAULT_COLUMNS["cuda" if device.type == "cuda" else "cpu"]
    if rule == "batch":
        return chunk_rows(n_tokens, vocab, device)
    return max(1, min(vocab, _tile_budget(device) // _max_tokens(device)))


def token_rows(stage: str, hidden: Tensor, weight: Tensor, with_entropy: bool) -> int:
    """Most tokens per call, both stages: the tile budget over MIN_COLUMNS (2^24 / 1024 = 16384 on CUDA,
    2048 on CPU by default). Depends on the device only, as the backward's chunking must (contract.py)."""
    return _max_tokens(hidden.device)


def _chunks(vocab: int, step: int):
    for start in range(0, vocab, step):
        yield start, min(start + step, vocab)


def _local_labels(labels: Tensor, start: int, stop: int) -> Tensor:
    inside = (labels >= start) & (labels < stop)
    return torch.where(inside, labels - start, torch.full_like(labels, -1))


def stats(hidden, weight, labels, inv_temp, with_entropy, softcap=None):
    n, vocab = hidden.shape[0], weight.shape[0]
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
    s = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    t = torch.zeros_like(s) if with_entropy else None   # sum_j exp(z_j - m) * (z_j - m)
    zy = torch.zeros_like(s)
    for start, stop in _chunks(vocab, stats_columns(n, vocab, hidden.device)):
        z, _ = logits_from_products(mm_fp32(hidden, weight[start:stop].t()), inv_temp, softcap)
        m_new = torch.maximum(m, z.amax(dim=1))
        rescale = torch.exp(m - m_new)          # exp(-inf) = 0 on the first chunk
        zy += label_logits(z, _local_labels(labels, start, stop))
        x = z.sub_(m_new.unsqueeze(1))      # z - m_new, in place
        e = x.exp()
        e_sum = e.sum(dim=1)
        if t is not None:
            # re-centre the old sum on the new max: sum e_old' (z - m_new) = rescale * (t + s * (m - m_new))
            shift = torch.where(torch.isfinite(m), m - m_new, torch.zeros_like(m))
            t.add_(s * shift).mul_(rescale).add_(e.mul_(x).sum(dim=1))     # e * x in place: no temporary
        s.mul_(rescale).add_(e_sum)
        m = m_new
    log_s = torch.log(s)
    lse = m + log_s
    ent = log_s - t / s if t is not None else None
    return lse, ent, zy


def grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw, softcap=None, dw_acc=None,
          grad_operands=None):
    n, vocab = hidden.shape[0], weight.shape[0]
    # half-precision GEMMs on the tensor cores (fp32 accumulation); a float32 dz would force fp32 GEMMs ~9x
    # slower. Rounding dlogits to the input dtype costs ~3e-3 relative in grads. Elsewhere dz stays float32.
    go = grad_operands or GradOperands.plain(
        hidden, weight, hidden.dtype if hidden.is_cuda and hidden.dtype != torch.float32 else torch.float32)
    dh = torch.zeros((n, go.hidden_size), dtype=torch.float32, device=hidden.device) if need_dh else None
    dw = None
    if need_dw and dw_acc is None:
        dw = torch.empty((vocab, go.hidden_size), dtype=go.out_dtype, device=weight.device)
    step = chunk_rows(n, vocab, hidden.device)
    # the row blocks' scratch of the dlogits, once a call (CPU: a block of the [N, step] tile stays in L2)
    blocks = row_blocks(n, step, hidden.device)
    scratch = block_scratch(n, step, hidden.device)
    for start, stop in _chunks(vocab, step):
        w = weight[start:stop]
        # with a softcap, t = tanh(raw / softcap) is a second [N, chunk] tile, for the derivative of the cap
        z, t = logits_from_products(mm_fp32(hidden, w.t()), inv_temp, softcap, keep_tanh=True)
        if stop - start != step:
            blocks = row_blocks(n, stop - start, hidden.device)
        dz = dlogits_in_blocks(z, _local_labels(labels, start, stop), inv_temp, lse, ent, g_lp, g_ent, scratch,
                               blocks)
        dz = apply_softcap_derivative(dz, t)
        if dh is not None:
            for a, b in go.products(dz, [p[start:stop] for p in go.weight_parts]):
                accumulate_mm(dh, a, b)
        if need_dw:
            out = dw[start:stop] if dw is not None else dw_acc[start:stop]
            for i, (a, b) in enumerate(go.products(dz.t(), go.hidden_parts)):
                accumulate_product(out, a, b, first=dw is not None and i == 0)
    return dh, dw
