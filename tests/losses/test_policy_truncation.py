"""The policy losses under a sampler's truncation (``truncation=Truncation(...)``): the loss, its log-probs,
entropies, KL and both gradients against float64 ground truth written from vLLM's order with materialised logits
(truncation64.py; the terms and aggregation from policy64.py); settings that are all off give the untruncated loss
bit for bit; the refusals."""
from __future__ import annotations

import pytest
import torch

from logitless import Truncation
from logitless.losses import PolicyLoss, fused_policy_loss, policy_loss, policy_loss_reference
from policy64 import aggregate64, policy_inputs, term64
from truncation64 import truth64

V, H = 4099, 96
LEAD = (2, 7)
# loss (times the aggregation's weight), log-prob and entropy max abs, gradient relative (the plain op's bounds)
TOL = (2e-5, 2e-5, 2e-5, 1e-4)
SPEC = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_type="k3", entropy_coef=0.01)


def _around(hidden, weight, labels, temperature, **trunc):
    """Old and reference log-probs drawn around the *truncated* log-probs (as an integration scores them: ratios
    near 1, clipped on both sides), NaN where ignored."""
    valid = labels != -100
    with torch.no_grad():
        lp = truth64(torch.nan_to_num(hidden), weight, labels, temperature=temperature, **trunc).logprobs
    nan = torch.full(LEAD, float("nan"))
    old, ref = ((lp + 0.3 * torch.randn(LEAD).double()).clamp(max=0.0).float() for _ in range(2))
    return torch.where(valid, old, nan), torch.where(valid, ref, nan)


def _inputs(temperature, **trunc):
    """policy64's inputs (NaN hidden states and inputs where ignored), old and ref from ``_around``."""
    hidden, weight, labels, adv, _, _ = policy_inputs(LEAD, H, V, logit_std=3.0)
    return (hidden, weight, labels, adv) + _around(hidden, weight, labels, temperature, **trunc)


def _truth(hidden, weight, labels, adv, old, ref, temperature, loss_agg, **trunc):
    valid = labels != -100
    h = torch.where(valid.unsqueeze(-1), hidden.detach().double(), 0.0).requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    t64 = truth64(h, w, labels, temperature=temperature, **trunc)
    lp, ent, keep = t64.logprobs, t64.entropy, t64.kept
    zero = torch.zeros_like(lp)
    adv_, old_, ref_ = (torch.where(valid, torch.broadcast_to(x.double(), labels.shape), zero) for x in (adv, old, ref))
    f, _, kl = term64(lp, ent, adv_, old_, ref_, **SPEC)
    loss = aggregate64(f, valid, loss_agg)
    loss.backward()
    return loss.detach(), lp.detach(), ent.detach(), aggregate64(kl.detach(), valid, loss_agg), h.grad, w.grad, keep


def _check(out, truth, labels, h, w, loss_agg):
    loss, lp, ent, kl, dh, dw, keep = truth
    valid = labels != -100
    scale = float(aggregate64(torch.ones(labels.shape, dtype=torch.float64), valid, loss_agg))
    d = (out.logprobs.double() - lp).abs()
    assert d.max().item() <= TOL[1], (d.max(), d.argmax(), keep.sum(-1), out.logprobs, lp)
    assert (out.entropy.double() - ent).abs().max().item() <= TOL[2]
    assert abs(out.loss.item() - loss.item()) <= TOL[0] * max(scale, 1.0, abs(loss.item())), (out.loss.item(),
                                                                                           loss.item())
    assert abs(out.kl.item() - kl.item()) <= TOL[0] * max(scale, 1.0, abs(kl.item()))
    for got, want in ((h.grad, dh), (w.grad, dw)):
        got = torch.where(torch.isfinite(got), got, 0.0)       # the ignored rows' NaN hidden states get 0
        assert float((got.double() - want).norm() / want.norm()) <= TOL[3]
    kept = keep[valid].sum(-1)
    print(f"kept sets {kept.tolist()}")
    assert bool((kept < V).all()) and bool((kept > 1).any()), "every scored token truncated, not all to one id"


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_under_truncation_equals_float64(seed, fused, loss_agg):
    temperature = 0.7
    top_k = torch.tensor([[40], [-1]])                   # per sequence
    top_p = torch.rand(LEAD) * 0.25 + 0.7                # per token
    trunc = dict(top_k=top_k, top_p=top_p, min_p=0.002)
    hidden, weight, labels, adv, old, ref = _inputs(temperature, **trunc)
    truth = _truth(hidden, weight, labels, adv, old, ref, temperature, loss_agg, **trunc)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    call = fused_policy_loss if fused else policy_loss_reference
    out = call(h, w, labels, adv, old, ref_logprobs=ref, temperature=temperature, loss_agg=loss_agg,
               truncation=Truncation(**trunc), **SPEC)
    out.loss.backward()
    _check(out, truth, labels, h, w, loss_agg)
    # the untruncated loss differs: the truncation changed the numbers
    plain = fused_policy_loss(hidden, weight, labels, adv, old, ref_logprobs=ref, temperature=temperature,
                              loss_agg=loss_agg, **SPEC)
    assert (plain.logprobs - out.logprobs).abs().max() > 1e-3


def test_replayed_kept_ids_equal_float64(seed):
    hidden, weight, labels, adv, _, _ = policy_inputs(LEAD, H, V, logit_std=3.0)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (*LEAD, 9), generator=gen)
    ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, -1, ids)
    ids[..., 0] = torch.where(labels >= 0, labels, 0)
    ids = torch.where((ids.unsqueeze(-1) == ids.unsqueeze(-2)).triu(1).any(-2), -1, ids)   # no id twice
    old, ref = _around(hidden, weight, labels, 1.0, kept_ids=ids)
    truth = _truth(hidden, weight, labels, adv, old, ref, 1.0, "token-mean", kept_ids=ids)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fused_policy_loss(h, w, labels, adv, old, ref_logprobs=ref, truncation=Truncation(kept_ids=ids), **SPEC)
    out.loss.backward()
    _check(out, truth, labels, h, w, "token-mean")


def test_seq_first_takes_settings_in_the_labels_layout(seed):
    """Megatron's layout: hidden [s, b, H], labels and every per-token tensor [b, s] (the settings too, as the
    temperature): the same numbers as the [b, s] call."""
    hidden, weight, labels, adv, old, ref = _inputs(0.8)
    hidden = torch.nan_to_num(hidden, nan=0.0)
    top_p = torch.rand(LEAD) * 0.5 + 0.45
    top_k = torch.tensor([[25], [60]])
    temperature = torch.rand(LEAD) + 0.5
    trunc = Truncation(top_k=top_k, top_p=top_p)
    policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, **SPEC)
    a = policy_loss(policy, hidden, weight, labels, temperature=temperature, truncation=trunc)
    b = policy_loss(policy, hidden.transpose(0, 1).contiguous(), weight, labels, temperature=temperature,
                    truncation=trunc, seq_first=True)
    assert abs(a.loss.item() - b.loss.item()) <= 1e-6
    assert torch.allclose(a.logprobs, b.logprobs, atol=1e-6) and torch.allclose(a.entropy, b.entropy, atol=1e-6)
    truth = truth64(hidden, weight, labels, temperature=temperature, top_k=top_k, top_p=top_p)
    assert (b.logprobs.double() - truth.logprobs).abs().max().item() <= TOL[1]


@pytest.mark.parametrize("fused", [True, False])
def test_settings_all_off_are_the_untruncated_loss_bit_for_bit(seed, fused):
    hidden, weight, labels, adv, old, ref = _inputs(1.0)
    call = fused_policy_loss if fused else policy_loss_reference
    results = []
    for trunc in (None, Truncation(), Truncation(top_k=-1, top_p=1.0, min_p=0.0)) + (
            () if fused else (Truncation(top_k=torch.full(LEAD, -1), top_p=torch.ones(LEAD)),)):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        out = call(h, w, labels, adv, old, ref_logprobs=ref, temperature=0.9, truncation=trunc, **SPEC)
        out.loss.backward()
        results.append((out.loss, out.logprobs, out.entropy, out.kl, h.grad, w.grad))
    for other in results[1:]:
        for x, y in zip(results[0], other, strict=True):
            assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(y))


def test_truncation_refusals():
    hidden, weight, labels, adv, old, ref = _inputs(1.0)
    with pytest.raises(ValueError, match="truncation"):
        fused_policy_loss(hidden, weight, labels, adv, old, check_inputs=False, truncation=Truncation(top_p=0.9))
    with pytest.raises(TypeError, match="truncation"):
        fused_policy_loss(hidden, weight, labels, adv, old, truncation={"top_p": 0.9})
    with pytest.raises(ValueError, match="top_p"):
        fused_policy_loss(hidden, weight, labels, adv, old, truncation=Truncation(top_p=1.5))
    with pytest.raises(ValueError, match="top_k"):
        fused_policy_loss(hidden, weight, labels, adv, old, truncation=Truncation(top_k=0))
    with pytest.raises(ValueError, match="min_p"):
        policy_loss_reference(hidden, weight, labels, adv, old, truncation=Truncation(min_p=-0.1))
    with pytest.raises(ValueError, match="top_p"):
        fused_policy_loss(hidden, weight, labels, adv, old, truncation=Truncation(top_p=torch.full((2, 3), 0.9)))
    with pytest.raises(TypeError, match="truncation"):
        PolicyLoss(advantages=adv, truncation=Truncation(top_p=0.9))
