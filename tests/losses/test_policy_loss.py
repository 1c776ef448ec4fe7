"""fused_policy_loss on every backend (triton through its interpreter on CPU) against float64 ground truth
written from verl's definitions (policy64.py): loss, metrics and both gradients, on odd shapes, every
loss_agg, clipping active on both sides, dual clip, each KL type, entropy bonus, ignored rows holding
NaN, per-token temperature, packed sequences, several token chunks, and the autograd contract."""
from __future__ import annotations

import math

import pytest
import torch

from logitless import last_backend
from logitless.losses import LOSS_AGGS, PolicyLoss, fused_policy_loss, policy_loss, policy_loss_reference
from logitless.ops.triton.common import INTERPRETING
from policy64 import aggregate64, loss64, policy_inputs
from reference64 import close_everywhere

# These tests build CPU tensors, which the triton backend runs only through its interpreter (conftest sets
# TRITON_INTERPRET=1 where there is no GPU; on a GPU machine run them with TRITON_INTERPRET=1). There the compiled
# kernels are tested by tests/ops/test_triton_policy_kernels.py and benchmarks/gpu_policy_loss.py's checks.
TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETING, reason="CPU tensors: the triton backend needs its interpreter (TRITON_INTERPRET=1)"))
BACKENDS = ["chunked", "reference", TRITON]
V, H = 1031, 48           # prime vocabulary: a ragged last tile
LEAD = (3, 7)
# loss (times the aggregation's total weight), logprob and entropy max abs, gradient relative
TOL = {torch.float32: (2e-5, 2e-5, 2e-5, 1e-4), torch.bfloat16: (1e-4, 1e-3, 2e-3, 1e-2)}


@pytest.fixture
def small_chunks(monkeypatch):
    """Several token chunks per call: 4 tokens per chunk on the chunked backend, one token tile (16 in the
    interpreter) on the triton one."""
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * V))
    monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_BYTES", "1")


def run_and_check(backend, inputs, *, dtype=torch.float32, grad_hidden=True, grad_weight=True, **kw):
    """fused_policy_loss forward + backward against loss64; returns (output, float64 truth)."""
    hidden, weight, labels, adv, old, ref = inputs
    kw.setdefault("ref_logprobs", ref)
    h = hidden.detach().clone().requires_grad_(grad_hidden)
    w = weight.detach().clone().requires_grad_(grad_weight)
    out = fused_policy_loss(h, w, labels, adv, old, backend=backend, **kw)
    assert last_backend() == backend
    spec = {k: kw[k] for k in ("clip_low", "clip_high", "dual_clip", "kl_coef", "kl_type", "entropy_coef")
            if k in kw}
    truth = loss64(hidden, weight, labels, adv, old, temperature=kw.get("temperature", 1.0),
                   loss_agg=kw.get("loss_agg", "token-mean"), cu_seqlens=kw.get("cu_seqlens"),
                   ref=kw["ref_logprobs"], **spec)
    loss, lp, ent, clip_fraction, kl, dh, dw = truth
    tol = TOL[dtype]
    valid = labels != -100
    scale = float(aggregate64(torch.ones(labels.shape, dtype=torch.float64), valid, kw.get("loss_agg", "token-mean"),
                              kw.get("cu_seqlens")))
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert abs(out.loss.item() - loss.item()) <= tol[0] * max(scale, 1.0), (out.loss.item(), loss.item())
    for got, want, t in ((out.logprobs, lp, tol[1]), (out.entropy, ent, tol[2])):
        assert got.dtype == torch.float32 and got.shape == labels.shape and not got.requires_grad
        assert torch.isfinite(got).all() and (got.double() - want).abs().max().item() <= t
        assert (got[~valid] == 0).all()
    assert abs(out.clip_fraction.item() - clip_fraction.item()) <= 1e-6
    if kl is None:
        assert out.kl is None
    else:
        assert abs(out.kl.item() - kl.item()) <= tol[0] * max(scale, 1.0) * 10
    if grad_hidden or grad_weight:
        out.loss.backward()
    if grad_hidden:
        assert h.grad.dtype == dtype and h.grad.shape == hidden.shape
        assert (h.grad[~valid] == 0).all()          # ignored rows: no gradient, no NaN leaked
        close_everywhere(h.grad[valid], dh[valid], tol[3])
    else:
        assert h.grad is None
    if grad_weight:
        assert w.grad.dtype == dtype and w.grad.shape == weight.shape
        close_everywhere(w.grad, dw, tol[3])
    else:
        assert w.grad is None
    return out, truth


def active_clipping(inputs):
    """The inputs make both sides of the clip bind (so both branches of the max matter)."""
    hidden, weight, labels, adv, old, _ = inputs
    _, lp, *_ = loss64(hidden, weight, labels, adv, old)
    valid = labels != -100
    ratio, a = torch.exp(lp - old.double())[valid], adv[valid]
    return bool(((ratio < 0.8) & (a < 0)).any() and ((ratio > 1.28) & (a > 0)).any())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_every_aggregation(backend, loss_agg, small_chunks):
    inputs = policy_inputs(LEAD, H, V, old_noise=0.6)
    assert active_clipping(inputs)
    temperature = torch.rand(LEAD) + 0.5          # per token
    out, truth = run_and_check(backend, inputs, loss_agg=loss_agg, temperature=temperature, entropy_coef=0.03,
                               kl_coef=0.1, clip_low=0.2, clip_high=0.28)
    assert 0 < out.clip_fraction.item() < 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "abs", "k1+", "low_var_kl+"])
def test_kl_types(backend, kl_type, small_chunks):
    inputs = policy_inputs((2, 9), H, 263, old_noise=0.5)
    run_and_check(backend, inputs, kl_coef=0.7, kl_type=kl_type, loss_agg="seq-mean-token-sum", temperature=0.8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_term_dominant(backend, small_chunks):
    """An entropy coefficient large against small advantages: the entropy's share of dlogits dominates, so an
    error there cannot hide behind the policy-gradient part."""
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V)
    run_and_check(backend, (hidden, weight, labels, 0.05 * adv, old, ref), entropy_coef=1.5, temperature=1.3,
                  loss_agg="seq-mean-token-sum")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dual_clip_and_per_sequence_advantages(backend, small_chunks):
    hidden, weight, labels, _, old, ref = policy_inputs(LEAD, H, V)
    adv = -torch.rand(LEAD[0], 1) - 0.5                    # negative, one per sequence
    old = old - 1.5                                        # ratios near e^1.5 > 3: the dual clip binds
    out, truth = run_and_check(backend, (hidden, weight, labels, adv, old, ref), dual_clip=3.0, ref_logprobs=None)
    plain = loss64(hidden, weight, labels, adv, old)[0]
    assert abs(plain.item() - truth[0].item()) > 1e-3     # the dual clip changed the loss


@pytest.mark.parametrize("backend", ["chunked", TRITON])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_packed_sequences(backend, loss_agg, small_chunks):
    """1-D packed labels with cu_seqlens, one packed sequence empty and one with no scored token."""
    hidden, weight, labels, adv, old, ref = policy_inputs((23,), H, 517, ignored=0.2)
    cu = torch.tensor([0, 5, 5, 12, 16, 23])
    labels[12:16] = -100
    run_and_check(backend, (hidden, weight, labels, adv, old, ref), loss_agg=loss_agg, cu_seqlens=cu,
                  entropy_coef=0.02, clip_high=0.4)


@pytest.mark.parametrize("backend", ["chunked", TRITON])
def test_bfloat16(backend, small_chunks):
    inputs = policy_inputs((4, 9), 64, V, dtype=torch.bfloat16, old_noise=0.5)
    run_and_check(backend, inputs, dtype=torch.bfloat16, loss_agg="seq-mean-token-mean", entropy_coef=0.05,
                  kl_coef=0.2, temperature=0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_on_policy_three_dims_one_chunk(backend):
    """old_logprobs=None (ratio 1: the gradient of -A * logprob), labels [2, 3, 5] (sequences: last axis),
    every token in one chunk."""
    inputs = policy_inputs((2, 3, 5), 96, 389)
    out, _ = run_and_check(backend, inputs[:4] + (None, inputs[5]), loss_agg="seq-mean-token-sum",
                           entropy_coef=0.01)
    assert out.clip_fraction.item() == 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_subsets_and_no_grad(backend, small_chunks):
    inputs = policy_inputs(LEAD, H, V)
    run_and_check(backend, inputs, grad_weight=False, entropy_coef=0.1)
    run_and_check(backend, inputs, grad_hidden=False, loss_agg="token-sum")
    hidden, weight, labels, adv, old, _ = inputs
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad():
        out = fused_policy_loss(h, w, labels, adv, old, backend=backend)
    assert not out.loss.requires_grad
    assert abs(out.loss.item() - loss64(hidden, weight, labels, adv, old)[0].item()) <= 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_scored_token(backend):
    hidden, weight, labels, adv, old, _ = policy_inputs(LEAD, H, 131)
    labels = torch.full_like(labels, -100)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for agg in LOSS_AGGS:
        out = fused_policy_loss(h, w, labels, adv, old, backend=backend, loss_agg=agg)
        assert out.loss.item() == 0.0 and (out.logprobs == 0).all() and out.clip_fraction.item() == 0.0
        out.loss.backward()
        assert (h.grad == 0).all() and (w.grad == 0).all()
    empty = fused_policy_loss(h[:0], w, labels[:0], adv[:0], old[:0], backend=backend)
    assert empty.loss.item() == 0.0 and empty.logprobs.shape == (0, 7)


@pytest.mark.parametrize("backend", ["chunked", TRITON])
def test_micro_batches_accumulate_and_upstream_scale(backend, small_chunks):
    """Two micro-batches into the same .grad, the second loss scaled by 2.5: the float64 sum of both."""
    first, second = policy_inputs(LEAD, H, V), policy_inputs(LEAD, H, V)
    weight = first[1]
    h1, h2 = first[0].clone().requires_grad_(), second[0].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    kw = dict(backend=backend, entropy_coef=0.02, loss_agg="seq-mean-token-mean")
    (fused_policy_loss(h1, w, first[2], first[3], first[4], **kw).loss).backward()
    (2.5 * fused_policy_loss(h2, w, second[2], second[3], second[4], **kw).loss).backward()
    t1 = loss64(first[0], weight, first[2], first[3], first[4], entropy_coef=0.02, loss_agg="seq-mean-token-mean")
    t2 = loss64(second[0], weight, second[2], second[3], second[4], entropy_coef=0.02,
                loss_agg="seq-mean-token-mean")
    close_everywhere(w.grad, t1[6] + 2.5 * t2[6], 1e-4)
    valid = second[2] != -100
    close_everywhere(h2.grad[valid], 2.5 * t2[5][valid], 1e-4)


@pytest.mark.parametrize("backend", ["chunked", TRITON])
def test_second_backward_is_refused(backend):
    hidden, weight, labels, adv, old, _ = policy_inputs(LEAD, H, 131)
    w = weight.clone().requires_grad_()
    out = fused_policy_loss(hidden, w, labels, adv, old, backend=backend)
    out.loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()


@pytest.mark.parametrize("backend", ["chunked", TRITON])
def test_fused_equals_reference_path(backend, small_chunks):
    """fused_policy_loss and policy_loss_reference (fused_logprobs + autograd, same backend) agree."""
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, dtype=torch.bfloat16, old_noise=0.5)
    kw = dict(backend=backend, ref_logprobs=ref, kl_coef=0.05, entropy_coef=0.01, loss_agg="seq-mean-token-mean",
              dual_clip=2.0)
    outs = []
    for fn in (fused_policy_loss, policy_loss_reference):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fn(h, w, labels, adv, old, **kw)
        out.loss.backward()
        outs.append((out, h.grad, w.grad))
    (a, ha, wa), (b, hb, wb) = outs
    assert abs(a.loss.item() - b.loss.item()) <= 1e-5
    assert (a.logprobs - b.logprobs).abs().max() <= 1e-4 and (a.entropy - b.entropy).abs().max() <= 1e-4
    assert a.clip_fraction.item() == b.clip_fraction.item() and abs(a.kl.item() - b.kl.item()) <= 1e-5
    valid = labels != -100
    close_everywhere(ha[valid].float(), hb[valid].double(), 2e-2)
    close_everywhere(wa.float(), wb.double(), 2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_buffer_element_written(backend, small_chunks, monkeypatch):
    """torch.empty / empty_like poisoned with NaN for the call: any element the pass reads or returns
    without writing it first shows up as a NaN."""
    real_empty, real_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(math.nan) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_like(*a, **k)))
    run_and_check(backend, policy_inputs(LEAD, H, V), entropy_coef=0.02, loss_agg="seq-mean-token-sum-norm")


def test_policy_object_and_megatron_layout():
    """``policy_loss`` with a PolicyLoss and seq_first (hidden [s, b, H], labels and inputs [b, s]) equals
    the plain call on [b, s, H]."""
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, 131)
    policy = PolicyLoss(advantages=adv[:, :1].nan_to_num(0.5), old_logprobs=old, ref_logprobs=ref, kl_coef=0.1,
                        loss_agg="seq-mean-token-mean", entropy_coef=0.01)
    temperature = torch.rand(LEAD) + 0.5
    results = []
    for seq_first in (False, True):
        h = (hidden.transpose(0, 1) if seq_first else hidden).clone().requires_grad_()
        out = policy_loss(policy, h, weight, labels, temperature=temperature, backend="chunked", seq_first=seq_first)
        out.loss.backward()
        results.append((out, h.grad.transpose(0, 1) if seq_first else h.grad))
    (a, ga), (b, gb) = results
    assert abs(a.loss.item() - b.loss.item()) <= 1e-6
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6) and a.logprobs.shape == b.logprobs.shape == LEAD
    assert torch.allclose(ga, gb, atol=1e-6, rtol=1e-5)
