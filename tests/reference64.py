"""Float64 ground truth for the tests: materialised logits, torch autograd, nothing of ours."""
from __future__ import annotations

import torch


def logits64(hidden, weight, shape, temperature=1.0, softcap=None):
    """The float64 logits [..., V] the op scores: hidden @ weight.T (softcapped to c * tanh(raw / c) first with
    ``softcap``) divided by ``temperature`` (a number or a tensor broadcastable to ``shape``, hidden's leading
    shape). Differentiable w.r.t. hidden and weight if they require grad."""
    h = hidden.double() if hidden.dtype != torch.float64 else hidden
    w = weight.double() if weight.dtype != torch.float64 else weight
    t = temperature.double() if torch.is_tensor(temperature) else float(temperature)
    if torch.is_tensor(t):
        t = torch.broadcast_to(t, shape).unsqueeze(-1)
    z = h @ w.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z / t


def logprobs_entropy64(hidden, weight, labels, temperature=1.0, ignore_index=-100, softcap=None):
    """(logprobs, entropy) float64 of softmax(hidden @ weight.T / temperature), from float64 copies
    of the given values. hidden [..., H], weight [V, H], labels [...]; temperature a number or a
    tensor broadcastable to labels; softcap None or c, for logits c * tanh(hidden @ weight.T / c) /
    temperature (Gemma's final_logit_softcapping, written out as the model does it).
    Differentiable w.r.t. hidden and weight if they require grad."""
    logp = torch.log_softmax(logits64(hidden, weight, labels.shape, temperature, softcap), dim=-1)
    valid = labels != ignore_index
    lp = logp.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    zero = torch.zeros_like(lp)
    return torch.where(valid, lp, zero), torch.where(valid, ent, zero)


def device_for(backend):
    """Where a backend's call runs in the tests: the triton backend on the GPU when there is one (its compiled
    kernels: without triton's interpreter it refuses CPU tensors), else in the interpreter on the CPU; the other
    backends on the CPU. The float64 ground truth stays on the CPU."""
    from logitless.ops.triton.common import INTERPRETING
    return "cuda" if backend == "triton" and torch.cuda.is_available() and not INTERPRETING else "cpu"


def on_cpu(out):
    """An op's output with its tensors on the CPU (differentiable copies: gradients flow back to the device's
    leaves): a tensor, a named tuple of tensors / None, or a dict of them."""
    if torch.is_tensor(out):
        return out.cpu()
    if isinstance(out, dict):
        return {k: on_cpu(v) for k, v in out.items()}
    if isinstance(out, tuple):
        return type(out)(*(on_cpu(v) for v in out))
    return out


def moved(dev, *tensors):
    """Leaf copies on ``dev`` (requiring grad where the original does), or the tensors themselves on the CPU;
    anything not a tensor as it is."""
    if dev == "cpu":
        return tensors
    return tuple(t.detach().to(dev).requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in tensors)


def rel_err(a, b):
    """||a - b|| / ||b|| in float64, on b's device (a GPU result against a CPU reference)."""
    a, b = a.double().to(b.device), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# Tolerances of the public op against float64: logprob max abs, entropy max abs, gradient relative norm.
# float32: of IEEE float32 products (the default on the CPU; on CUDA float32 operands default to the bf16x3
# split: ``tol_for`` gives the bounds of the precision that ran)
TOL = {
    torch.float32: (2e-5, 2e-5, 1e-4),
    torch.bfloat16: (1e-3, 2e-3, 1e-2),
    torch.float16: (1e-3, 2e-3, 1e-2),
}

# Float32 operands by precision (``logitless.last_precision()``): the max |log-prob / entropy error| each
# statistics precision meets at logits of std up to 8 (H 96), and the gradients' relative error of each
# gradient precision ("bf16": bfloat16 dlogits times the operands' bfloat16 part, ~2e-3 .. 1e-2).
# (TF32 keeps 3 more bits than bfloat16: its error is ~8x smaller, not below a fixed bound of bfloat16's)
BOUND = {"bf16x3": 2e-4, "bf16x6": 2e-5, "tf32": 1.5e-2, "ieee": 2e-5}
GRAD_BOUND = {"bf16": 3e-2, "bf16x3": 1e-4, "bf16x6": 1e-4, "ieee": 1e-4}


def tol_for(dtype, precision):
    """(log-prob, entropy, gradient) tolerances of operands of ``dtype`` whose products ran as ``precision``
    (``last_precision()`` of the call): half-precision operands' TOL, float32's by the precision that ran."""
    if dtype != torch.float32:
        return TOL[dtype]
    stats, grads = precision
    return BOUND[stats], BOUND[stats], GRAD_BOUND[grads]


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
             grad_features=None, elementwise=False, precision=None):
    """Run ``fused_logprobs`` forward and backward on sum(a*logprob) + sum(b*entropy), random a, b,
    and compare everything with float64: values, dtypes, shapes, which inputs got gradients.

    precision: the op's ``precision`` (float32 operands; None: the device's default, "bf16x3" on CUDA, "ieee"
    elsewhere). tol: default the bounds of the precision that ran (``tol_for`` of ``last_precision()``).

    grad_features: compare gradients on the first k features only (the offset feature that the
    shift tests append has an exactly-cancelling gradient, pure float32 rounding times the offset).
    elementwise: also bound every gradient element (``close_everywhere``), not only the norm.
    Returns the op's TokenLogProbs."""
    from logitless import fused_logprobs, last_backend, last_precision
    h = hidden.detach().clone().requires_grad_(grad_hidden)
    w = weight.detach().clone().requires_grad_(grad_weight)
    out = fused_logprobs(h, w, labels, temperature=temperature, ignore_index=ignore_index,
                         with_entropy=with_entropy, backend=backend, softcap=softcap, precision=precision)
    assert last_backend() == backend
    if precision not in (None, "auto"):
        assert last_precision().statistics == precision
    tol = tol or tol_for(hidden.dtype, last_precision())
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
