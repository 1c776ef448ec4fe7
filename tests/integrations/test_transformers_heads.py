"""Heads that are not a plain linear map: a logit scale is folded into the temperature exactly;
softcapping, a bias and scales without a known rule are refused, naming the attribute. And clear
errors for bad input."""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from logitless.transformers import fused_forward, patch_model
from test_transformers import COMMON, V, check_against_model, padded_batch, tiny_model


@pytest.fixture(autouse=True)
def several_vocab_chunks(monkeypatch):
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(3 * 300))


@pytest.mark.parametrize("kind,attr,value", [("cohere", "logit_scale", 3.0),      # logits * 3
                                             ("granite", "logits_scaling", 0.4)])  # logits / 0.4
def test_logit_scale_folds_into_temperature(kind, attr, value):
    model = tiny_model(kind, **{attr: value})
    ids, mask = padded_batch(3, 8, "left")
    check_against_model(model, ids, mask, temperature=0.9)
    check_against_model(model, ids, mask, temperature=torch.rand(3) + 0.5)


def test_same_attribute_name_opposite_direction():
    """HyperCLOVA X *multiplies* by config.logits_scaling where Granite divides by it."""
    model = tf.HyperCLOVAXForCausalLM(tf.HyperCLOVAXConfig(**COMMON, logits_scaling=2.5))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    ids, mask = padded_batch(2, 7, "left")
    check_against_model(model.eval(), ids, mask, temperature=0.9)


def test_falcon_h1_lm_head_multiplier_folds_into_temperature():
    cfg = tf.FalconH1Config(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=12, mamba_d_ssm=48,
                            mamba_n_heads=4, mamba_d_head=12, mamba_n_groups=1, mamba_d_state=8,
                            mamba_chunk_size=4, lm_head_multiplier=2.0)
    model = tf.FalconH1ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    ids, mask = padded_batch(2, 7, "right")
    check_against_model(model.eval(), ids, mask, temperature=0.7)


def test_minicpm3_hidden_scaling_folds_into_temperature():
    cfg = tf.MiniCPM3Config(**{**COMMON, "num_key_value_heads": 4, "dim_model_base": 12, "scale_emb": 2,
                               "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
                               "qk_rope_head_dim": 4, "v_head_dim": 8})
    model = tf.MiniCPM3ForCausalLM(cfg)
    assert cfg.logits_scaling == 4.0  # hidden states are divided by 48 / 12 before the head
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    ids, mask = padded_batch(2, 7, "right")
    check_against_model(model.eval(), ids, mask, temperature=0.8)


def test_gemma2_softcapping_is_refused():
    model = tiny_model("gemma2", final_logit_softcapping=30.0)
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fused_forward(model, ids)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        patch_model(model)
    assert "forward" not in vars(model)
    model.config.final_logit_softcapping = None  # the documented way out: the head is linear again
    check_against_model(model, torch.randint(0, V, (2, 6)), torch.tensor([[0, 1, 1, 1, 1, 1]] * 2))


def test_head_bias_is_refused():
    model = tiny_model("llama")
    model.lm_head = torch.nn.Linear(model.config.hidden_size, V, bias=True)
    with pytest.raises(ValueError, match="lm_head.bias"):
        fused_forward(model, torch.randint(0, V, (1, 5)))


def test_scale_without_a_known_rule_is_refused():
    model = tiny_model("llama")
    model.config.logits_scaling = 2.0  # multiplies in one architecture, divides in another
    with pytest.raises(ValueError, match="logits_scaling"):
        fused_forward(model, torch.randint(0, V, (1, 5)))
    model.config.logits_scaling = 1.0  # neutral: fine
    fused_forward(model, torch.randint(0, V, (1, 5)))


def test_trainable_scale_is_refused():
    model = tiny_model("cohere")
    model.logit_scale = torch.nn.Parameter(torch.tensor(2.0))
    with pytest.raises(ValueError, match="logit_scale"):
        fused_forward(model, torch.randint(0, V, (1, 5)))


def test_bad_input_errors():
    model = tiny_model("llama")
    ids = torch.randint(0, V, (2, 6))
    with pytest.raises(TypeError, match="model"):
        fused_forward("llama", ids)
    with pytest.raises(ValueError, match="input_ids"):
        fused_forward(model, ids.float())
    with pytest.raises(ValueError, match="attention_mask"):
        fused_forward(model, ids, torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="attention_mask"):
        fused_forward(model, ids, torch.ones(2, 6))
    with pytest.raises(ValueError, match="labels"):
        fused_forward(model, ids, labels=ids[:, :-1])
    with pytest.raises(TypeError, match="labels"):
        fused_forward(model, ids, labels=ids.float())
    with pytest.raises(ValueError, match="labels"):
        fused_forward(model, ids, labels=torch.full_like(ids, V))  # out of the vocabulary
    with pytest.raises(ValueError, match="labels"):
        fused_forward(model, None, inputs_embeds=torch.randn(2, 6, 48))
    with pytest.raises(ValueError, match="position_ids"):
        fused_forward(model, ids, position_ids=torch.arange(6).expand(3, 2, 6))
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            fused_forward(model, ids, temperature=bad)
    for bad in (True, "1.0", None):
        with pytest.raises(TypeError, match="temperature"):
            fused_forward(model, ids, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        fused_forward(model, ids, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        fused_forward(model, ids, temperature=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="temperature"):
        fused_forward(model, ids, temperature=torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="temperature"):  # one packed row of 2 sequences, 3 temperatures
        fused_forward(model, ids[:1], position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
                      temperature=torch.ones(3))
    with pytest.raises(TypeError, match="with_entropy"):
        fused_forward(model, ids, with_entropy=1)
    with pytest.raises(TypeError, match="ignore_index"):
        fused_forward(model, ids, ignore_index=-100.0)
    with pytest.raises(TypeError, match="temperature"):
        patch_model(model, temperature="hot")
    assert "forward" not in vars(model)
