"""Degenerate inputs of the top-k divergences: the teacher's k ids covering the whole vocabulary (k = V, its
leftover mass rounding above or below 0), teacher masses rounding above 1, a student tail far below the top k.
Never inf or NaN from valid input; a bucket with no mass on either side adds nothing; against float64. The triton
backend runs on the GPU where there is one (its compiled kernels refuse CPU tensors), else in triton's interpreter;
the float64 truth stays on the CPU."""
from __future__ import annotations

import pytest
import torch

from logitless.losses.distill_topk import topk_divergence
from reference64 import device_for, on_cpu, rel_err

V, H, N = 37, 16, 5
BACKENDS = ("chunked", "triton")


def head(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (scale / H ** 0.5)
    return hidden, weight, g


def divergence(hidden, weight, labels, ids, t_lp, backend, **kw):
    """topk_divergence on the backend's device, the outputs back on the CPU (differentiable moves: the CPU leaves
    get the gradients); IEEE float32 products (CUDA's default split forms bfloat16 gradient products, 2e-3 off,
    not the subject here)."""
    dev = device_for(backend)
    out = topk_divergence(*(t.to(dev) for t in (hidden, weight, labels, ids, t_lp)),
                          divergence="forward_kl_topk_tail", backend=backend, precision="ieee", **kw)
    return on_cpu(out)


def kl64(hidden, weight, ids, t_lp):
    """sum_S q (log q - s) + q_tail (log q_tail - log p_tail), q_tail = 1 - sum q (0 below 0), 0 where it is 0
    or the student's tail is empty (no id outside S)."""
    logp = torch.log_softmax(hidden @ weight.t(), -1)
    s = logp.gather(-1, ids)
    q = t_lp.double()
    qt = (1 - q.exp().sum(-1)).clamp_min(0)
    if ids.shape[-1] == weight.shape[0]:
        return (q.exp() * (q - s)).sum(-1)
    s_tail = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), -1)
    return (q.exp() * (q - s)).sum(-1) + torch.where(qt > 0, qt * (qt.clamp_min(1e-300).log() - s_tail), 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leftover", [3e-7, -3e-7, 0.0])
def test_teacher_ids_cover_the_whole_vocabulary(backend, leftover, seed):
    """k = V: the student's tail is empty (log p_tail = -inf); the teacher's leftover mass is rounding (above or
    below 1): the tail bucket adds nothing. Was inf (q_tail * (log q_tail + inf)) for a leftover above 0."""
    hidden, weight, g = head(seed)
    ids = torch.stack([torch.randperm(V, generator=g) for _ in range(N)])
    t = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64), -1)
    t_lp = (t + torch.log1p(torch.tensor(-leftover, dtype=torch.float64))).float()    # sums to 1 - leftover
    labels = torch.zeros(N, dtype=torch.long)
    h_in, w_in = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = divergence(h_in, w_in, labels, ids, t_lp, backend, with_overlap=False)
    assert torch.isfinite(out.divergence).all(), out.divergence
    out.divergence.sum().backward()
    assert torch.isfinite(h_in.grad).all() and torch.isfinite(w_in.grad).all()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = kl64(h64, w64, ids, t_lp)
    want.sum().backward()
    assert (out.divergence.double() - want).abs().max() < 2e-5
    assert rel_err(h_in.grad, h64.grad) < 1e-4 and rel_err(w_in.grad, w64.grad) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gap", [25.0, 60.0, 110.0])
def test_student_tail_far_below_its_top_k(backend, gap, seed):
    """The student's mass outside the teacher's ids at e^-25 .. e^-110 (1 - sum p is 0 in float32, and in
    float64 beyond e^-37): the tail term from the directly summed tail is finite and equals float64."""
    hidden, weight, g = head(seed)
    k = 4
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    # one-hot hidden states: logits are weight[:, 0]; the teacher's ids at 0, the others at -gap
    hidden = torch.zeros(N, H)
    hidden[:, 0] = 1.0
    weight = torch.zeros(V, H)
    weight[:, 0] = -gap + torch.rand(V, generator=g)
    weight[ids[0], 0] = torch.rand(k, generator=g)
    ids[:] = ids[0]
    t_lp = torch.log_softmax(torch.randn(N, k + 1, generator=g, dtype=torch.float64), -1)[:, :k].float()
    labels = torch.zeros(N, dtype=torch.long)
    h_in, w_in = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = divergence(h_in, w_in, labels, ids, t_lp, backend)
    assert torch.isfinite(out.divergence).all()
    out.divergence.sum().backward()
    assert torch.isfinite(w_in.grad).all()
    want = kl64(hidden.double(), weight.double(), ids, t_lp)
    assert ((out.divergence.double() - want).abs() / want.abs()).max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_teacher_mass_rounding_above_one(backend, seed):
    """k probabilities summing to 1 + 1e-6 (rounding of a full distribution's top ids): no tail term, finite."""
    hidden, weight, g = head(seed)
    k = 6
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    t_lp = (torch.log_softmax(torch.randn(N, k, generator=g, dtype=torch.float64), -1) + 1e-6).float()
    out = divergence(hidden, weight, torch.zeros(N, dtype=torch.long), ids, t_lp, backend)
    want = kl64(hidden.double(), weight.double(), ids, t_lp)
    assert torch.isfinite(out.divergence).all()
    assert (out.divergence.double() - want).abs().max() < 2e-5
