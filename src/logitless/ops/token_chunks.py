"""Run a backend over any number of tokens in bounded memory: tokens are fed to it in chunks.

A backend bounds the workspace of one call by the tokens it is given (``token_rows`` in contract.py); this
module feeds it at most that many tokens at a time, so nothing but the inputs, the outputs and a few
float32 [N] vectors grows with N:

- forward: each chunk's (lse, entropy, zy) are written into [n] vectors;
- backward: each chunk's float32 d_hidden [T, H] is finished (the tensor-parallel all-reduce, in float32)
  and written into the d_hidden output in the input dtype; d_weight is written once when there is one
  chunk, else accumulated across chunks in float32 (weight.dtype is float32: in the output itself;
  otherwise in one float32 [V, H] buffer, O(V x H) and independent of N, rounded once at the end).

``rows`` (int64 [n], or None for every row) selects the rows that reach the backend: those whose label is
not ignore_index. Each chunk gathers only its own rows, so skipping prompt / padding tokens costs a
[T, H] copy, never an [N, H] one.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from .contract import Backend
from .precision import Operands
from .tail_backward import TailTerms


def _chunk(hidden: Tensor, rows: Optional[Tensor], start: int, stop: int) -> Tensor:
    """hidden's rows start..stop of the kept ones: a view without ``rows``, a [stop - start, H] copy with."""
    if rows is None:
        return hidden[start:stop]
    return hidden.index_select(0, rows[start:stop])


def stats(backend: Backend, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor,
          rows: Optional[Tensor], with_entropy: bool, softcap: Optional[float]):
    """(lse, entropy or None, zy), float32 [n], of the kept rows of hidden [N, H] (all N without ``rows``).
    labels [n] int64 (the label's row in ``weight`` or -1) and inv_temp [n] float32 are already those of
    the kept rows."""
    n = labels.shape[0]
    step = backend.token_rows("forward", hidden, weight, with_entropy)
    if n <= step:
        return backend.stats(_chunk(hidden, rows, 0, n), weight, labels, inv_temp, with_entropy, softcap)
    dev = hidden.device
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    ent = torch.empty(n, dtype=torch.float32, device=dev) if with_entropy else None
    zy = torch.empty(n, dtype=torch.float32, device=dev)
    for start in range(0, n, step):
        stop = min(start + step, n)
        part = backend.stats(_chunk(hidden, rows, start, stop), weight, labels[start:stop], inv_temp[start:stop],
                             with_entropy, softcap)
        lse[start:stop] = part[0]
        if ent is not None:
            ent[start:stop] = part[1]
        zy[start:stop] = part[2]
    return lse, ent, zy


def grads(backend: Backend, hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, lse: Tensor,
          ent: Optional[Tensor], g_lp: Tensor, g_ent: Optional[Tensor], rows: Optional[Tensor],
          need_dh: bool, need_dw: bool, softcap: Optional[float],
          finish_dh: Callable[[Tensor], Tensor] = lambda dh: dh, operands: Optional[Operands] = None,
          add_dh: Optional[Callable[[Tensor, int, int], None]] = None, tail: Optional[TailTerms] = None):
    """(d_hidden hidden.dtype [N, H] or None, d_weight weight.dtype [V, H] or None) for hidden [N, H].
    operands: a precision's operands for hidden and weight (``ops/precision.py``): the backend recomputes the
    logits from their statistics operands and forms the gradients with their gradient products; None: from
    hidden and weight themselves.

    labels, inv_temp, lse, ent, g_lp, g_ent: [n] vectors of the kept rows (``rows``, or all N). Rows not
    kept get a zero d_hidden. ``finish_dh`` maps each chunk's float32 d_hidden [T, H] before it is
    written (the tensor-parallel all-reduce); it is called the same number of times on every rank, as
    the chunking depends on hidden's shape, dtype and device only. ``add_dh(dh, start, stop)`` adds to a
    chunk's float32 d_hidden (kept rows start..stop) before ``finish_dh``: the one-hot part of k ids per
    token (``label_sets``), so that it is all-reduced with the rest. ``tail``: the k ids and tail of an op with a
    tail output (``tail_backward.TailTerms`` of the kept rows; g_lp is then G), for a backend that forms their
    closed form (the triton one): each chunk gets its rows."""
    n_all, n = hidden.shape[0], labels.shape[0]
    # the chunk plan is made on the caller's hidden (its shape, dtype and device: the same on every rank)
    step = max(1, backend.token_rows("backward", hidden, weight, g_ent is not None))
    chunks = [(start, min(start + step, n)) for start in range(0, n, step)]
    # one chunk of every row: the backend's float32 d_hidden is cast once (no output allocated up front)
    whole = len(chunks) == 1 and rows is None and n == n_all
    out_dh = None
    if need_dh and not whole:
        # ignored rows stay zero; with every row kept, each is written by its chunk
        alloc = torch.zeros if rows is not None or n == 0 else torch.empty
        out_dh = alloc(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    if n == 0:
        return out_dh, torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_dw else None

    dw = dw_acc = None
    if need_dw and len(chunks) > 1:
        dw_acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    h_stats, w_stats = (hidden, weight) if operands is None else (operands.hidden, operands.weight)
    for start, stop in chunks:
        extra = {}
        if operands is not None:
            extra["grad_operands"] = operands.grad.rows(
                slice(start, stop) if rows is None else rows[start:stop])
        if tail is not None:
            extra["tail"] = tail.rows(start, stop)
        dh, dw_part = backend.grads(_chunk(h_stats, rows, start, stop), w_stats, labels[start:stop],
                                    inv_temp[start:stop], lse[start:stop], None if ent is None else ent[start:stop],
                                    g_lp[start:stop], None if g_ent is None else g_ent[start:stop],
                                    need_dh, need_dw, softcap, dw_acc=dw_acc, **extra)
        if dw_part is not None:
            dw = dw_part
        if dh is None:
            continue
        if add_dh is not None:
            add_dh(dh, start, stop)
        dh = finish_dh(dh)
        if whole:
            out_dh = dh.to(hidden.dtype)     # no copy for float32 inputs
        elif rows is not None:
            out_dh.index_copy_(0, rows[start:stop], dh.to(hidden.dtype))
        else:
            out_dh[start:stop] = dh
        del dh   # before the next chunk allocates its own: one float32 [T, H] alive at a time
    if dw_acc is not None:
        dw = dw_acc if weight.dtype == torch.float32 else dw_acc.to(weight.dtype)
    return out_dh, dw
