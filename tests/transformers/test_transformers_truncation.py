"""logitless.transformers.fused_forward / fused_policy_loss with ``truncation=``: setting tensors in the batch's
[b, s] / [b, 1] layout and kept_ids [b, s, K], on a padded batch (only the scored rows reach the op), against
float64 ground truth from the model's own logits with vLLM's truncation applied (tests/truncation64.py); the
policy loss's value and every parameter gradient; the record."""
from __future__ import annotations

import torch

from logitless import Truncation
from logitless.record import last_path
from logitless.transformers import fused_forward, fused_policy_loss
from policy64 import aggregate64, term64
from reference64 import rel_err
from test_transformers import V, expected_targets, padded_batch, tiny_model
from truncation64 import truth64

SPEC = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_type="k3", entropy_coef=0.02)


def _truth(model, ids, mask, targets, temperature, **trunc):
    """float64 (logprobs, entropy, inside, kept) of the truncated distribution from the model's own logits,
    differentiable to the model's parameters."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.double()
    t64 = truth64(logits, torch.eye(V, dtype=torch.float64), targets, temperature=temperature, **trunc)
    return t64.logprobs, t64.entropy, t64.inside, t64.kept


def test_fused_forward_with_setting_tensors_and_kept_ids(seed):
    model = tiny_model("qwen2")
    ids, mask = padded_batch(3, 11, "left")
    targets = expected_targets(ids, mask)
    top_p = torch.rand(3, 11) * 0.3 + 0.6                       # per token
    top_k = torch.tensor([[20], [-1], [200]])                   # per sequence
    out = fused_forward(model, ids, mask, temperature=0.8, truncation=Truncation(top_k=top_k, top_p=top_p))
    rec = last_path()
    assert (rec.entry, rec.truncation) == ("transformers.fused_forward", "top_k=per-token top_p=per-token"), rec
    with torch.no_grad():
        lp, ent, inside, kept = _truth(model, ids, mask, targets, 0.8, top_k=top_k, top_p=top_p)
    valid = targets != -100
    assert bool((kept[valid].sum(-1) < V).all())
    assert float((out.logprobs.double() - lp).abs().max()) <= 2e-5
    assert float((out.entropy.double() - ent).abs().max()) <= 2e-5
    # the replay form: kept ids [b, s, K], the label among them
    kept_ids = torch.randint(0, V, (3, 11, 6))
    kept_ids[..., 0] = targets.clamp(min=0)
    kept_ids = torch.where((kept_ids.unsqueeze(-1) == kept_ids.unsqueeze(-2)).triu(1).any(-2), -1, kept_ids)
    out = fused_forward(model, ids, mask, truncation=Truncation(kept_ids=kept_ids))
    assert last_path().truncation == "kept_ids"
    with torch.no_grad():
        lp, ent, _, _ = _truth(model, ids, mask, targets, 1.0, kept_ids=kept_ids)
    assert float((out.logprobs.double() - lp).abs().max()) <= 2e-5
    assert float((out.entropy.double() - ent).abs().max()) <= 2e-5
    fused_forward(model, ids, mask)
    assert last_path().truncation is None                        # the plain op records none


def test_fused_policy_loss_under_truncation_equals_float64(seed):
    model = tiny_model("qwen2")
    ids, mask = padded_batch(3, 11, "right")
    targets = expected_targets(ids, mask)
    valid = targets != -100
    adv = torch.randn(3, 1)
    old = torch.where(valid, -torch.rand(3, 11) * 3, 0.0)
    ref = torch.where(valid, -torch.rand(3, 11) * 3, 0.0)
    top_p = torch.tensor([[0.7], [0.9], [0.8]])
    trunc = dict(top_p=top_p, min_p=0.02)
    model.zero_grad(set_to_none=True)
    out = fused_policy_loss(model, ids, mask, advantages=adv, old_logprobs=old, ref_logprobs=ref, temperature=0.9,
                            truncation=Truncation(**trunc), **SPEC)
    out.loss.backward()
    assert last_path().truncation == "top_p=per-token min_p=0.02"
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    lp, ent, _, _ = _truth(model, ids, mask, targets, 0.9, **trunc)
    zero = torch.zeros_like(lp)
    f, _, _ = term64(lp, ent, torch.broadcast_to(adv.double(), lp.shape), torch.where(valid, old.double(), zero),
                     torch.where(valid, ref.double(), zero), **SPEC)
    loss = aggregate64(f, valid, "token-mean")
    loss.backward()
    assert abs(out.loss.item() - loss.item()) <= 1e-5, (out.loss.item(), loss.item())
    assert float((out.logprobs.double() - lp.detach()).abs().max()) <= 2e-5
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert fused.keys() == want.keys() and len(want) > 3
    for name, g in want.items():
        if g.norm() > 0:
            assert rel_err(fused[name], g) <= 1e-4, name
