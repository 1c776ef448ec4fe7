"""The per-token term and the aggregation weights against verl's own functions (verl 0.9.1:
compute_policy_loss_vanilla, agg_loss, kl_penalty), values and gradients, in float64; and against the
float64 definitions written out in policy64.py."""
from __future__ import annotations

import pytest
import torch

from logitless.losses.aggregate import LOSS_AGGS, token_weights
from logitless.losses.policy import PolicyLoss
from logitless.ops.policy_terms import TokenInputs, kl_estimate, per_token_terms, weighted_terms
from policy64 import aggregate64, kl64, term64
from required import import_or_skip

core = import_or_skip("verl.trainer.ppo.core_algos", "make setup installs verl (the verl integration's tests)")

B, S = 5, 11


class VerlActorConfig:
    """The attributes of verl's ActorConfig that compute_policy_loss_vanilla reads."""

    def __init__(self, clip_low, clip_high, dual_clip):
        self.clip_ratio = clip_low
        self.clip_ratio_low, self.clip_ratio_high = clip_low, clip_high
        self._c = dual_clip
        self.global_batch_info = {}

    def get(self, key, default=None):
        return self._c if key == "clip_ratio_c" else default


def batch():
    """log-probs (leaf, float64), old / ref log-probs around them, advantages and a response mask with a
    fully masked row and a partly masked one."""
    lp = (-torch.rand(B, S, dtype=torch.float64) * 3).requires_grad_(True)
    old = lp.detach() + 0.5 * torch.randn(B, S, dtype=torch.float64)
    ref = lp.detach() + 0.5 * torch.randn(B, S, dtype=torch.float64)
    adv = torch.randn(B, S, dtype=torch.float64)
    mask = torch.rand(B, S) < 0.8
    mask[1] = False
    mask[2, :3] = True
    # the first token of each row: ratio e^1.5 > 3 with a negative advantage (the dual clip binds)
    old[:, 0] = lp.detach()[:, 0] - 1.5
    adv[:, 0] = -adv[:, 0].abs()
    return lp, old, ref, adv, mask


def ours(lp, ent, old, ref, adv, mask, loss_agg, **kw):
    policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_agg=loss_agg, **kw)
    w = token_weights(mask, loss_agg)
    m = mask.reshape(-1)
    tokens = TokenInputs(adv.reshape(-1)[m], old.reshape(-1)[m], ref.reshape(-1)[m], w.reshape(-1)[m])
    return weighted_terms(lp.reshape(-1)[m], ent.reshape(-1)[m], tokens, policy.term_spec())


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_policy_gradient_term_equals_verl(loss_agg):
    lp, old, ref, adv, mask = batch()
    ent = torch.zeros_like(lp)
    want, metrics = core.compute_policy_loss_vanilla(old, lp, adv, mask.double(), loss_agg,
                                                     VerlActorConfig(0.2, 0.28, 3.0))
    (g_want,) = torch.autograd.grad(want, lp)
    got, clipped, _ = ours(lp, ent, old, ref, adv, mask, loss_agg, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    (g_got,) = torch.autograd.grad(got, lp)
    assert abs(got.item() - want.item()) <= 1e-9 * max(1.0, abs(want.item())) + 1e-7 * abs(want.item())
    assert torch.allclose(g_got, g_want, rtol=1e-6, atol=1e-12)
    # verl's masked_mean divides by (count + 1e-8)
    assert abs(clipped.item() / mask.sum().item() - metrics["actor/pg_clipfrac"]) <= 1e-8
    # the dual clip and both sides of the clip were active
    ratio = torch.exp(lp.detach() - old)[mask]
    assert (ratio < 0.8).any() and (ratio > 1.28).any() and (ratio > 3).any()


@pytest.mark.parametrize("kl_type", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+"])
def test_kl_estimates_equal_verl(kl_type):
    lp, _, ref, _, _ = batch()
    want = core.kl_penalty(lp, ref, kl_type)
    got = kl_estimate(lp, ref, {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}.get(kl_type, kl_type))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    g_want, = torch.autograd.grad(want.sum(), lp)
    g_got, = torch.autograd.grad(got.sum(), lp)
    assert torch.allclose(g_got, g_want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(kl64(lp, ref, kl_type), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_whole_actor_loss_equals_verl(loss_agg):
    """verl's actor: pg_loss + kl_coef * agg(kl) - entropy_coeff * agg(entropy), all with the same agg."""
    lp, old, ref, adv, mask = batch()
    ent = (torch.rand(B, S, dtype=torch.float64) * 4).requires_grad_(True)
    m = mask.double()
    pg, _ = core.compute_policy_loss_vanilla(old, lp, adv, m, loss_agg, VerlActorConfig(0.25, 0.3, 2.5))
    kl = core.agg_loss(core.kl_penalty(lp, ref, "low_var_kl"), m, loss_agg)
    want = pg + 0.3 * kl - 0.02 * core.agg_loss(ent, m, loss_agg)
    got, _, kl_got = ours(lp, ent, old, ref, adv, mask, loss_agg, clip_low=0.25, clip_high=0.3, dual_clip=2.5,
                          kl_coef=0.3, kl_type="low_var_kl", entropy_coef=0.02)
    assert abs(got.item() - want.item()) <= 1e-7 * max(1.0, abs(want.item()))
    assert abs(kl_got.item() - kl.item()) <= 1e-7 * max(1.0, abs(kl.item()))
    for x in (lp, ent):
        g_want, = torch.autograd.grad(want, x, retain_graph=True)
        g_got, = torch.autograd.grad(got, x, retain_graph=True)
        assert torch.allclose(g_got, g_want, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_weights_equal_written_out_aggregation(loss_agg):
    """token_weights against policy64's loops, for [b, s] labels and for packed ones with cu_seqlens."""
    values = torch.randn(4, 6, dtype=torch.float64)
    valid = torch.rand(4, 6) < 0.7
    valid[3] = False
    got = (token_weights(valid, loss_agg) * values).sum()
    assert abs(got.item() - aggregate64(values, valid, loss_agg).item()) <= 1e-12
    cu = torch.tensor([0, 4, 4, 9, 17, 24])
    flat_valid = valid.reshape(-1)
    got = (token_weights(flat_valid, loss_agg, cu) * values.reshape(-1)).sum()
    assert abs(got.item() - aggregate64(values.reshape(-1), flat_valid, loss_agg, cu).item()) <= 1e-12


def test_terms_equal_written_out_definition():
    lp, old, ref, adv, mask = batch()
    ent = torch.rand(B, S, dtype=torch.float64)
    spec = dict(clip_low=0.1, clip_high=0.5, dual_clip=4.0, kl_coef=0.2, kl_type="k2", entropy_coef=0.3)
    policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, **spec)
    tokens = TokenInputs(adv, old, ref, torch.ones_like(adv))
    f, clipped, kl = per_token_terms(lp, ent, tokens, policy.term_spec())
    # per_token_terms leaves the entropy bonus to weighted_terms (it has weights of its own)
    f = f - spec["entropy_coef"] * ent
    f64, clipped64, kl64_ = term64(lp, ent, adv, old, ref, **spec)
    assert torch.allclose(f, f64, rtol=1e-14, atol=1e-14) and torch.equal(clipped, clipped64)
    assert torch.allclose(kl, kl64_, rtol=1e-14, atol=1e-14)
