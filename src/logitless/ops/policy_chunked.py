"""The fused policy-loss pass in pure torch (any device): the "chunked" and "reference" backends.

Per chunk of c token rows: the float32 logits [c, V] of the whole (local) vocabulary, their statistics,
the loss gradients from ``combine``, the dlogits in place of the logits, then dh and dw from them; see
``policy.py``. "chunked" sizes c so that [c, V] holds LOGITLESS_CHUNK_ELEMENTS float32 logits (the
fused_logprobs chunked backend's knob; by default at least MIN_ROWS tokens); "reference" takes every token
at once.

d_weight of half-precision weights is accumulated in a float32 [V, H] buffer and rounded once at the end
(CPU chunks are small, so a rounding per chunk would add up); this backend is the portable path, the
triton one accumulates in the gradient buffer itself.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import knobs
from .chunked import DEFAULT_CHUNK_ELEMENTS
from .maths import (
    block_scratch,
    dlogits_in_blocks,
    ieee_fp32,
    label_logits,
    mm_fp32,
    one_thread_on_cpu,
    row_blocks,
)
from .policy_parts import Combine, SetDlogits, accumulate_product
from .precision import GradOperands

# Fewest token rows per chunk by default (an explicit LOGITLESS_CHUNK_ELEMENTS is obeyed): the three
# products of a chunk have c as a dimension, and thin ones run far below the BLAS's rate (CPU, N1024 H512
# V32000: the 65-row chunks of the 8 MiB budget; benchmarks/DESIGN.md). 256 rows of V = 151936 are
# 156 MiB of float32 logits.
MIN_ROWS = 256


def _chunk_rows(n: int, vocab: int, device: torch.device) -> int:
    default = max(DEFAULT_CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"], MIN_ROWS * vocab)
    return max(1, min(n, knobs.chunk_elements(default) // vocab))


def shifted_statistics(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(m, lse, ent) [c] of the float32 logits z [c, V], which become x = z - m in place (m the row max); the
    distillation pass's statistics of the student (``distill_chunked``).

    One exponential per element: with e = exp(x), s = sum e and t = sum e * x, lse = m + log s and
    entropy = log s - t / s."""
    m = z.amax(dim=1)
    x = z.sub_(m.unsqueeze(1))
    e = x.exp()
    s = e.sum(dim=1)
    t = e.mul_(x).sum(dim=1)
    log_s = s.log()
    return m, m + log_s, log_s - t / s


def _statistics(z: Tensor, labels: Tensor, inv_temp: Tensor, scratch: Tensor, blocks) -> tuple[Tensor, ...]:
    """(zy, m, lse, ent) [c] of the tempered logits z * inv_temp, from the float32 products z [c, V], which
    become x = z * inv_temp - m in place (m the row max), block by block.

    One exponential per element: with e = exp(x), s = sum e and t = sum e * x, lse = m + log s and
    entropy = log s - t / s (the gradient stage takes its own exp of x - log s)."""
    c, vocab = z.shape
    zy, m, s, t = torch.empty((4, c), dtype=torch.float32, device=z.device)
    with one_thread_on_cpu(z.device):
        for r0, r1 in blocks:
            zb = z[r0:r1].mul_(inv_temp[r0:r1].unsqueeze(1))
            zy[r0:r1] = label_logits(zb, labels[r0:r1])
            mb = torch.amax(zb, dim=1, out=m[r0:r1])
            xb = zb.sub_(mb.unsqueeze(1))
            e = torch.exp(xb, out=scratch[:(r1 - r0) * vocab].view(r1 - r0, vocab))
            torch.sum(e, dim=1, out=s[r0:r1])
            torch.sum(e.mul_(xb), dim=1, out=t[r0:r1])
        log_s = s.log()
        return zy, m, m + log_s, log_s - t / s


def max_chunk_rows(n: int, plan_vocab: int, dtype: torch.dtype, device: torch.device, longest: int = 1) -> int:
    """The most token rows one chunk of ``policy_pass`` may hold (``bounds`` are cut to it). The chunk does not
    grow for a longer group of tokens (``longest``): its float32 logits and their temporaries cost 8-12 bytes a
    logit, so a sequence longer than the budget's rows takes the two-pass path."""
    return _chunk_rows(n, plan_vocab, device)


def policy_pass(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, combine: Combine,
                dh: Optional[Tensor], dw: Optional[Tensor], plan_vocab: Optional[int] = None,
                rows_per_chunk: Optional[int] = None, bounds: Optional[list] = None,
                grad_operands: Optional[GradOperands] = None, set_dlogits: Optional[SetDlogits] = None) -> None:
    """See ``policy_parts.py``. plan_vocab: the largest vocabulary shard of the tensor-parallel group (every
    rank must cut the same chunks; None: this weight's). rows_per_chunk: None for the knob's budget.
    bounds: the chunks' boundaries [0, ..., n] (each chunk at most ``max_chunk_rows``), None for even chunks.
    grad_operands: the gradient products of a precision's statistics operands (``ops/precision.py``).
    set_dlogits: ``policy_parts.SetDlogits`` (None: the dlogits as formed)."""
    n = hidden.shape[0]
    step = rows_per_chunk or _chunk_rows(n, plan_vocab or weight.shape[0], hidden.device)
    if bounds is None:
        bounds = list(range(0, n, step)) + [n]
    acc = dw
    if dw is not None and dw.dtype != torch.float32:
        acc = torch.empty(dw.shape, dtype=torch.float32, device=dw.device)
    vocab = weight.shape[0]
    most = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    # the row blocks' scratch, once a pass (a fresh large tensor per chunk would fault its pages in on CPU)
    scratch = block_scratch(most, vocab, hidden.device)
    # half-precision inputs on CUDA: tensor-core GEMMs in the inputs' dtype, as the chunked fused_logprobs
    # backward does; elsewhere float32 dlogits
    go = grad_operands or GradOperands.plain(
        hidden, weight, hidden.dtype if hidden.is_cuda and hidden.dtype != torch.float32 else torch.float32)
    # float32 operands: every chunk's products in one buffer (a fresh tile a chunk is, on CPU, a fresh mapping when
    # it reaches glibc's 32 MiB mmap threshold, its pages faulting in)
    tile = torch.empty(most * vocab, dtype=torch.float32, device=hidden.device) \
        if hidden.dtype == weight.dtype == torch.float32 else None
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        h = hidden[start:stop]
        it = inv_temp[start:stop]
        lab = labels[start:stop]
        blocks = row_blocks(stop - start, vocab, hidden.device)
        if tile is None:
            z = mm_fp32(h, weight.t())
        else:
            z = tile[:(stop - start) * vocab].view(stop - start, vocab)
            with ieee_fp32(h):
                torch.mm(h, weight.t(), out=z)
        # on CPU everything between the products on one thread (``one_thread_on_cpu``): the terms' small
        # exponentials and logarithms too, which MKL's vector maths would otherwise hand to torch's threads (on a
        # busy machine, each such call waited milliseconds for the second thread)
        with one_thread_on_cpu(hidden.device):
            zy, m, lse, ent = _statistics(z, lab, it, scratch, blocks)        # z now holds z * it - m
            lse, ent, g_lp, g_ent = combine(start, stop, lse, ent, zy)
            if dh is None and dw is None:
                continue
            dz = dlogits_in_blocks(z, lab, it, lse - m, ent, g_lp, g_ent, scratch, blocks)
            if set_dlogits is not None:
                set_dlogits(start, stop, dz)
        if dh is not None:
            for i, (a, b) in enumerate(go.products(dz, go.weight_parts)):
                accumulate_product(dh[start:stop], a, b, first=i == 0)
        if acc is not None:
            h_parts = go.rows(slice(start, stop)).hidden_parts
            for i, (a, b) in enumerate(go.products(dz.t(), h_parts)):
                accumulate_product(acc, a, b, first=start == 0 and i == 0)
    if acc is not None and acc is not dw:
        dw.copy_(acc)


def max_chunk_rows_whole(n: int, plan_vocab: int, dtype: torch.dtype, device: torch.device, longest: int = 1) -> int:
    return max(1, n)


def policy_pass_whole(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, combine: Combine,
                      dh: Optional[Tensor], dw: Optional[Tensor], plan_vocab: Optional[int] = None,
                      bounds: Optional[list] = None, grad_operands: Optional[GradOperands] = None,
                      set_dlogits: Optional[SetDlogits] = None) -> None:
    """The "reference" backend: one chunk of every token (float32 logits [n, V]); ``bounds`` (any cut of
    the tokens) are all inside it."""
    policy_pass(hidden, weight, labels, inv_temp, combine, dh, dw, rows_per_chunk=max(1, hidden.shape[0]),
                grad_operands=grad_operands, set_dlogits=set_dlogits)
