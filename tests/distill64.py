"""Float64 ground truth for the distillation losses, written from the definitions (docs/distillation.md), not
from the library's passes: both heads' full logits, log_softmax, the divergence per token, the aggregation,
and torch.autograd for the student's gradients."""
from __future__ import annotations

from typing import Optional

import torch


def head_logits64(hidden, weight, inv_temp, scale=1.0, softcap=None):
    z = (hidden.double() @ weight.double().t()) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z * inv_temp.unsqueeze(-1)


def divergence64(ls, lt, kind: str, beta: Optional[float] = None):
    """Per-token divergence from float64 log-probs [..., V]."""
    ps, pt = ls.exp(), lt.exp()
    if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
        return (pt * (lt - ls)).sum(-1)
    if kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
        return (ps * (ls - lt)).sum(-1)
    m = (1 - beta) * ps + beta * pt
    lm = m.log()
    return beta * (pt * (lt - lm)).sum(-1) + (1 - beta) * (ps * (ls - lm)).sum(-1)


# float32's resolution of a gradient: this many units of 2^-24 of the largest sum of its terms' magnitudes
# (gradient_scale64). Measured at most 18 (forward KL's d_weight, 150 random batches); jsd's gradient cancels
# (p_s near m) to ~1/300 of its terms, where 1e-4 of its own largest entry failed by chance (1.2e-4 and 1.1e-4 of
# it: 6 units here). A wrong or missing term moves the gradient by a share of its terms, far above.
FLOAT32_UNITS = 32


class Truth(tuple):
    """(loss, divergence, entropy, d_s_hidden, d_s_weight), with ``grad_scale``: the largest entry of each
    gradient's sum of term magnitudes (``gradient_scale64``), the scale float32's resolution is relative to."""
    grad_scale: tuple


def gradient_scale64(ls, lt, hs, ws, token_w, inv_t, kind, beta, s_scale):
    """(max over d_hidden's entries, max over d_weight's) of the sums of the magnitudes of the terms that make
    them: d_hidden = dz @ W, d_weight = dz.T @ h, with each dz_ij (the derivative with respect to the student's
    raw product) written as the sum the op forms, and each log-prob l entering it with float32's resolution,
    relative to 1 + |l| (a probability exp(l) is resolved relative to it likewise):
        forward_kl  p_s - p_t                          -> p_s (1 + |ls|) + p_t (1 + |lt|)
        reverse_kl  p_s (ls - lt - D)                  -> p_s (1 + |ls| + |lt| + |D|)
        jsd         (1 - b) p_s (ls - lm - KL(s || m)) -> (1 - b) p_s (1 + |ls| + |lm| + |KL|)
    times |token_w| / temperature * logit scale (a softcap's derivative is at most 1). Where the divergence's
    derivative cancels (p_s near p_t, ls near lm) the gradient is far below these sums and float32's error is
    not: bounds relative to the gradient's own largest entry fail there by chance."""
    with torch.no_grad():
        ps, pt = ls.exp(), lt.exp()
        if kind == "forward_kl" or (kind == "jsd" and beta == 0.0):
            mag = ps * (1 + ls.abs()) + pt * (1 + lt.abs())
        elif kind == "reverse_kl" or (kind == "jsd" and beta == 1.0):
            d = (ps * (ls - lt)).sum(-1, keepdim=True)
            mag = ps * (1 + ls.abs() + lt.abs() + d.abs())
        else:
            lm = ((1 - beta) * ps + beta * pt).log()
            kl = (ps * (ls - lm)).sum(-1, keepdim=True)
            mag = (1 - beta) * ps * (1 + ls.abs() + lm.abs() + kl.abs())
        mag = mag * (token_w.abs() * inv_t.abs() * abs(s_scale)).unsqueeze(-1)
        mag = mag.reshape(-1, mag.shape[-1])
        h = hs.detach().reshape(-1, hs.shape[-1]).abs()
        return (mag @ ws.detach().abs()).max().item(), (mag.t() @ h).max().item()


def distill64(s_hidden, s_weight, t_hidden, t_weight, labels, kind, beta=None, *, temperature=1.0,
              token_w=None, s_scale=1.0, t_scale=1.0, s_softcap=None, t_softcap=None, ignore_index=-100):
    """(loss, divergence [...], student entropy [...], d_s_hidden, d_s_weight), float64. token_w: the float64
    per-token weights of the loss (default: token-mean)."""
    hs = s_hidden.detach().double().requires_grad_()
    ws = s_weight.detach().double().requires_grad_()
    valid = labels != ignore_index
    if torch.is_tensor(temperature):
        inv_t = 1.0 / torch.broadcast_to(temperature.double(), labels.shape)
    else:
        inv_t = torch.full(labels.shape, 1.0 / temperature, dtype=torch.float64)
    zs = head_logits64(hs, ws, inv_t, s_scale, s_softcap)
    zt = head_logits64(t_hidden, t_weight, inv_t, t_scale, t_softcap)
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    d = torch.where(valid, divergence64(ls, lt, kind, beta), 0.0)
    ent = torch.where(valid, -(ls.exp() * ls).sum(-1), 0.0)
    if token_w is None:
        token_w = valid.double() / valid.sum().clamp_min(1)
    loss = (token_w * d).sum()
    dh, dw = torch.autograd.grad(loss, [hs, ws])
    truth = Truth((loss.detach(), d.detach(), ent.detach(), dh, dw))
    truth.grad_scale = gradient_scale64(ls, lt, hs, ws, token_w, inv_t, kind, beta, s_scale)
    return truth


def weights64(valid, loss_agg, cu=None):
    """The per-token weights of each loss_agg, written from aggregate.py's table (rows are sequences)."""
    v = valid.double()
    if loss_agg == "token-mean":
        return v / v.sum()
    if loss_agg == "token-sum":
        return v
    if cu is not None:
        seqs = [v[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    else:
        seqs = list(v)
    n_seq = sum(1 for s in seqs if s.sum() > 0)
    horizon = max(len(s) for s in seqs)
    out = []
    for s in seqs:
        if loss_agg == "seq-mean-token-mean":
            out.append(s / (n_seq * max(s.sum().item(), 1.0)))
        elif loss_agg == "seq-mean-token-sum":
            out.append(s / n_seq)
        else:
            out.append(s / (n_seq * horizon))
    return torch.cat(out).view(valid.shape)
