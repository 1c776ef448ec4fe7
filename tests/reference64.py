"""Float64 ground truth for the tests: materialised logits, torch autograd, nothing of ours."""
from __future__ import annotations

import torch


def logprobs_entropy64(hidden, weight, labels, temperature=1.0, ignore_index=-100):
    """(logprobs, entropy) float64 of softmax(hidden @ weight.T / temperature), from float64 copies
    of the given values. hidden [..., H], weight [V, H], labels [...]; temperature a number or a
    tensor broadcastable to labels. Differentiable w.r.t. hidden and weight if they require grad."""
    h = hidden.double() if hidden.dtype != torch.float64 else hidden
    w = weight.double() if weight.dtype != torch.float64 else weight
    t = temperature.double() if torch.is_tensor(temperature) else float(temperature)
    if torch.is_tensor(t):
        t = torch.broadcast_to(t, labels.shape).unsqueeze(-1)
    z = (h @ w.t()) / t
    logp = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    lp = logp.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def rel_err(a, b):
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))
