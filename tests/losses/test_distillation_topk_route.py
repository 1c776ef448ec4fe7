"""fused_distillation_loss's top-k route: the per-token term of ``distill_topk.topk_divergence`` (held to verl's
own functions by test_distill_topk.py), aggregated by loss_agg / num_items_in_batch / token_weight as the
full-vocabulary divergences are, verl's loss_max_clamp, verl's metrics and per-token diagnostics passed on, and the
settings that have no effect there refused."""
from __future__ import annotations

import pytest
import torch

from distill64 import weights64
from logitless.losses import fused_distillation_loss
from logitless.losses.distill_topk import topk_divergence

V, H, K = 4099, 96, 5
LEAD = (3, 7)


def batch():
    hidden = torch.randn(*LEAD, H)
    weight = torch.randn(V, H) * 0.3
    z = hidden.double() @ weight.double().t()
    teacher = torch.log_softmax(1.5 * z + 1.5 * torch.randn(z.shape, dtype=torch.float64), -1)
    t_lp, t_ids = teacher.topk(K, dim=-1)
    labels = torch.randint(0, V, LEAD)
    labels[0, :3] = -100
    labels[2, 5] = -100
    return hidden, weight, t_ids, t_lp.float(), labels


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("divergence", ["forward_kl_topk", "forward_kl_topk_tail"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_topk_route_aggregates_the_term(divergence, loss_agg, monkeypatch):
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * 700))
    hidden, weight, t_ids, t_lp, labels = batch()
    temperature = torch.rand(LEAD[0], 1) + 0.5
    tw = torch.rand(LEAD) + 0.5
    kw = dict(divergence=divergence, temperature=temperature, log_prob_min_clamp=-6.0)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = topk_divergence(h2, w2, labels, t_ids, t_lp, **kw)
    valid = labels != -100
    # the clamp at the median of this draw's terms, so that it bites on about half the tokens whatever the draw
    # (a fixed 1.0 missed every token of some draws of the tail variant)
    # (between two terms, not on the median term itself: the two routes' float32 terms differ by rounding, and a
    # term on the clamp would get its gradient or not by that rounding)
    size = ref.divergence[valid].detach().abs()
    ordered = size.sort().values
    clamp = ((ordered[ordered.numel() // 2 - 1] + ordered[ordered.numel() // 2]) / 2).item()
    assert (size > clamp).any() and (size < clamp).any()   # the clamp bites

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_distillation_loss(h1, w1, labels, teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp,
                                  loss_agg=loss_agg, token_weight=tw, loss_max_clamp=clamp, **kw)
    out.loss.backward()
    w = weights64(valid, loss_agg) * tw.double()
    clamped = ref.divergence.clamp(-clamp, clamp)
    loss = (clamped.double() * w).sum()
    loss.backward()
    assert abs(out.loss.item() - loss.item()) <= 1e-6 * max(1.0, loss.item())
    # forward_kl_topk takes the one-pass route (its statistics summed by the policy pass: float32 rounding apart
    # from topk_divergence's; test_distill_topk_one_pass.py), the tail divergence topk_divergence's own
    same = torch.equal if divergence == "forward_kl_topk_tail" else close
    assert same(out.divergence, clamped.detach())
    assert out.entropy is None
    assert torch.equal(out.overlap_count, ref.token_stats["overlap_count"])
    for name in ("student_mass", "teacher_mass", "overlap_token_advantage"):
        assert same(getattr(out, name), ref.token_stats[name]), name
    assert set(out.metrics) == set(ref.metrics)
    for name, value in ref.metrics.items():
        assert same(out.metrics[name], value), name
    for got, want in ((h1.grad, h2.grad), (w1.grad, w2.grad)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def test_topk_route_without_overlap():
    """with_overlap=False passes through: no overlap diagnostics, the same loss and gradients."""
    hidden, weight, t_ids, t_lp, labels = batch()
    kw = dict(teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp, divergence="forward_kl_topk")
    grads = []
    for overlap in (True, False):
        h = hidden.clone().requires_grad_()
        out = fused_distillation_loss(h, weight, labels, with_overlap=overlap, **kw)
        out.loss.backward()
        grads.append((out.loss.detach(), h.grad))
        assert (out.overlap_count is None) == (not overlap)
        assert ("distillation/overlap_ratio" in out.metrics) == overlap
    assert torch.allclose(grads[0][0], grads[1][0], rtol=1e-6)
    assert (grads[0][1] - grads[1][1]).abs().max() <= 1e-5 * grads[1][1].abs().max()


@pytest.mark.parametrize("changes,error,match", [
    ({"student_logit_scale": 0.0}, ValueError, "student_logit_scale"),
    ({"teacher_softcap": 5.0}, ValueError, "teacher_softcap has no effect"),
    ({"teacher_logit_scale": 0.5}, ValueError, "teacher_logit_scale has no effect"),
    ({"clamp": -3.0}, TypeError, "unknown argument.*clamp"),
    ({"los_max_clamp": 1.0}, TypeError, "unknown argument.*los_max_clamp.*did you mean 'loss_max_clamp'"),
    ({"temprature": 0.5}, TypeError, "unknown argument.*temprature.*did you mean 'temperature'"),
    # refused on this route too (it reads the weights itself): a negative or NaN weight at a scored token
    ({"token_weight": -torch.rand(LEAD[0], 1)}, ValueError, "token_weight must be finite and >= 0"),
    ({"token_weight": torch.full((LEAD[0], 1), float("nan"))}, ValueError, "token_weight must be finite and >= 0"),
    ({"loss_max_clamp": -1.0}, ValueError, "loss_max_clamp"),
    ({"teacher_topk_ids": None}, ValueError, "needs teacher_topk_ids"),
    ({"beta": 0.5}, ValueError, "does not use it"),
])
def test_topk_route_refusals(changes, error, match):
    hidden, weight, t_ids, t_lp, labels = batch()
    kw = dict(teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp, divergence="forward_kl_topk")
    kw.update(changes)
    with pytest.raises(error, match=match):
        fused_distillation_loss(hidden, weight, labels, **kw)
