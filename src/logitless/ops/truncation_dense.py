"""The backward of the tokens whose kept set is wide, as the plain op's backward: the logits recomputed tile by tile,
the dlogits of the truncated distribution written (p taken inside the kept set only, with its own lse and entropy),
then the two cuBLAS products (``triton.backward.grads`` with ``member``). Its cost is the plain backward's over these
tokens' rows whatever the set's size; the pairs' backward (``kept_pairs``) reads two rows of H per kept id, which
costs more past about V / 200 ids a token (a GEMM row does V x H multiply-adds at ~300 times the rate a row of H
is read). Per token, so a token's gradient does not depend on the others in its batch.

Membership in the kernel: z above the midpoint between the last kept logit and the first one left out, both from
the selection (the backward's tiles may round a logit a few ulps apart from the selection's). A token whose two
logits lie closer than GAP (relative) keeps the pairs' backward, whose kept ids are the selection's exactly.

Only where the wide round runs (``truncation_wide.usable``: the triton backend, half-precision heads, no tensor
parallelism).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import knobs

GAP = 2.0 ** -14
IDS_PER_GEMM_ROW = 200


def min_ids(vocab: int) -> int:
    """Kept ids from which a token takes this backward (LOGITLESS_TRUNCATION_DENSE_IDS; default V / 200)."""
    return knobs.truncation_dense_ids(max(1, vocab // IDS_PER_GEMM_ROW))


def boundary(lp: Tensor, keep: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """(member float32 [m], clear [m] bool) of m decided tokens from their sorted candidates lp [m, L] (full-softmax
    log-probs, -inf padding), the kept prefix keep [m, L] and lse [m] (lp = z - lse): the midpoint between the
    last kept logit and the first left out, and whether they lie at least GAP apart (relative)."""
    count = keep.sum(dim=1)
    width = lp.shape[1]
    last = lp.gather(1, (count - 1).clamp(min=0).unsqueeze(1)).squeeze(1).double()
    out = lp.gather(1, count.clamp(max=width - 1).unsqueeze(1)).squeeze(1).double()
    lse64 = lse.double()
    z_last, z_out = last + lse64, out + lse64
    clear = (count > 0) & (count < width) & torch.isfinite(out) & (z_last - z_out > GAP * (1.0 + z_last.abs()))
    member = torch.where(clear, (z_last + z_out) / 2, torch.zeros_like(z_last))
    return member.float(), clear


class DenseBackward(torch.autograd.Function):
    """Outputs (lp [m], ent [m]) as given (the truncated log-probs and entropies of tokens ``rows`` [m], computed
    without gradient); the backward gives hidden [N, H] and weight [V, H] the gradients of those tokens through
    the dlogits kernel (labels [m] ids of this weight, inv_temp [m], lse_k / ent_k [m] float32 the kept sets' lse
    and entropy in tempered-logit units, member [m] float32)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, lp: Tensor, ent: Tensor, rows: Tensor, labels: Tensor,
                inv_temp: Tensor, lse_k: Tensor, ent_k: Tensor, member: Tensor, softcap: Optional[float]):
        ctx.save_for_backward(hidden, weight, rows, labels, inv_temp, lse_k, ent_k, member)
        ctx.softcap = softcap
        return lp.clone(), ent.clone()

    @staticmethod
    def backward(ctx, g_lp: Optional[Tensor], g_ent: Optional[Tensor]):
        from .triton import backward as kernels
        hidden, weight, rows, labels, inv_temp, lse_k, ent_k, member = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_dh or need_dw):
            return (None,) * 11
        m = rows.numel()
        g_lp = torch.zeros(m, dtype=torch.float32, device=hidden.device) if g_lp is None else g_lp.float()
        with_ent = g_ent is not None and bool(g_ent.ne(0).any())
        h_rows = hidden.index_select(0, rows)
        step = kernels.token_rows(h_rows)
        acc = None
        if need_dw and m > step:     # token chunks add d_weight into one float32 accumulator
            acc = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        dh = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_dh else None
        dw = None
        for start in range(0, m, step):
            sl = slice(start, min(start + step, m))
            dh_rows, dw_part = kernels.grads(
                h_rows[sl], weight, labels[sl], inv_temp[sl], lse_k[sl], ent_k[sl] if with_ent else None,
                g_lp[sl].contiguous(), g_ent[sl].float().contiguous() if with_ent else None, need_dh, need_dw,
                ctx.softcap, dw_acc=acc, member=member[sl])
            if dh is not None:
                dh.index_add_(0, rows[sl], dh_rows)
            if dw_part is not None:
                dw = dw_part
        if acc is not None:
            dw = acc.to(weight.dtype)
        return (None if dh is None else dh.to(hidden.dtype), dw) + (None,) * 9
