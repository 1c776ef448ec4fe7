"""Top-k distillation divergences: forward_kl_topk against verl 0.9.1's own functions on the same batch (its FSDP
logits-processor loss on the student's logits, then its registered loss's clamp at 0 and metrics), values,
gradients and logged metrics; forward_kl_topk_tail against float64 written from its definition; bad input."""
from __future__ import annotations

import math

import pytest
import torch

from logitless.losses.distill_topk import topk_divergence
from reference64 import device_for, on_cpu, rel_err

verl_losses = pytest.importorskip("verl.trainer.distillation.losses", reason="verl is not installed")
from tensordict import TensorDict  # noqa: E402
from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk as verl_fsdp_forward_kl_topk  # noqa: E402
from verl.workers.config import DistillationConfig, DistillationLossConfig  # noqa: E402

V, H, K = 4099, 96, 5
B, P, R = 2, 3, 4          # 2 sequences of 3 prompt + 4 response tokens: 14 tokens, 7 per sequence
BACKENDS = ("reference", "chunked", "triton")


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * 700))


def batch(seed, dtype=torch.float32):
    """Student hidden [B, P+R, H] / weight, and a teacher that agrees with the student in part (so the overlap
    is neither empty nor full): its logits are the student's plus noise, its top-k taken in float64."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, P + R, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(dtype).requires_grad_()
    z = hidden.detach().double() @ weight.detach().double().t()
    teacher = torch.log_softmax(1.5 * z + 1.5 * torch.randn(z.shape, generator=gen, dtype=torch.float64), -1)
    t_lp, t_ids = teacher.topk(K, dim=-1)
    return hidden, weight, t_ids, t_lp.float(), gen


def divergence(hidden, weight, *tensors, backend, **kw):
    """topk_divergence on the backend's device (the triton backend on the GPU where there is one: its compiled
    kernels refuse CPU tensors), the outputs back on the CPU. The moves are differentiable: the CPU leaves get
    the gradients, and the float64 ground truth stays on the CPU."""
    dev = device_for(backend)
    to = lambda t: t.to(dev) if torch.is_tensor(t) else t  # noqa: E731
    out = topk_divergence(to(hidden), to(weight), *map(to, tensors), backend=backend,
                          **{k: to(v) for k, v in kw.items()})
    return on_cpu(out)


def verl_data(response_mask):
    """The micro-batch TensorDict verl's registered loss reads (no padding: every sequence P + R tokens)."""
    return TensorDict({"prompts": torch.ones(B, P, dtype=torch.long), "responses": torch.ones(B, R, dtype=torch.long),
                       "attention_mask": torch.ones(B, P + R, dtype=torch.long), "response_mask": response_mask},
                      batch_size=[B])


def response_positions():
    # no_padding_2_padding's left shift: the response's R tokens are predicted at positions P-1 .. P+R-2
    return torch.arange(P - 1, P + R - 1)


@pytest.mark.parametrize("clamp", [None, -10.0, -4.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_kl_topk_is_verls(clamp, backend, seed):
    hidden, weight, t_ids, t_lp, gen = batch(seed)
    response_mask = torch.ones(B, R, dtype=torch.bool)
    response_mask[1, -1] = False
    cfg = DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=clamp, use_policy_gradient=False))

    # verl: the logits processor's per-token loss on the student's full logits, then its registered loss
    logits = (hidden.reshape(1, B * (P + R), H) @ weight.t())
    nested = lambda t: torch.nested.nested_tensor([t.reshape(B * (P + R), K)], layout=torch.jagged)  # noqa: E731
    out = verl_fsdp_forward_kl_topk(logits, nested(t_lp), nested(t_ids), cfg, "thd")
    model_output = {name: t[0] for name, t in out.items()}
    data = verl_data(response_mask)
    v_loss, v_metrics = verl_losses.compute_forward_kl_topk(None, cfg, model_output, data)
    mask = response_mask.float()
    ((v_loss * mask).sum() / mask.sum()).backward()           # token-mean over the response
    v_dh, v_dw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    labels = torch.full((B, P + R), -100)
    pos = response_positions()
    labels[:, pos] = torch.where(response_mask, 7, -100)       # scored tokens: the response's, as verl masks them
    t_ids_padded = t_ids.clone()
    t_ids_padded[labels == -100] = -5                           # padding the loss must never read
    got = divergence(hidden, weight, labels, t_ids_padded, t_lp, log_prob_min_clamp=clamp, backend=backend)
    assert got.divergence.shape == labels.shape and got.divergence.dtype == torch.float32
    assert (got.divergence[labels == -100] == 0).all()
    (got.divergence.sum() / mask.sum()).backward()

    d = got.divergence[:, pos]
    torch.testing.assert_close(d[response_mask], v_loss[response_mask], atol=2e-5, rtol=1e-5)
    assert rel_err(hidden.grad, v_dh) < 1e-4 and rel_err(weight.grad, v_dw) < 1e-4
    for name in ("student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
        want = out[name][0].view(B, P + R)[:, pos][response_mask]
        torch.testing.assert_close(got.token_stats[name][:, pos][response_mask].to(want.dtype), want, atol=2e-6,
                                   rtol=1e-5)
    counts = got.token_stats["overlap_count"][:, pos][response_mask]
    assert 0 < counts.float().mean() < K, "the batch must test a partial overlap"
    v_metrics.update(verl_losses.compute_distillation_loss_range(v_loss, response_mask))
    assert set(v_metrics) == set(got.metrics)
    for name, value in v_metrics.items():
        want = value.aggregate() if hasattr(value, "aggregate") else value
        assert math.isclose(float(got.metrics[name]), float(want), rel_tol=1e-5, abs_tol=2e-6), (name, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("clamp", [None, -4.0])
def test_forward_kl_topk_tail_matches_float64(backend, clamp, seed):
    hidden, weight, t_ids, t_lp, gen = batch(seed)
    temperature = torch.rand(B, 1, generator=gen) + 0.5
    labels = torch.randint(0, V, (B, P + R), generator=gen)
    labels[0, :2] = -100
    got = divergence(hidden, weight, labels, t_ids, t_lp, divergence="forward_kl_topk_tail",
                     temperature=temperature, backend=backend, log_prob_min_clamp=clamp)
    g = torch.randn(labels.shape, generator=gen)
    (got.divergence * g).sum().backward()

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    s = torch.log_softmax((h64 @ w64.t()) / temperature.double().unsqueeze(-1), -1)
    s_k = s.gather(-1, t_ids)
    s_tail = torch.logsumexp(s.scatter(-1, t_ids, float("-inf")), -1)     # the mass outside the teacher's ids
    q_k = t_lp.double()
    q_tail = 1 - q_k.exp().sum(-1)
    if clamp is not None:
        s_k, q_k = s_k.clamp_min(clamp), q_k.clamp_min(clamp)
    want = (q_k.exp() * (q_k - s_k)).sum(-1) + q_tail * (q_tail.log() - s_tail)
    want = want * (labels != -100)
    (want * g.double()).sum().backward()
    assert (got.divergence.double() - want).abs().max() < 5e-5
    assert rel_err(hidden.grad, h64.grad) < 2e-4 and rel_err(weight.grad, w64.grad) < 2e-4


def test_tail_when_the_teacher_top_k_hold_everything(seed):
    """Teacher log-probs summing to 1 (or more, by rounding): the tail bucket adds nothing, no NaN."""
    hidden, weight, t_ids, t_lp, gen = batch(seed)
    labels = torch.zeros(B, P + R, dtype=torch.long)
    full = torch.log(torch.full_like(t_lp, 1.0 / K))
    a = topk_divergence(hidden, weight, labels, t_ids, full, divergence="forward_kl_topk_tail", backend="chunked")
    b = topk_divergence(hidden, weight, labels, t_ids, full, backend="chunked")
    assert torch.isfinite(a.divergence).all()
    torch.testing.assert_close(a.divergence, b.divergence, atol=1e-5, rtol=1e-6)   # no clamp bites: KL >= 0 here


def test_bad_input(seed):
    hidden, weight, t_ids, t_lp, gen = batch(seed)
    labels = torch.zeros(B, P + R, dtype=torch.long)
    run = lambda ids=t_ids, lp=t_lp, **kw: topk_divergence(hidden, weight, labels, ids, lp, **kw)  # noqa: E731
    bad = t_lp.clone()
    bad[0, 1, 2] = 0.01
    with pytest.raises(ValueError, match="teacher_topk_logprobs must be <= 0"):
        run(lp=bad)
    bad[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="teacher_topk_logprobs must be <= 0 and not NaN"):
        run(lp=bad)
    bad = t_ids.clone()
    bad[1, 0, 0] = V
    with pytest.raises(ValueError, match=r"teacher_topk_ids must lie in \[0, 4099\)"):
        run(ids=bad)
    bad = t_ids.clone()
    bad[1, 2, 3] = bad[1, 2, 0]
    with pytest.raises(ValueError, match="teacher_topk_ids: token 9 repeats an id"):
        run(ids=bad)
    with pytest.raises(ValueError, match="divergence must be one of"):
        run(divergence="reverse_kl_topk")
    with pytest.raises(ValueError, match="teacher_topk_logprobs shape"):
        run(lp=t_lp[..., :3])
    with pytest.raises(ValueError, match="teacher_topk_ids shape"):
        run(ids=t_ids[:, :3])
    with pytest.raises(ValueError, match="log_prob_min_clamp must be finite"):
        run(log_prob_min_clamp=float("-inf"))
    # k log-probs each <= 0 whose probabilities sum above 1 are not one distribution's (the top-k divergence
    # without the tail too): e.g. the same value for every id, -0.1 (mass 0.9 each)
    for divergence in ("forward_kl_topk", "forward_kl_topk_tail"):
        with pytest.raises(ValueError, match="teacher_topk_logprobs: a scored token's k probabilities sum to"):
            run(lp=torch.full_like(t_lp, -0.1), divergence=divergence)
    # an unscored token's teacher data is padding: never checked, never read
    labels[1, 2] = -100
    padded_ids, padded_lp = t_ids.clone(), t_lp.clone()
    padded_ids[1, 2] = -1
    padded_lp[1, 2] = float("nan")
    out = topk_divergence(hidden, weight, labels, padded_ids, padded_lp, backend="chunked")
    assert out.divergence[1, 2] == 0 and torch.isfinite(out.divergence).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["forward_kl_topk", "forward_kl_topk_tail"])
def test_without_overlap_the_same_divergence(backend, name, seed):
    """with_overlap=False (forward_kl_topk then runs the backend's own statistics pass): the same values,
    gradients and masses, no overlap entries."""
    hidden, weight, t_ids, t_lp, gen = batch(seed)
    labels = torch.randint(0, V, (B, P + R), generator=gen)
    labels[1, 4:] = -100
    g = torch.randn(labels.shape, generator=gen)
    got = []
    for with_overlap in (True, False):
        hidden.grad = weight.grad = None
        out = divergence(hidden, weight, labels, t_ids, t_lp, divergence=name, backend=backend,
                         temperature=0.8, softcap=4.0, with_overlap=with_overlap)
        (out.divergence * g).sum().backward()
        got.append((out, hidden.grad.clone(), weight.grad.clone()))
    (a, ah, aw), (b, bh, bw) = got
    torch.testing.assert_close(b.divergence, a.divergence, atol=2e-5, rtol=1e-5)
    assert rel_err(bh, ah) < 1e-5 and rel_err(bw, aw) < 1e-5
    assert set(a.metrics) - set(b.metrics) == {"distillation/overlap_ratio", "distillation/overlap_token_advantage"}
    for name, value in b.metrics.items():
        torch.testing.assert_close(value, a.metrics[name], atol=2e-6, rtol=1e-5)
    assert "overlap_count" not in b.token_stats


def test_compile_fullgraph(seed):
    """The checks' host synchronisations are inside custom ops: a compiled caller has no graph break."""
    hidden, weight, t_ids, t_lp, gen = batch(seed)
    labels = torch.randint(0, V, (B, P + R), generator=gen)
    labels[0, :3] = -100

    def f(h, w):
        out = topk_divergence(h, w, labels, t_ids, t_lp, divergence="forward_kl_topk_tail", backend="chunked",
                              log_prob_min_clamp=-8.0)
        return out.divergence.sum() + out.metrics["distillation/overlap_ratio"]

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(hidden, weight)
    got.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = f(hidden, weight)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gh, hidden.grad)
    torch.testing.assert_close(gw, weight.grad)


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_clamped_masses_sum_after_the_clamp(backend, seed):
    """clamped_masses=True (verl's Megatron convention): student_mass = sum exp(max(s_i, c)), teacher_mass =
    sum exp(max(t_i, c)) against float64, with the clamp binding on both sides; divergence, overlap and gradients
    as without it. Without a clamp the setting has no effect: a ValueError."""
    hidden, weight, t_ids, t_lp, _ = batch(seed)
    labels = torch.full((B, P + R), 7)
    s = torch.log_softmax(hidden.detach().double() @ weight.detach().double().t(), -1).gather(-1, t_ids)
    c = float(torch.quantile(torch.cat([s.flatten(), t_lp.double().flatten()]), 0.3))      # binds on both sides
    assert bool((s < c).any()) and bool((t_lp < c).any())
    plain = divergence(hidden, weight, labels, t_ids, t_lp, log_prob_min_clamp=c, backend=backend)
    got = divergence(hidden, weight, labels, t_ids, t_lp, log_prob_min_clamp=c, backend=backend,
                     clamped_masses=True)
    want_s, want_t = s.clamp_min(c).exp().sum(-1), t_lp.double().clamp_min(c).exp().sum(-1)
    torch.testing.assert_close(got.token_stats["student_mass"].double(), want_s, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got.token_stats["teacher_mass"].double(), want_t, atol=2e-6, rtol=1e-5)
    assert not torch.allclose(plain.token_stats["student_mass"], got.token_stats["student_mass"])
    assert math.isclose(float(got.metrics["distillation/teacher_mass"]), float(want_t.mean()), rel_tol=1e-5)
    for name in ("overlap_count", "overlap_token_advantage"):
        assert torch.equal(got.token_stats[name], plain.token_stats[name])
    assert torch.equal(got.divergence, plain.divergence)
    with pytest.raises(ValueError, match="clamped_masses=True has no effect without log_prob_min_clamp"):
        topk_divergence(hidden, weight, labels, t_ids, t_lp, clamped_masses=True)
    with pytest.raises(TypeError, match="clamped_masses"):
        topk_divergence(hidden, weight, labels, t_ids, t_lp, log_prob_min_clamp=c, clamped_masses=1)
