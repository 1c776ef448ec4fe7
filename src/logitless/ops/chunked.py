"""The chunked backend: pure torch, any device.

The vocabulary is streamed in chunks of rows of ``weight``; each chunk's float32 logits
[T, chunk] are folded into per-token running statistics (online logsumexp) and dropped. On CPU the forward's
chunks have one width for every batch (``stats_columns``), so a token's bits depend on the batch only through
the BLAS and torch's reductions (docs/determinism.md); on CUDA by default the width is the budget over N
(LOGITLESS_CHUNKED_COLUMNS chooses).
Backward recomputes each chunk and produces that chunk's d_weight rows whole, while d_hidden
is accumulated in float32. One call takes at most T = (the tile budget) / (its fewest columns) tokens
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
    logits_from_products,
    mm_fp32,
    one_thread_on_cpu,
    product_into,
    row_blocks,
)
from .precision import GradOperands

name = "chunked"

# Elements of one float32 logits chunk; override with LOGITLESS_CHUNK_ELEMENTS.
# CUDA: 64 MiB keeps the GEMMs large; the caching allocator recycles the tiles.
# CPU: 32 MiB, in one buffer a call (``stats``, ``grads``: never a fresh tile a chunk, whose pages would fault in),
# so that few and wide products run: each product on torch's threads ends in a join, and on a machine busy with
# other work a join waits for a descheduled thread (benchmarks/DESIGN.md: at N1024 H512 V32000, 8192 columns a
# product against 1024, the forward 1.86x the GEMM against 4.07x on 2 loaded cores; 1.25x against 1.15x of CPU
# time on one thread).
DEFAULT_CHUNK_ELEMENTS = {"cuda": 1 << 24, "cpu": 1 << 23}

# Where the forward cuts the vocabulary (LOGITLESS_CHUNKED_COLUMNS=auto): "fixed", at the same columns for every
# batch; "batch", the budget over N (wider products, so fewer and larger GEMMs, for small batches).
DEFAULT_COLUMNS = {"cuda": "batch", "cpu": "fixed"}


def unavailable_reason(hidden: Tensor, weight: Tensor) -> Optional[str]:
    return None


# A tile keeps at least this many vocabulary columns: more tokens than budget / MIN_COLUMNS are taken in
# token chunks, so the products stay wide enough for the BLAS (an [N, 16] tile at N = 1M would not be).
# Under the default budget CPU tiles keep 8192 (calls of at most 1024 tokens; see DEFAULT_CHUNK_ELEMENTS); an
# explicit LOGITLESS_CHUNK_ELEMENTS keeps MIN_COLUMNS on every device.
MIN_COLUMNS = 1024
DEFAULT_MIN_COLUMNS = {"cuda": MIN_COLUMNS, "cpu": 8192}


def _kind(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def _tile_budget(device: torch.device) -> int:
    return knobs.chunk_elements(DEFAULT_CHUNK_ELEMENTS[_kind(device)])


def _min_columns(device: torch.device) -> int:
    return MIN_COLUMNS if knobs.chunk_elements(None) is not None else DEFAULT_MIN_COLUMNS[_kind(device)]


def chunk_rows(n_tokens: int, vocab: int, device: torch.device) -> int:
    """Vocabulary rows per chunk, so that one float32 [n_tokens, rows] tile fits the budget."""
    return max(1, min(vocab, _tile_budget(device) // max(n_tokens, 1)))


def _max_tokens(device: torch.device) -> int:
    return max(1, _tile_budget(device) // _min_columns(device))


def stats_columns(n_tokens: int, vocab: int, device: torch.device) -> int:
    """Vocabulary rows per forward chunk. "fixed" columns (CPU's default): a function of the vocabulary and the
    budget alone (the budget over the most tokens of a call, ``token_rows``: 1024 on CUDA and 8192 on CPU by default),
    so a token's
    online logsumexp rescales at the same columns in every batch and its bits depend on the batch only through the
    BLAS and the row reductions (docs/determinism.md). "batch" columns (CUDA's default): the budget over N
    (``chunk_rows``), wider products for small batches. LOGITLESS_CHUNKED_COLUMNS overrides the device's rule."""
    rule = knobs.chunked_columns()
    if rule == "auto":
        rule = DEFAULT_COLUMNS[_kind(device)]
    if rule == "batch":
        return chunk_rows(n_tokens, vocab, device)
    return max(1, min(vocab, _tile_budget(device) // _max_tokens(device)))


def token_rows(stage: str, hidden: Tensor, weight: Tensor, with_entropy: bool) -> int:
    """Most tokens per call, both stages: the tile budget over its fewest columns (2^24 / 1024 = 16384 on CUDA,
    2^23 / 8192 = 1024 on CPU by default; budget / MIN_COLUMNS for an explicit budget). Depends on the device
    only, as the backward's chunking must (contract.py)."""
    return _max_tokens(hidden.device)


def _chunks(vocab: int, step: int):
    for start in range(0, vocab, step):
        yield start, min(start + step, vocab)


def _local_labels(labels: Tensor, start: int, stop: int) -> Tensor:
    inside = (labels >= start) & (labels < stop)
    return torch.where(inside, labels - start, torch.full_like(labels, -1))


def _chunk_stats(raw: Tensor, labels: Tensor, inv_temp: Tensor, softcap: Optional[float], with_entropy: bool,
                 out: Tensor, zy: Tensor, scratch: Tensor, blocks) -> None:
    """One vocabulary chunk's statistics, block by block (``row_blocks``: on CPU a block and its scratch stay in L2
    from one operation to the next, so the chunk's products are read from memory about once, not once an
    operation): out[0] = mc, the row max of the chunk's logits z; out[1] = sc = sum exp(z - mc); out[2] =
    tc = sum exp(z - mc) * (z - mc) (with_entropy). ``raw`` [c, C] (float32 products) becomes z - mc in place;
    zy takes z at the label where ``labels`` (this chunk's columns, -1: not here) has one."""
    vocab = raw.shape[1]
    has = labels >= 0
    cols = torch.where(has, labels, torch.zeros_like(labels)).unsqueeze(1)
    picked = torch.empty_like(zy)
    mc, sc, tc = out
    with one_thread_on_cpu(raw.device):
        for r0, r1 in blocks:
            zb, _ = logits_from_products(raw[r0:r1], inv_temp[r0:r1], softcap)
            torch.gather(zb, 1, cols[r0:r1], out=picked[r0:r1].unsqueeze(1))
            mb = torch.amax(zb, dim=1, out=mc[r0:r1])
            xb = zb.sub_(mb.unsqueeze(1))
            e = torch.exp(xb, out=scratch[:(r1 - r0) * vocab].view(r1 - r0, vocab))
            torch.sum(e, dim=1, out=sc[r0:r1])
            if with_entropy:
                torch.sum(e.mul_(xb), dim=1, out=tc[r0:r1])
    torch.where(has, picked, zy, out=zy)


def stats(hidden, weight, labels, inv_temp, with_entropy, softcap=None):
    """The online logsumexp over the vocabulary chunks of ``stats_columns``: each chunk's statistics relative to its
    own row max (``_chunk_stats``), merged into the running ones relative to the running max m:
        s = s * exp(m - m') + sc * exp(mc - m'),
        t = exp(m - m') * (t + s (m - m')) + exp(mc - m') * (tc + sc (mc - m'))     (m' = max(m, mc))."""
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    step = stats_columns(n, vocab, dev)
    # the chunk's products land in one buffer for every chunk (a fresh [n, step] tile a chunk would, on CPU,
    # often be a fresh mapping whose pages fault in), and its blocks' scratch
    tile = torch.empty(n * step, dtype=torch.float32, device=dev)
    scratch = block_scratch(n, step, dev)
    blocks = row_blocks(n, step, dev)
    part = torch.empty((3, n), dtype=torch.float32, device=dev)
    zy = torch.zeros(n, dtype=torch.float32, device=dev)
    m = s = t = None
    for start, stop in _chunks(vocab, step):
        raw = tile[:n * (stop - start)].view(n, stop - start)
        product_into(raw, hidden, weight[start:stop].t())
        if stop - start != step:
            blocks = row_blocks(n, stop - start, dev)
        # between the products, on one thread (CPU): the merge's small exponentials too, which MKL's vector maths
        # would otherwise hand to torch's threads (a wait for the second thread on a busy machine)
        with one_thread_on_cpu(dev):
            _chunk_stats(raw, _local_labels(labels, start, stop), inv_temp, softcap, with_entropy, part, zy, scratch,
                         blocks)
            mc, sc, tc = part
            if m is None:           # the first chunk: its statistics are the running ones
                m, s, t = mc.clone(), sc.clone(), tc.clone() if with_entropy else None
                continue
            m_new = torch.maximum(m, mc)
            d_old, d_new = m - m_new, mc - m_new            # <= 0, one of them 0
            a, b = d_old.exp(), d_new.exp()
            if with_entropy:
                # re-centre both sums on the new max: sum e' (z - m') = exp(m - m') * (t + s * (m - m'))
                t.addcmul_(s, d_old).mul_(a).add_(tc.addcmul_(sc, d_new).mul_(b))
            s.mul_(a).add_(sc.mul_(b))
            m = m_new
    with one_thread_on_cpu(dev):
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
    # the row blocks' scratch of the dlogits, once a call (CPU: a block of the [N, step] tile stays in L2), and
    # one buffer for every chunk's products (without a softcap)
    blocks = row_blocks(n, step, hidden.device)
    scratch = block_scratch(n, step, hidden.device)
    tile = torch.empty(n * step, dtype=torch.float32, device=hidden.device) if softcap is None else None
    for start, stop in _chunks(vocab, step):
        w = weight[start:stop]
        if stop - start != step:
            blocks = row_blocks(n, stop - start, hidden.device)
        if softcap is None:
            # the products times inv_temp inside the blocks (``prescale``), while each block is in cache
            z, t, prescale = tile[:n * (stop - start)].view(n, stop - start), None, inv_temp
            product_into(z, hidden, w.t())
        else:
            # t = tanh(raw / softcap) is a second [N, chunk] tile, for the derivative of the cap
            (z, t), prescale = logits_from_products(mm_fp32(hidden, w.t()), inv_temp, softcap, keep_tanh=True), None
        dz = dlogits_in_blocks(z, _local_labels(labels, start, stop), inv_temp, lse, ent, g_lp, g_ent, scratch,
                               blocks, prescale)
        dz = apply_softcap_derivative(dz, t)
        if dh is not None:
            for a, b in go.products(dz, [p[start:stop] for p in go.weight_parts]):
                accumulate_mm(dh, a, b)
        if need_dw:
            out = dw[start:stop] if dw is not None else dw_acc[start:stop]
            for i, (a, b) in enumerate(go.products(dz.t(), go.hidden_parts)):
                accumulate_product(out, a, b, first=dw is not None and i == 0)
    return dh, dw
