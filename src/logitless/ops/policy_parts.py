"""The fused policy-loss pass: what a backend implements (``policy_pass``), and the small pieces the backends
share (the dispatch by backend name is ``policy.py``).

A loss that is a fixed weighted sum of per-token terms f(logprob, entropy) lets the gradient of a chunk
of tokens be formed in the same pass that computes their statistics: no logits are recomputed, so the
pass costs three GEMMs where fused_logprobs' forward + backward costs four.

    policy_pass(hidden [n, H], weight [V, H], labels [n], inv_temp [n], combine, dh, dw, plan_vocab=None)

hidden, weight, labels (local rows, -1 where this weight does not hold the label) and inv_temp as in
``contract.py``; only scored tokens are passed. For each chunk of token rows [start, stop) the backend
computes the chunk's statistics over its whole (local) vocabulary, lse, ent, zy (float32 [c]), then calls

    lse, ent, g_lp, g_ent = combine(start, stop, lse, ent, zy)

which returns the *global* lse and entropy of those rows (after the tensor-parallel all-gather, if any)
and the loss gradients g_lp = dL/dlogprob, g_ent = dL/dentropy (float32 [c]; g_ent None when the loss
does not depend on the entropy). From them, with x = z - lse and p = exp(x) (``contract.py``):

    dlogits = inv_temp * (g_lp * (onehot(label) - p) - g_ent * p * (x + ent))       [c, V]
    dh[start:stop] = dlogits @ weight             (written once: a token's whole vocabulary is in its chunk)
    dw            += dlogits.T @ hidden[start:stop]  (accumulated over chunks)

dh ([n, H], hidden.dtype, or float32 under tensor parallelism) and dw ([V, H], weight.dtype, contiguous)
are the caller's buffers, or None when that gradient is not wanted (then neither is touched). With
neither, only the statistics are computed. The backend writes every element of dh and of dw.

bounds (optional keyword): the chunks' boundaries [0, ..., n] instead of the backend's even chunks, each
chunk at most the backend's ``max_chunk_rows`` rows (``policy.max_chunk_rows_for``): a caller whose loss
couples groups of tokens (the tokens of a sequence) cuts chunks that keep each group whole, so that
``combine`` sees every token of a group at once.

set_dlogits (optional keyword): called as set_dlogits(start, stop, dlogits) with a chunk's dlogits [c, V] (the
products' dtype; a view) after they are formed and before the gradient products, to overwrite some entries: a loss
whose gradient at a few columns per token is known in closed form (the top-k distillation's k teacher ids,
``losses/distill_topk_function.py``) writes it there, computed in float32, instead of correcting a rounded value.

plan_vocab: the vocabulary size the chunk plan is made for (None: this weight's rows). Under tensor
parallelism every rank passes the largest shard, so every rank cuts the same token chunks and calls
``combine`` (a collective) the same number of times with the same rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .maths import accumulate_product, product_into  # noqa: F401  (the pass's products, shared)

Combine = Callable[[int, int, Tensor, Optional[Tensor], Tensor],
                   tuple[Tensor, Tensor, Tensor, Optional[Tensor]]]
SetDlogits = Callable[[int, int, Tensor], None]


def scale_by_upstream(grad: Tensor, g: Tensor) -> None:
    """grad *= g in place, for the upstream gradient g (0-d) of a loss whose gradients were formed in its
    forward. On CUDA the factor is read by a kernel, not the host: a backward must not wait for the GPU
    (when g == 1 the kernel's programs return at once). Elsewhere a host read costs nothing."""
    if grad.is_cuda and grad.is_contiguous():
        try:
            from .triton.scale import scale_in_place
        except ImportError:     # a CUDA build without triton: one synchronisation
            pass
        else:
            scale_in_place(grad, g.to(grad.device, torch.float32))
            return
    factor = float(g)
    if factor != 1.0:
        grad.mul_(factor)


def balanced_chunks(n: int, max_rows: int, multiple: int = 1) -> int:
    """Rows per chunk: at most ``max_rows`` (>= ``multiple``), as equal as the chunk count allows, a
    multiple of ``multiple`` (so no chunk ends with a thin ragged tile)."""
    max_rows = max(multiple, max_rows // multiple * multiple)
    count = max(1, -(-n // max_rows))
    rows = -(-n // count)
    return min(max_rows, -(-rows // multiple) * multiple)
