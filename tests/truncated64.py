"""Float64 ground truth of a truncated sampler's log-probs (vLLM v1's order: temperature, min_p, top_k, top_p),
written out from the definitions with materialised logits and torch autograd, nothing of logitless: the
kept-set mask, the label's log-prob z_y - logsumexp(z over the kept set) and the truncated entropy."""
from __future__ import annotations

import torch


def broadcast_setting(value, shape, off, dtype):
    """A Truncation setting (None, a number or a tensor broadcastable to ``shape``) as a float64 / int64 tensor."""
    if value is None:
        value = off
    if torch.is_tensor(value):
        return torch.broadcast_to(value.to(dtype), shape)
    return torch.full(shape, value, dtype=dtype)


def kept_mask64(z, top_k=None, top_p=None, min_p=None):
    """bool [..., V]: the ids vLLM keeps from logits z [..., V] (float64, already divided by the temperature).
    min_p: p_i >= m * max p; top_k: the survivors >= the k-th largest survivor (ties kept, fewer than k keep all);
    top_p: in (value descending, id ascending) order over the survivors renormalised, kept iff the mass before
    the id is < P (the largest always kept)."""
    lead, v = z.shape[:-1], z.shape[-1]
    k = broadcast_setting(top_k, lead, -1, torch.int64)
    p = broadcast_setting(top_p, lead, 1.0, torch.float64)
    m = broadcast_setting(min_p, lead, 0.0, torch.float64)
    probs = torch.softmax(z, dim=-1)
    keep = probs >= m.unsqueeze(-1) * probs.max(dim=-1, keepdim=True).values
    zk = z.masked_fill(~keep, float("-inf"))
    ordered = zk.sort(dim=-1, descending=True, stable=True).values
    kk = torch.where((k > 0) & (k < v), k, torch.full_like(k, v)).clamp(max=v)
    kth = ordered.gather(-1, (kk - 1).unsqueeze(-1))
    keep = keep & ((zk >= kth) | (k <= 0).unsqueeze(-1) | (k >= v).unsqueeze(-1))
    zk = z.masked_fill(~keep, float("-inf"))
    q = torch.softmax(zk, dim=-1)
    # (value descending, id ascending): a stable descending sort keeps equal values in id order
    order = zk.sort(dim=-1, descending=True, stable=True).indices
    qs = q.gather(-1, order)
    before = torch.cumsum(qs, dim=-1) - qs
    in_p = (before < p.unsqueeze(-1)) | (p.unsqueeze(-1) >= 1.0)
    in_p[..., 0] = True
    top = torch.zeros_like(keep).scatter(-1, order, in_p)
    return keep & top


def truncated64(hidden, weight, labels, *, temperature=1.0, ignore_index=-100, top_k=None, top_p=None,
                min_p=None, kept_ids=None):
    """(logprobs, entropy, inside, kept mask) in float64: z_y - lse over the kept set, the truncated entropy;
    differentiable w.r.t. hidden and weight (the kept set fixed). kept_ids [..., K] (-1 pads): the replay form."""
    h = hidden.double() if hidden.dtype != torch.float64 else hidden
    w = weight.double() if weight.dtype != torch.float64 else weight
    t = temperature.double() if torch.is_tensor(temperature) else float(temperature)
    if torch.is_tensor(t):
        t = torch.broadcast_to(t, labels.shape).unsqueeze(-1)
    z = (h @ w.t()) / t
    if kept_ids is not None:
        keep = torch.zeros(z.shape, dtype=torch.bool).scatter(-1, kept_ids.clamp(min=0).long(), kept_ids >= 0)
    else:
        with torch.no_grad():
            keep = kept_mask64(z.detach(), top_k, top_p, min_p)
    valid = labels != ignore_index
    keep = keep | ~valid.unsqueeze(-1)           # ignored rows: anything finite
    zk = z.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(zk, dim=-1)
    y = torch.where(valid, labels, 0).long()
    lp = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
    logq = (zk - lse.unsqueeze(-1)).masked_fill(~keep, 0.0)
    ent = -(logq.exp() * logq).sum(-1)
    inside = keep.gather(-1, y.unsqueeze(-1)).squeeze(-1) & valid
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero), inside, keep
