"""No keyword is dropped on its way to a transformers model: fused_forward, fused_policy_loss and a patched
forward pass on only the names the base model's forward declares; a logitless or PolicyLoss setting given
in the wrong place, or misspelled, is a TypeError naming it and saying where it goes."""
from __future__ import annotations

import pytest
import torch

from logitless.transformers import fused_forward, fused_policy_loss, patch_model, unpatch_model
from logitless.transformers.model_kwargs import accepted_names
from test_transformers import V, padded_batch, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def adv_for(ids):
    return torch.randn(ids.shape[0], 1)


@pytest.mark.parametrize("name, value, says", [
    ("temprature", 0.5, "did you mean 'temperature'"),
    ("with_entropi", False, "did you mean 'with_entropy'"),
    ("surrogate", "sapo", "loss_settings=dict(surrogate=...)"),
    ("softcap", 30.0, "final_logit_softcapping"),
    ("no_such_thing", 1, "Qwen2Model.forward takes"),
])
def test_fused_forward_refuses_what_the_model_would_drop(model, name, value, says):
    ids, mask = padded_batch(2, 7, "right")
    with pytest.raises(TypeError, match=name) as err:
        fused_forward(model, ids, mask, **{name: value})
    assert says in str(err.value)
    assert "fused_forward" in str(err.value)


@pytest.mark.parametrize("name, value, says", [
    ("surrogate", "sapo", "loss_settings=dict(surrogate=...)"),
    ("sapo_tau_pos", 2.0, "loss_settings=dict(sapo_tau_pos=...)"),
    ("entropy_coeff", 5.0, "did you mean 'entropy_coef'"),
    ("temprature", 0.5, "did you mean 'temperature'"),
    ("softcap", 30.0, "final_logit_softcapping"),
])
def test_fused_policy_loss_refuses_settings_given_as_model_keywords(model, name, value, says):
    ids, mask = padded_batch(2, 7, "right")
    with pytest.raises(TypeError, match=name) as err:
        fused_policy_loss(model, ids, mask, advantages=adv_for(ids), **{name: value})
    assert says in str(err.value)


def test_the_setting_in_its_place_changes_the_loss(model):
    """What the refused call meant, given where it goes: the SAPO loss differs from the default PPO loss."""
    ids, mask = padded_batch(2, 7, "right")
    adv = adv_for(ids)
    with torch.no_grad():
        old = fused_forward(model, ids, mask).logprobs + 0.3 * torch.randn(ids.shape)
        old = old.clamp(max=0.0)
        ppo = fused_policy_loss(model, ids, mask, advantages=adv, old_logprobs=old).loss
        sapo = fused_policy_loss(model, ids, mask, advantages=adv, old_logprobs=old,
                                 loss_settings=dict(surrogate="sapo")).loss
    assert abs(float(ppo) - float(sapo)) > 1e-4


def test_patched_forward_refuses_unknown_keywords(model):
    ids, mask = padded_batch(2, 7, "right")
    patch_model(model)
    try:
        with pytest.raises(TypeError, match="temprature"):
            model(input_ids=ids, attention_mask=mask, temprature=0.5)
        # the patched forward's own settings and the model's declared keywords still pass
        out = model(input_ids=ids, attention_mask=mask, temperature=0.5, output_hidden_states=True)
        assert out.hidden_states is not None
    finally:
        unpatch_model(model)


def test_declared_keywords_pass(model):
    """The base model's named parameters (inputs_embeds, use_cache) and transformers' TransformersKwargs keys
    (output_hidden_states) are passed on."""
    names = accepted_names(type(model.model))
    assert {"inputs_embeds", "use_cache", "output_hidden_states", "output_attentions"} <= names
    ids = torch.randint(0, V, (2, 6))
    embeds = model.get_input_embeddings()(ids)
    by_embeds = fused_forward(model, None, inputs_embeds=embeds, labels=ids, use_cache=False,
                              output_attentions=False)
    by_ids = fused_forward(model, ids, labels=ids)
    assert torch.allclose(by_embeds.logprobs, by_ids.logprobs, atol=1e-6)
