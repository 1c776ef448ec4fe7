"""The gradient of the tail (the student's log-mass outside k ids) when that mass is small: fused_topk's
tail_logprob and the forward_kl_topk_tail divergence against float64 (materialised logits, torch autograd) at
P_tail of 1e-10, 1e-20, 1e-40 and 1e-50 (below float32's range), and a row whose k ids are the whole vocabulary,
on every backend. The exact gradient is bounded (|d log P_tail / d z_j| <= 1); a backward that forms it as the
difference of two terms of size p_j / P_tail gets it wrong by up to 1e17, or NaN."""
from __future__ import annotations

import math

import pytest
import torch

from logitless import fused_topk
from logitless.losses import fused_distillation_loss
from logitless.ops.triton.common import INTERPRETING
from reference64 import device_for, on_cpu

V, H, K, N = 4099, 96, 5, 7
BACKENDS = ("reference", "chunked", "triton")
LOG_TAILS = (math.log(1e-10), math.log(1e-20), math.log(1e-40), math.log(1e-50))


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * 700))


def skip_triton_without_interpreter(backend):
    if backend == "triton" and not (INTERPRETING or torch.cuda.is_available()):
        pytest.skip("the triton backend needs a GPU or TRITON_INTERPRET=1")


def student(log_tail: float, seed: int):
    """Random hidden [N, H] and weight [V, H] whose logits put the k ids (random, distinct) of token i about
    -log_tail + log V nats above the rest (token i's dimension i carries them), so P_tail ~ exp(log_tail)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(N)])
    hidden = 0.1 * torch.randn(N, H, generator=gen)
    hidden[:, :N] = torch.eye(N)          # token i alone reads dimension i (random elsewhere)
    weight = 0.05 * torch.randn(V, H, generator=gen)
    gap = -log_tail + math.log(V)
    for i in range(N):
        weight[ids[i], i] += gap + torch.rand(K, generator=gen) - 0.5
    return hidden, weight, ids


def tail64(hidden, weight, ids):
    """float64 (log-softmax [N, V], log P_tail [N]) of the materialised logits."""
    ls = torch.log_softmax(hidden.double() @ weight.double().T, -1)
    outside = torch.ones_like(ls, dtype=torch.bool).scatter_(-1, ids, False)
    return ls, torch.logsumexp(ls.masked_fill(~outside, float("-inf")), -1)


def grads_close(got_h, got_w, want_h, want_w):
    for got, want in ((got_h, want_h), (got_w, want_w)):
        assert torch.isfinite(got).all()
        err = (got.double() - want).abs().max().item()
        assert err <= 1e-4 * max(1.0, want.abs().max().item()), (err, want.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("log_tail", LOG_TAILS)
def test_topk_tail_gradient_small_tail(backend, log_tail):
    skip_triton_without_interpreter(backend)
    hidden, weight, ids = student(log_tail, seed=11)
    d = device_for(backend)
    h = hidden.clone().to(d).requires_grad_()
    w = weight.clone().to(d).requires_grad_()
    # IEEE float32 products on every device (CUDA's default for float32 is the bf16x3 split, not the subject here)
    out = fused_topk(h, w, K, backend=backend, precision="ieee")
    out = on_cpu(out)
    assert torch.equal(out.ids.sort(-1).values, ids.sort(-1).values)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    _, want = tail64(h64, w64, ids)
    assert abs(want.mean().item() - log_tail) < 3.0              # the construction hits the intended regime
    # the value: finite and right below float32's range too (log 1e-50 = -115)
    assert torch.isfinite(out.tail_logprob).all()
    assert (out.tail_logprob.double() - want.detach()).abs().max() < 2e-4 * abs(log_tail)
    gen = torch.Generator().manual_seed(3)
    g_tail, g_lp = torch.randn(N, generator=gen), torch.randn(N, K, generator=gen)
    ((out.tail_logprob * g_tail).sum() + (out.logprobs * g_lp).sum()).backward()      # through the .cpu() copies
    ls, _ = tail64(h64, w64, ids)
    ((want * g_tail.double()).sum() + (ls.gather(-1, out.ids) * g_lp.double()).sum()).backward()
    grads_close(h.grad.cpu(), w.grad.cpu(), h64.grad, w64.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_tail_gradient_k_is_vocabulary(backend):
    """k = V: no id outside, the tail is -inf and gives no gradient; the log-probs' gradients stay right."""
    skip_triton_without_interpreter(backend)
    v, gen = 37, torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(3, H, generator=gen), torch.randn(v, H, generator=gen)
    d = device_for(backend)
    h, w = hidden.clone().to(d).requires_grad_(), weight.clone().to(d).requires_grad_()
    out = fused_topk(h, w, v, backend=backend, precision="ieee")
    out = on_cpu(out)
    assert torch.isinf(out.tail_logprob).all() and (out.tail_logprob < 0).all()
    g = torch.randn(3, v, generator=gen)
    ((out.logprobs * g).sum() + out.tail_logprob.clamp(min=-1.0).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    (torch.log_softmax(h64 @ w64.T, -1).gather(-1, out.ids) * g.double()).sum().backward()
    grads_close(h.grad.cpu(), w.grad.cpu(), h64.grad, w64.grad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("log_tail", LOG_TAILS)
@pytest.mark.parametrize("teacher_mass", (0.9, 0.999))
def test_forward_kl_topk_tail_gradient_small_tail(backend, log_tail, teacher_mass):
    """The student is far more confident on the teacher's top-k than the teacher: the tail bucket's regime."""
    skip_triton_without_interpreter(backend)
    hidden, weight, ids = student(log_tail, seed=23)
    gen = torch.Generator().manual_seed(29)
    t_lp = torch.log_softmax(torch.randn(N, K, generator=gen), -1) + math.log(teacher_mass)
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[2] = -100
    dev = device_for(backend)
    h, w = hidden.clone().to(dev).requires_grad_(), weight.clone().to(dev).requires_grad_()
    # IEEE float32 products, as above: the split's default gradient products are bfloat16 ones, whose rounding of
    # the weight's rows at the ids (logits of 30 to 120 nats here) is not the subject
    out = fused_distillation_loss(h, w, labels.to(dev), divergence="forward_kl_topk_tail",
                                  teacher_topk_ids=ids.to(dev), teacher_topk_logprobs=t_lp.to(dev), backend=backend,
                                  precision="ieee")
    out.loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ls, lpt = tail64(h64, w64, ids)
    q = t_lp.double()
    qt = 1 - q.exp().sum(-1)
    d = (q.exp() * (q - ls.gather(-1, ids))).sum(-1) + qt * (qt.log() - lpt)
    scored = labels != -100
    want = d[scored].mean()
    want.backward()
    assert abs(out.loss.item() - want.item()) < 1e-4 * max(1.0, abs(want.item()))
    grads_close(h.grad.cpu(), w.grad.cpu(), h64.grad, w64.grad)
