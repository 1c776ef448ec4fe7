"""Float64 ground truth for the tests: materialised logits, torch autograd, nothing of ours."""
from __future__ import annotations

import torch


def logprobs_entropy64(hidden, weight, labels, temperature=1.0, ignore_index=-100, softcap=None):
    """(logprobs, entropy) float64 of softmax(hidden @ weight.T / temperature), from float64 copies
    of the given values. hidden [..., H], weight [V, H], labels [...]; temperature a number or a
    tensor broadcastable to labels; softcap None or c, for logits c * tanh(hidden @ weight.T / c) /
    temperature (Gemma's final_logit_softcapping, written out as the model does it).
    Differentiable w.r.t. hidden and weight if they require grad."""
    h = hidden.double() if hidden.dtype != torch.float64 else hidden
    w = weight.double() if weight.dtype != torch.float64 else weight
    t = temperature.double() if torch.is_tensor(temperature) else float(temperature)
    if torch.is_tensor(t):
        t = torch.broadcast_to(t, labels.shape).unsqueeze(-1)
    z = h @ w.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z / t
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


# Tolerances of the public op against float64: logprob max abs, entropy max abs, gradient relative norm.
TOL = {
    torch.float32: (2e-5, 2e-5, 1e-4),
    torch.bfloat16: (1e-3, 2e-3, 1e-2),
    torch.float16: (1e-3, 2e-3, 1e-2),
}


def make_inputs(lead=(7,), h=96, v=4099, dtype=torch.float32, logit_std=4.0, device="cpu"):
    """Fresh random hidden [*lead, H] and weight [V, H] (dtype) whose logits have std about logit_std,
    and labels [*lead] sampled from the softmax, as in RL rollouts."""
    hidden = torch.randn(*lead, h, device=device)
    weight = torch.randn(v, h, device=device) * (logit_std / h ** 0.5)
    with torch.no_grad():
        probs = torch.softmax(hidden.double() @ weight.double().t(), dim=-1)
        labels = torch.multinomial(probs.reshape(-1, v), 1).reshape(lead)
    return hidden.to(dtype), weight.to(dtype), labels
