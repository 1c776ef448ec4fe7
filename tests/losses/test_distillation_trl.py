"""fused_distillation_loss against TRL's own code on the same inputs: ``trl.kernels.ChunkedDivergenceFunction``
(per-token divergence, the student's entropy, both student gradients) and the DistillationTrainer's loss
function ``_chunked_divergence_loss`` (its completion mask, num_items_in_batch, entropy sum), with TRL's beta,
temperature, logit scales and softcaps, heads of different widths and dtypes (V = 4099, H 96 and 80)."""
from __future__ import annotations

import pytest
import torch

from logitless.losses import fused_distillation_loss

trl_kernels = pytest.importorskip("trl.kernels.chunked_divergence", reason="TRL 1.16's chunked divergence")
trl_trainer = pytest.importorskip("trl.trainer.distillation_trainer", reason="TRL 1.16's DistillationTrainer")

V, HS, HT = 4099, 96, 80


def heads(lead, s_dtype=torch.float32, t_dtype=torch.float32):
    hs = torch.randn(*lead, HS).to(s_dtype)
    ws = (torch.randn(V, HS) / HS ** 0.5 * 3).to(s_dtype)
    ht = torch.randn(*lead, HT).to(t_dtype)
    wt = (torch.randn(V, HT) / HT ** 0.5 * 3).to(t_dtype)
    return hs, ws, ht, wt


def ours_for_beta(beta):
    """TRL's beta as our divergence arguments: jsd takes every beta; 0 and 1 also have names of their own."""
    return {"divergence": "jsd", "beta": beta}


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.2, 1.0])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("post", [{}, {"s_scale": 1.5, "s_cap": 5.0, "t_scale": 0.7, "t_cap": 8.0}])
def test_chunked_divergence_function(beta, dtypes, post):
    n = 23
    hs, ws, ht, wt = heads((n,), *dtypes)
    s_scale, t_scale = post.get("s_scale", 1.0), post.get("t_scale", 1.0)
    s_cap, t_cap = post.get("s_cap"), post.get("t_cap")
    h1, w1 = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    div, ent = trl_kernels.ChunkedDivergenceFunction.apply(h1, w1, None, ht, wt, None, beta, 0.8, s_scale, s_cap,
                                                           t_scale, t_cap)
    g = torch.rand(n)
    (div * g).sum().backward()

    h2, w2 = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    labels = torch.randint(0, V, (n,))
    out = fused_distillation_loss(h2, w2, labels, teacher_hidden=ht, teacher_weight=wt, temperature=0.8,
                                  loss_agg="token-sum", token_weight=g, student_logit_scale=s_scale,
                                  teacher_logit_scale=t_scale, student_softcap=s_cap, teacher_softcap=t_cap,
                                  **ours_for_beta(beta))
    out.loss.backward()
    assert torch.allclose(out.divergence, div.float(), rtol=1e-4, atol=2e-6), (out.divergence - div).abs().max()
    assert torch.allclose(out.entropy, ent.float(), rtol=1e-4, atol=2e-5), (out.entropy - ent).abs().max()
    grad_tol = 2e-2 if dtypes[0] != torch.float32 else 1e-4
    for ours, theirs in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        assert ours.dtype == theirs.dtype
        err = (ours.double() - theirs.double()).abs().max().item()
        assert err <= grad_tol * theirs.double().abs().max().item(), err


@pytest.mark.parametrize("num_items_in_batch", [None, 29])
@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_trainer_loss_function(num_items_in_batch, beta):
    """The trainer's loss, masked completions and its normalisation; its logged entropy (sum over the scored
    tokens of the student's entropy, divided by their count in compute_loss)."""
    lead = (3, 9)
    hs, ws, ht, wt = heads(lead)
    mask = torch.rand(lead) > 0.25
    mask[0, 0] = True
    h1, w1 = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    loss, entropy_sum, n_valid = trl_trainer._chunked_divergence_loss(
        h1, ht, w1, wt, mask, beta, num_items_in_batch=num_items_in_batch, temperature=1.3)
    loss.backward()

    labels = torch.where(mask, torch.randint(0, V, lead), torch.full(lead, -100))
    h2, w2 = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = fused_distillation_loss(h2, w2, labels, teacher_hidden=ht, teacher_weight=wt, divergence="jsd", beta=beta,
                                  temperature=1.3, num_items_in_batch=num_items_in_batch)
    out.loss.backward()
    assert abs(out.loss.item() - loss.item()) <= 1e-5 * max(1.0, abs(loss.item())), (out.loss.item(), loss.item())
    assert abs(out.entropy.sum().item() - entropy_sum.item()) <= 1e-4 * abs(entropy_sum.item())
    assert int((labels != -100).sum()) == int(n_valid)
    for ours, theirs in ((h2.grad, h1.grad), (w2.grad, w1.grad)):
        err = (ours - theirs).abs().max().item()
        assert err <= 1e-4 * theirs.abs().max().item(), err
