"""Heads that are not a plain linear map: a logit scale is folded into the temperature exactly, Gemma 2 /
Gemma 3's final-logit softcap is applied exactly; softcapping elsewhere, a bias and scales without a known
rule are refused, naming the attribute. And clear errors for bad input."""
from __future__ import annotations

import pytest
import torch

import transformers as tf
from logitless.transformers import fused_forward, patch_model, unpatch_model
from logitless.transformers.heads import plan_head
from test_transformers import (
    COMMON,
    TOL_ENT,
    V,
    check_against_model,
    expected_targets,
    lp_close,
    padded_batch,
    reference_from_logits,
    tiny_model,
)


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


GEMMA_CAP = 1.5   # the head's logits have std ~2 (tiny_model): a cap of 1.5 bends most of them


def gemma(kind: str, cap=GEMMA_CAP) -> torch.nn.Module:
    """A tiny Gemma2ForCausalLM or Gemma3ForCausalLM (text) with final_logit_softcapping=cap."""
    if kind == "gemma2":
        return tiny_model("gemma2", final_logit_softcapping=cap)
    cfg = tf.Gemma3TextConfig(**COMMON, head_dim=12, query_pre_attn_scalar=12, sliding_window=5,
                              final_logit_softcapping=cap)
    model = tf.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.3)
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_gemma_final_logit_softcapping_matches_the_model(kind):
    """Values and every parameter's gradient against the model's own (capped) logits in float64."""
    model = gemma(kind)
    assert plan_head(model).softcap == GEMMA_CAP
    ids, mask = padded_batch(3, 8, "left")
    fused = check_against_model(model, ids, mask, temperature=0.9)
    check_against_model(model, ids, mask, temperature=torch.rand(3) + 0.5)   # per sequence
    check_against_model(model, ids, mask, temperature=torch.rand(3, 8) + 0.5)  # per token
    # the cap matters here: without it the same weights give other log-probs
    model.config.final_logit_softcapping = None
    assert plan_head(model).softcap is None
    plain = fused_forward(model, ids, mask, temperature=0.9)
    assert (plain.logprobs - fused.logprobs).abs().max() > 0.05


def test_patched_gemma2_applies_the_softcap():
    model = gemma("gemma2")
    ids, mask = padded_batch(2, 7, "right")
    out = patch_model(model, temperature=0.8)(input_ids=ids, attention_mask=mask)
    unpatch_model(model)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, expected_targets(ids, mask), 0.8)
    assert lp_close(out.logprobs, ref_lp), (out.logprobs.double() - ref_lp).abs().max()
    assert (out.entropy.double() - ref_ent).abs().max() <= TOL_ENT


def test_softcapping_without_a_rule_is_refused():
    model = tiny_model("llama")
    model.config.final_logit_softcapping = 30.0   # llama's forward never reads it: no rule, refused
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fused_forward(model, ids)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        patch_model(model)
    assert "forward" not in vars(model)
    model = gemma("gemma2")
    model.config.logit_softcapping = 30.0         # another softcap name on a Gemma: not the known one
    with pytest.raises(ValueError, match="logit_softcapping"):
        fused_forward(model, ids)


def test_gemma3_multimodal_text_softcap_is_refused():
    # Gemma3ForConditionalGeneration keeps final_logit_softcapping on its text config; whether its forward
    # applies it depends on the transformers release, so logitless refuses rather than guess
    text = tf.Gemma3TextConfig(**COMMON, head_dim=12, query_pre_attn_scalar=12, sliding_window=5,
                               final_logit_softcapping=GEMMA_CAP)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=28, patch_size=14)
    model = tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(text_config=text.to_dict(),
                                                              vision_config=vision.to_dict(), mm_tokens_per_image=4))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        plan_head(model)


@pytest.mark.parametrize("cap", [0.0, -30.0, float("inf")])   # the config's own validation refuses non-floats
def test_bad_gemma_softcap_value_is_refused(cap):
    model = gemma("gemma2")
    model.config.final_logit_softcapping = cap
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        fused_forward(model, torch.randint(0, V, (1, 5)))


def test_gemma_softcap_with_a_head_bias_is_refused():
    model = gemma("gemma2")
    model.lm_head = torch.nn.Linear(model.config.hidden_size, V, bias=True)
    with pytest.raises(ValueError, match="lm_head.bias"):
        fused_forward(model, torch.randint(0, V, (1, 5)))


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


@pytest.mark.parametrize("where", ["config", "text_config"])
def test_output_multiplier_is_refused(where):
    """MuseSpark / MuseGlimmer multiply the logits by ``output_multiplier`` (inside their softcap): on a
    model without a rule for it, a non-neutral value is refused, never dropped."""
    model = tiny_model("llama")
    cfg = model.config
    if where == "text_config":  # where a multimodal model keeps it
        text = tf.LlamaConfig(**COMMON)
        cfg.get_text_config = lambda *a, **k: text
        cfg = text
    cfg.output_multiplier = 0.25
    with pytest.raises(ValueError, match="output_multiplier"):
        plan_head(model)
    with pytest.raises(ValueError, match="output_multiplier"):
        fused_forward(model, torch.randint(0, V, (1, 5)))
    with pytest.raises(ValueError, match="output_multiplier"):
        patch_model(model)
    assert "forward" not in vars(model)
    cfg.output_multiplier = 1.0  # neutral: fine
    check_against_model(model, *padded_batch(2, 6, "right"), temperature=0.8)


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
    with pytest.raises(TypeError, match="input_ids"):
        fused_forward(model, ids.float())
    with pytest.raises(ValueError, match="input_ids"):
        fused_forward(model, ids[0])
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
