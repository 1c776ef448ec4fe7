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


def close_everywhere(got, want, rel):
    """Relative norm error <= rel, and no single element off by more than 4 * rel * max|want|
    (catches an unwritten row that a norm would average away)."""
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= rel
    assert (got.double() - want).abs().max().item() <= rel * want.abs().max().item() * 4


def _close_in_norm(got, want, rel):
    assert rel_err(got, want) <= rel


def check_op(hidden, weight, labels, backend, *, temperature=1.0, ignore_index=-100, with_entropy=True,
             grad_hidden=True, grad_weight=True, a_scale=1.0, b_scale=1.0, tol=None, softcap=None,
             grad_features=None, elementwise=False):
    """Run ``fused_logprobs`` forward and backward on sum(a*logprob) + sum(b*entropy), random a, b,
    and compare everything with float64: values, dtypes, shapes, which inputs got gradients.

    grad_features: compare gradients on the first k features only (the offset feature that the
    shift tests append has an exactly-cancelling gradient, pure float32 rounding times the offset).
    elementwise: also bound every gradient element (``close_everywhere``), not only the norm.
    Returns the op's TokenLogProbs."""
    from logitless import fused_logprobs, last_backend
    tol = tol or TOL[hidden.dtype]
    h = hidden.detach().clone().requires_grad_(grad_hidden)
    w = weight.detach().clone().requires_grad_(grad_weight)
    out = fused_logprobs(h, w, labels, temperature=temperature, ignore_index=ignore_index,
                         with_entropy=with_entropy, backend=backend, softcap=softcap)
    assert last_backend() == backend
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == labels.shape
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    lp64, ent64 = logprobs_entropy64(h64, w64, labels, temperature, ignore_index, softcap)
    assert torch.isfinite(out.logprobs).all()
    assert (out.logprobs - lp64).abs().max().item() <= tol[0]
    assert (out.logprobs <= 0).all()
    a = torch.randn(labels.shape, dtype=torch.float64, device=hidden.device) * a_scale
    b = torch.randn(labels.shape, dtype=torch.float64, device=hidden.device) * b_scale
    loss, loss64 = (out.logprobs * a.float()).sum(), (lp64 * a).sum()
    if with_entropy:
        assert out.entropy.dtype == torch.float32 and out.entropy.shape == labels.shape
        assert torch.isfinite(out.entropy).all()
        assert (out.entropy - ent64).abs().max().item() <= tol[1]
        loss, loss64 = loss + (out.entropy * b.float()).sum(), loss64 + (ent64 * b).sum()
    else:
        assert out.entropy is None
    if not (grad_hidden or grad_weight):
        return out
    loss.backward()
    loss64.backward()
    compare = close_everywhere if elementwise else _close_in_norm
    if grad_hidden:
        assert h.grad is not None and h.grad.dtype == hidden.dtype and h.grad.shape == hidden.shape
        compare(h.grad[..., :grad_features], h64.grad[..., :grad_features], tol[2])
    else:
        assert h.grad is None
    if grad_weight:
        assert w.grad is not None and w.grad.dtype == weight.dtype and w.grad.shape == weight.shape
        compare(w.grad[:, :grad_features], w64.grad[:, :grad_features], tol[2])
    else:
        assert w.grad is None
    return out
