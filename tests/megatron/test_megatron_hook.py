"""The native output_processor hook (megatron-core 0.18+) on a real GPTModel, TP=1, CPU.

Every number is checked against the same model's own unfused path: its per-token cross entropy
(T = 1) and log-probs / entropy computed from its logits, and the parameter gradients of
sum(a * logprob) + sum(b * entropy) through those logits.
"""
import pytest
import torch

from logitless.megatron import (
    FusedOutputProcessorContext,
    fused_forward_mode,
    fused_output_processor,
    last_path,
    supports_output_processor_hook,
)
from mcore_env import ENT_TOL, LP_TOL


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("temp_kind", ["scalar", "per_seq", "per_token", "one"])
def test_hook_matches_unfused(megatron_tp1, seed, tied, temp_kind):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(tied=tied, seed=seed)
    assert supports_output_processor_hook(model) and fused_forward_mode(model) == "hook"
    b, s = 3, 13
    temperature = 1.0 if temp_kind == "one" else env.temperature_of_kind(temp_kind, b, s, gen)
    grads, record, _ = env.compare_with_unfused(model, b, s, temperature, gen)
    assert record.path == "hook" and record.backend in ("chunked", "triton", "reference")
    assert record.model == "GPTModel" and record.entry == "processor"
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert grads[head] is not None and grads[head].norm() > 0
    assert grads["decoder.layers.0.self_attention.linear_qkv.weight"].norm() > 0   # d_hidden flowed


def test_batch_pairing_any_b(megatron_tp1, seed):
    """hidden [s, b, h] against labels [b, s]: each row's results equal a b=1 run of that row."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(seed=seed)
    b, s = 4, 9
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    with torch.no_grad():
        full = env.run_fused(model, ids, pos, mask, labels, 1.0)
        for i in range(b):
            one = env.run_fused(model, ids[i:i + 1], pos[i:i + 1], mask, labels[i:i + 1], 1.0)
            assert (one.logprobs[0] - full.logprobs[i]).abs().max() <= LP_TOL
            assert (one.entropy[0] - full.entropy[i]).abs().max() <= ENT_TOL


def test_mtp_parameters_get_gradients(megatron_tp1, seed):
    """MTP's loss rides on hidden_states; the fused output must be computed from them so the
    MTP block still trains, with the unfused path's gradients."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(mtp=True, seed=seed)
    # reference logits from a forward given the same labels, so the MTP loss is the same
    grads, _, _ = env.compare_with_unfused(model, 2, 11, 0.9, gen, with_labels=True)
    mtp = {n: g for n, g in grads.items() if n.startswith("mtp.")}
    assert mtp and all(g is not None and g.norm() > 0 for g in mtp.values()), sorted(mtp)


def test_post_process_false_passes_through(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(post_process=False, seed=seed)
    ids, pos, labels = env.random_batch(2, 7, 262, gen)
    before = last_path()
    out = env.run_fused(model, ids, pos, env.causal_mask(7), labels, 1.0)
    assert torch.is_tensor(out) and out.shape == (7, 2, 48)      # hidden states, as without a processor
    assert last_path() is before                                  # the processor never ran


def test_inference_no_grad(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(seed=seed).eval()
    ids, pos, labels = env.random_batch(2, 10, 262, gen)
    mask = env.causal_mask(10)
    with torch.no_grad():
        out = env.run_fused(model, ids, pos, mask, labels, 1.3, with_entropy=False)
        lp, _ = env.reference_from_logits(env.unfused_logits(model, ids, pos, mask), labels, 1.3)
    assert out.entropy is None and not out.logprobs.requires_grad
    assert (out.logprobs.double() - lp).abs().max() <= LP_TOL


@pytest.mark.parametrize("kind", ["untied", "tied-mup", "legacy"])
def test_labels_none_returns_the_models_own_output(megatron_tp1, seed, kind):
    """labels=None (a rollout / inference forward) through the processor: exactly the model's own
    output without the processor (logits [b, s, V], MuP scaling included) and its gradients; or,
    as configured, the hidden states at the hook."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    kw = dict(use_mup=True, mup_base_hidden_size=24) if kind == "tied-mup" else {}
    if kind == "legacy":
        model = env.build_with_class(env.old_signature_gpt_class(), seed=seed)
    else:
        model = env.build_gpt(tied=kind != "untied", seed=seed, **kw)
    ids, pos, _ = env.random_batch(2, 7, 262, gen)
    mask = env.causal_mask(7)
    w = torch.randn(2, 7, 262, generator=gen)
    from logitless.megatron import patch_fused_forward
    patch_fused_forward(model)

    rec = env.assert_own_output_without_labels(
        model, lambda: model(ids, pos, mask, output_processor=fused_output_processor), ids, pos, mask, w)
    assert rec.path == ("legacy" if kind == "legacy" else "hook") and rec.backend is None
    assert "labels is None" in rec.reason
    with torch.no_grad():
        hidden = model(ids, pos, mask, output_processor=fused_output_processor,
                       output_processor_context=FusedOutputProcessorContext(without_labels="hidden_states"))
        at_hook = model(ids, pos, mask, labels=None, output_processor=lambda **k: k["hidden_states"])
    assert hidden.shape == (7, 2, 48) and torch.equal(hidden, at_hook)
    with pytest.raises(ValueError, match="without_labels"):
        FusedOutputProcessorContext(without_labels="logprobs")


def test_bad_context_and_temperature(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    ids, pos, labels = env.random_batch(2, 5, 262)
    mask = env.causal_mask(5)
    with pytest.raises(TypeError, match="output_processor_context"):
        model(ids, pos, mask, labels=labels, output_processor=fused_output_processor, output_processor_context={"t": 1})
    with pytest.raises(ValueError, match="temperature"):
        env.run_fused(model, ids, pos, mask, labels, torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        FusedOutputProcessorContext(temperature=-1.0)
    with pytest.raises(TypeError, match="with_entropy"):
        FusedOutputProcessorContext(with_entropy=1)
    with pytest.raises(ValueError, match="labels shape"):
        env.run_fused(model, ids, pos, mask, labels[:, :4], 1.0)


def test_mup_scale_logits_honoured(megatron_tp1, seed):
    """MuP multiplies the logits by mup_output_mult; the fused path must apply the same scale."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(seed=seed, use_mup=True, mup_base_hidden_size=24)
    assert model.config.mup_output_mult == 0.5
    env.compare_with_unfused(model, 2, 9, 1.0, gen)
    env.compare_with_unfused(model, 2, 9, 0.8, gen)


def test_nonlinear_scale_logits_refused(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    hidden = torch.randn(5, 2, 48)
    labels = torch.randint(0, 262, (2, 5))
    with pytest.raises(ValueError, match="scale_logits"):
        fused_output_processor(hidden_states=hidden, output_layer=model.output_layer, output_weight=None,
                               labels=labels, context=None, config=model.config,
                               scale_logits=lambda z: 30.0 * torch.tanh(z / 30.0))
    out = fused_output_processor(hidden_states=hidden, output_layer=model.output_layer, output_weight=None,
                                 labels=labels, context=None, config=model.config, scale_logits=lambda z: z)
    assert out.logprobs.shape == (2, 5)


def test_config_logger_payload(megatron_tp1, seed, tmp_path):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(seed=seed)
    ids, pos, labels = env.random_batch(2, 6, 262, gen)
    model.config.config_logger_dir = str(tmp_path)
    try:
        with torch.no_grad():
            out = env.run_fused(model, ids, pos, env.causal_mask(6), labels, 1.0)
    finally:
        model.config.config_logger_dir = ""
    files = sorted(tmp_path.glob("input_and_logprobs.rank_*.pth"))
    assert files, sorted(p.name for p in tmp_path.iterdir())
    payload = torch.load(files[-1], weights_only=False)
    assert list(payload) == ["input_ids", "position_ids", "attention_mask", "decoder_input", "logprobs", "entropy"]
    assert torch.equal(payload["input_ids"], ids) and torch.equal(payload["logprobs"], out.logprobs)
    assert torch.equal(payload["entropy"], out.entropy)


def test_float16module_wrapper_bf16(megatron_tp1, seed):
    """Megatron's Float16Module (bf16): the processor runs inside, the result comes back as a
    tuple of fp32 tensors; values against float64 from the very bf16 hidden states and weight."""
    from megatron.core.transformer.module import Float16Module

    from reference64 import logprobs_entropy64
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    inner = env.build_gpt(seed=seed, bf16=True)
    model = Float16Module(inner.config, inner)
    assert fused_forward_mode(model) == "hook"
    ids, pos, labels = env.random_batch(2, 8, 262, gen)
    mask = env.causal_mask(8)
    with torch.no_grad():
        lp, ent = env.run_fused(model, ids, pos, mask, labels, 0.9)
        hidden = model(ids, pos, mask, labels=labels, output_processor=lambda **kw: kw["hidden_states"])
    weight = inner.output_layer.weight
    assert weight.dtype == torch.bfloat16
    lp64, ent64 = logprobs_entropy64(hidden.to(torch.bfloat16).transpose(0, 1), weight, labels, 0.9)
    assert (lp.double() - lp64).abs().max() <= 1e-3
    assert (ent.double() - ent64).abs().max() <= 2e-3
