"""logitless.transformers.fused_policy_loss on real tiny models built from configs: the policy loss and
every parameter gradient against the same loss computed in float64 from the model's own logits (verl's
definitions, tests/policy64.py), with padding, a packed row, a wrapper, and a softcapped head (Gemma 2)."""
from __future__ import annotations

import pytest
import torch

from logitless.losses import PolicyLossOutput
from logitless.transformers import fused_policy_loss
from policy64 import aggregate64, term64
from reference64 import rel_err
from test_transformers import V, expected_targets, padded_batch, tiny_model

SPEC = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.02)


def truth(model, ids, mask, pos, targets, temperature, adv, old, ref, loss_agg, cu=None):
    """float64 loss and log-probs from the model's own logits; fills the parameters' .grad."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    t = temperature.double().unsqueeze(-1) if torch.is_tensor(temperature) else float(temperature)
    logp = torch.log_softmax(logits.double() / t, dim=-1)
    valid = targets != -100
    lp = torch.where(valid, logp.gather(-1, torch.where(valid, targets, 0).unsqueeze(-1)).squeeze(-1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    f, _, _ = term64(lp, ent, torch.broadcast_to(adv.double(), lp.shape), old.double(), ref.double(), **SPEC)
    if cu is not None:
        loss = aggregate64(f.reshape(-1), valid.reshape(-1), loss_agg, cu)
    else:
        loss = aggregate64(f, valid, loss_agg)
    loss.backward()
    return loss.detach(), lp.detach()


def compare(model, call, ids, mask, pos, targets, temperature, adv, old, ref, loss_agg, cu=None):
    model.zero_grad(set_to_none=True)
    out = call()
    assert isinstance(out, PolicyLossOutput) and out.logprobs.shape == ids.shape
    out.loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss, lp = truth(model, ids, mask, pos, targets, temperature, adv, old, ref, loss_agg, cu)
    assert abs(out.loss.item() - loss.item()) <= 1e-5, (out.loss.item(), loss.item())
    assert (out.logprobs.double() - lp).abs().max() <= 2e-5
    want = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert fused.keys() == want.keys() and len(want) > 3
    for name, g in want.items():
        if g.norm() > 0:
            assert rel_err(fused[name], g) <= 1e-4, name
    return out


def old_and_ref(model, ids, mask, pos, targets, temperature):
    """Behaviour / reference log-probs near the current ones (so the clip binds on both sides)."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        t = temperature.unsqueeze(-1) if torch.is_tensor(temperature) else temperature
        lp = torch.log_softmax(logits.float() / t, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp + 0.4 * torch.randn_like(lp)).clamp(max=0.0), (lp + 0.4 * torch.randn_like(lp)).clamp(max=0.0)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_padded_batch(loss_agg):
    model = tiny_model("qwen2")
    ids, mask = padded_batch(3, 9, "right")
    targets = expected_targets(ids, mask)
    temperature = torch.rand(3, 9) + 0.5
    old, ref = old_and_ref(model, ids, mask, None, targets, temperature)
    adv = torch.randn(3, 1)
    compare(model, lambda: fused_policy_loss(model, ids, mask, advantages=adv, old_logprobs=old, ref_logprobs=ref,
                                             temperature=temperature, loss_agg=loss_agg, **SPEC),
            ids, mask, None, targets, temperature, adv, old, ref, loss_agg)


def test_packed_row_sequences_from_position_ids():
    """One padding-free row of three sequences: loss_agg's sequences are the packed ones."""
    model = tiny_model("llama")
    lengths = [5, 3, 6]
    ids = torch.randint(0, V, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    targets = expected_targets(ids, pos=pos)
    old, ref = old_and_ref(model, ids, None, pos, targets, 0.8)
    adv = torch.randn(1, sum(lengths))
    cu = torch.tensor([0, 5, 8, 14])
    out = compare(model, lambda: fused_policy_loss(model, ids, position_ids=pos, advantages=adv, old_logprobs=old,
                                                   ref_logprobs=ref, temperature=0.8, loss_agg="seq-mean-token-mean",
                                                   **SPEC),
                  ids, None, pos, targets, 0.8, adv, old, ref, "seq-mean-token-mean", cu=cu)
    assert out.logprobs[0, 4] == 0 and out.logprobs[0, 7] == 0   # no token scored across a boundary


class Wrapper(torch.nn.Module):
    """What DDP looks like from outside: the model under ``.module``, called through the wrapper."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.calls = 0

    def forward(self, **kw):
        self.calls += 1
        return self.module(**kw)


def test_through_a_wrapper_and_labels_given():
    model = tiny_model("llama")
    wrapped = Wrapper(model)
    ids, mask = padded_batch(2, 8, "left")
    targets = expected_targets(ids, mask)
    old, ref = old_and_ref(model, ids, mask, None, targets, 1.0)
    adv = torch.randn(2, 8)
    compare(model, lambda: fused_policy_loss(wrapped, ids, mask, shift_labels=targets, advantages=adv, old_logprobs=old,
                                             ref_logprobs=ref, **SPEC),
            ids, mask, None, targets, 1.0, adv, old, ref, "token-mean")
    assert wrapped.calls == 1


def test_softcapped_head_matches_the_model():
    """Gemma 2's final_logit_softcapping (a small cap, so it binds) through the exact two-pass path, against
    the model's own (capped) logits: loss, log-probs and every parameter gradient; and with a sequence-level
    ratio (a coupled loss) given by name in loss_settings."""
    model = tiny_model("gemma2", final_logit_softcapping=2.0)
    ids, mask = padded_batch(3, 8, "right")
    targets = expected_targets(ids, mask)
    old, ref = old_and_ref(model, ids, mask, None, targets, 0.8)
    adv = torch.randn(3, 1)
    compare(model, lambda: fused_policy_loss(model, ids, mask, advantages=adv, old_logprobs=old, ref_logprobs=ref,
                                             temperature=0.8, **SPEC),
            ids, mask, None, targets, 0.8, adv, old, ref, "token-mean")
    model.zero_grad(set_to_none=True)
    out = fused_policy_loss(model, ids, mask, advantages=adv, old_logprobs=old, temperature=0.8,
                            loss_settings=dict(ratio_level="sequence"))
    assert torch.isfinite(out.loss)
