"""The fused policy-loss pass in pure torch (any device): the "chunked" and "reference" backends.

Per chunk of c token rows: the float32 logits [c, V] of the whole (local) vocabulary, their statistics,
the loss gradients from ``combine``, the dlogits in place of the logits, then dh and dw from them; see
``policy.py``. "chunked" sizes c so that [c, V] holds LOGITLESS_CHUNK_ELEMENTS float32 logits (the
fused_logprobs chunked backend's budget); "reference" takes every token at once.

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
from .maths import dlogits_from_logits, label_logits, logits_from_products, mm_fp32
from .policy import Combine, accumulate_product, product_into


def _chunk_rows(n: int, vocab: int, device: torch.device) -> int:
    default = DEFAULT_CHUNK_ELEMENTS["cuda" if device.type == "cuda" else "cpu"]
    return max(1, min(n, knobs.chunk_elements(default) // vocab))


def _statistics(z: Tensor) -> tuple[Tensor, Tensor]:
    """lse and entropy [c] of the float32 logits z [c, V] (z is kept: the gradient needs it)."""
    lse = torch.logsumexp(z, dim=1)
    x = z - lse.unsqueeze(1)
    ent = -(x.exp() * x).sum(dim=1)
    return lse, ent


def policy_pass(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, combine: Combine,
                dh: Optional[Tensor], dw: Optional[Tensor], plan_vocab: Optional[int] = None,
                rows_per_chunk: Optional[int] = None) -> None:
    """See ``policy.py``. plan_vocab: the largest vocabulary shard of the tensor-parallel group (every rank
    must cut the same chunks; None: this weight's). rows_per_chunk: None for the knob's budget."""
    n = hidden.shape[0]
    step = rows_per_chunk or _chunk_rows(n, plan_vocab or weight.shape[0], hidden.device)
    acc = dw
    if dw is not None and dw.dtype != torch.float32:
        acc = torch.empty(dw.shape, dtype=torch.float32, device=dw.device)
    half_gemms = hidden.is_cuda and hidden.dtype != torch.float32
    for start in range(0, n, step):
        stop = min(start + step, n)
        h = hidden[start:stop]
        it = inv_temp[start:stop]
        z, _ = logits_from_products(mm_fp32(h, weight.t()), it, None)
        lse, ent = _statistics(z)
        lse, ent, g_lp, g_ent = combine(start, stop, lse, ent, label_logits(z, labels[start:stop]))
        if dh is None and dw is None:
            continue
        dz = dlogits_from_logits(z, labels[start:stop], it, lse, ent, g_lp, g_ent)
        if half_gemms:
            # tensor-core GEMMs in the inputs' dtype, as the chunked fused_logprobs backward does
            dz = dz.to(hidden.dtype)
        if dh is not None:
            product_into(dh[start:stop], dz, weight)
        if acc is not None:
            if half_gemms:
                accumulate_product(acc, dz.t(), h, first=start == 0)
            else:
                part = mm_fp32(dz.t(), h)
                if start == 0:
                    acc.copy_(part)
                else:
                    acc.add_(part)
    if acc is not None and acc is not dw:
        dw.copy_(acc)


def policy_pass_whole(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, combine: Combine,
                      dh: Optional[Tensor], dw: Optional[Tensor], plan_vocab: Optional[int] = None) -> None:
    """The "reference" backend: one chunk of every token (float32 logits [n, V])."""
    policy_pass(hidden, weight, labels, inv_temp, combine, dh, dw, rows_per_chunk=max(1, hidden.shape[0]))
