"""The k ids' raw products <weight[id], hidden> per token (``label_sets.set_products``) as a Triton kernel, so the
triton backend's k-id log-probs keep its batch invariance: one program per (token, id) sums over H in a fixed
order, whatever the number of tokens (a batched torch product may pick another reduction order by batch size)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import on_device

BLOCK_H = 128


# n (the pairs of a call) is not specialised: every batch runs the same build
@triton.jit(do_not_specialize=["n_pairs"])
def _set_products_kernel(h_ptr, w_ptr, ids_ptr, out_ptr, n_pairs, k, n_h, s_hn, s_hk, s_wv, s_wk,
                         BLOCK: tl.constexpr, H_TILES: tl.constexpr):
    pair = tl.program_id(0).to(tl.int64)
    row = pair // k
    idx = tl.load(ids_ptr + pair)
    safe = tl.maximum(idx, 0).to(tl.int64)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for t in range(0, H_TILES):
        offs = t * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n_h
        a = tl.load(h_ptr + row * s_hn + offs * s_hk, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(w_ptr + safe * s_wv + offs * s_wk, mask=ok, other=0.0).to(tl.float32)
        acc += a * b
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + pair, tl.where(idx >= 0, total, 0.0))


def set_products(hidden: Tensor, weight: Tensor, ids: Tensor) -> Tensor:
    """float32 [n, k] = <weight[ids], hidden> (0 where ids == -1), for hidden [n, H], ids [n, k] int64."""
    n, k = ids.shape
    out = torch.empty((n, k), dtype=torch.float32, device=hidden.device)
    if n * k == 0:
        return out
    ids = ids.contiguous()
    h = hidden.shape[1]
    with on_device(hidden):
        _set_products_kernel[(n * k,)](hidden, weight, ids, out, n * k, k, h, hidden.stride(0), hidden.stride(1),
                                       weight.stride(0), weight.stride(1), BLOCK=BLOCK_H,
                                       H_TILES=triton.cdiv(h, BLOCK_H))
    return out
