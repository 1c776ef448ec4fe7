"""forward_padded / forward_packed on a real GPTModel, and the no-silent-fallback record.

THD attention on CPU: the model's core attention is Megatron's DotProductAttention applied to each
packed sequence (mcore_env.packed_attention_class), since Transformer Engine is GPU-only. The
reference is the plain model run on each sequence alone ([1, n] with a causal mask).
"""
import pytest
import torch

import logitless
from logitless.megatron import FusedPathUnavailable, forward_packed, forward_padded, last_path
from mcore_env import ENT_TOL, GRAD_TOL, LP_TOL

FUSED_BACKENDS = ("chunked", "triton", "reference")


@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
@pytest.mark.parametrize("temp_kind", ["scalar", "per_seq", "per_token"])
def test_forward_padded_equals_per_sequence(megatron_tp1, seed, packed, temp_kind):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(packed_attention=True, seed=seed)
    ids, mask = env.ragged_batch(gen)
    b, s = ids.shape
    temperature = {"scalar": 0.85, "per_seq": 0.5 + torch.rand(b, generator=gen),
                   "per_token": 0.5 + torch.rand(b, s, generator=gen)}[temp_kind]
    out = forward_padded(model, ids, mask, temperature=temperature, packed=packed)
    rec = last_path()
    assert rec.path == "hook" and rec.entry == "forward_padded" and rec.backend in FUSED_BACKENDS
    assert out.logprobs.shape == (b, s) and out.logprobs.dtype == torch.float32
    assert (out.logprobs[~mask] == 0).all() and (out.entropy[~mask] == 0).all()
    with torch.no_grad():
        for i in range(b):
            t = temperature if temp_kind == "scalar" else (temperature[i] if temp_kind == "per_seq"
                                                            else temperature[i][mask[i]][None, :-1])
            seq = ids[i][mask[i]]
            lp, ent = env.per_sequence_reference(model, seq, t)
            assert (out.logprobs[i][mask[i]].double() - lp).abs().max() <= LP_TOL, i
            assert (out.entropy[i][mask[i]].double() - ent).abs().max() <= ENT_TOL, i


@pytest.mark.parametrize("nested", [False, True], ids=["list", "jagged"])
def test_forward_packed_values_and_grads_equal_per_sequence(megatron_tp1, seed, nested):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(packed_attention=True, seed=seed)
    seqs = [torch.randint(0, 262, (n,), generator=gen) for n in (7, 1, 12, 4)]
    temps = 0.6 + torch.rand(len(seqs), generator=gen)
    weights = [(torch.randn(s.numel(), generator=gen), torch.randn(s.numel(), generator=gen)) for s in seqs]

    model.zero_grad(set_to_none=True)
    arg = torch.nested.as_nested_tensor(seqs, layout=torch.jagged) if nested else seqs
    out = forward_packed(model, arg, temperature=temps)
    assert last_path().path == "hook" and last_path().entry == "forward_packed"
    lps = out.logprobs.unbind() if nested else out.logprobs
    ents = out.entropy.unbind() if nested else out.entropy
    loss = sum((a * lp).sum() + (c * e).sum() for (a, c), lp, e in zip(weights, lps, ents, strict=True))
    loss.backward()
    fused = env.param_grads(model)

    model.zero_grad(set_to_none=True)
    ref_loss = 0
    for i, seq in enumerate(seqs):
        lp, ent = env.per_sequence_reference(model, seq, temps[i])
        assert lps[i].shape == seq.shape
        assert (lps[i].detach().double() - lp).abs().max() <= LP_TOL
        assert (ents[i].detach().double() - ent).abs().max() <= ENT_TOL
        a, c = weights[i]
        ref_loss = ref_loss + (a * lp).sum() + (c * ent).sum()
    ref_loss.backward()
    ref = env.param_grads(model)
    for name, g in ref.items():
        if g is not None and g.norm() > 0:
            assert env.rel_err(fused[name], g) <= GRAD_TOL, name


def test_ci_guard_hook_and_fused_op_ran(megatron_tp1, seed):
    """The anti-fallback check: from the record, not from a log line."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(packed_attention=True, seed=seed)
    ids, mask = env.ragged_batch(gen)
    before = last_path()
    forward_padded(model, ids, mask, temperature=1.0, strict=True)
    rec = last_path()
    assert rec is not before and rec.serial > (before.serial if before else 0)
    assert rec.path == "hook" and rec.model == "GPTModel", rec
    assert rec.entry == "forward_padded" and rec.backend in FUSED_BACKENDS, rec
    assert logitless.last_backend() == rec.backend


def test_legacy_mode_through_forward_padded(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    hooked = env.build_gpt(packed_attention=True, seed=seed)
    legacy = env.build_with_class(env.old_signature_gpt_class(), packed_attention=True, seed=seed)
    ids, mask = env.ragged_batch(gen)
    want = forward_padded(hooked, ids, mask, temperature=0.9)
    got = forward_padded(legacy, ids, mask, temperature=0.9, strict=True)
    assert last_path().path == "legacy" and last_path().model == "OldSignatureGPTModel"
    assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.entropy, want.entropy)


def test_strict_mode_refuses_the_fallback(megatron_tp1, seed, monkeypatch):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    old = env.build_with_class(env.no_postprocess_gpt_class(), seed=seed)
    ids, mask = env.ragged_batch(gen)
    with pytest.raises(FusedPathUnavailable, match="strict"):
        forward_padded(old, ids, mask, packed=False, strict=True)
    with pytest.raises(FusedPathUnavailable):
        forward_packed(old, [ids[0]], strict=True)
    monkeypatch.setenv("LOGITLESS_STRICT", "1")
    with pytest.raises(FusedPathUnavailable):
        forward_padded(old, ids, mask, packed=False)
    # strict=False beats the env var; the fallback is recorded and gives the same numbers
    fallback = forward_padded(old, ids, mask, temperature=0.7, packed=False, strict=False)
    assert last_path().path == "unfused" and last_path().backend is None and last_path().reason
    assert last_path().model == "NoPostprocessGPTModel"
    monkeypatch.delenv("LOGITLESS_STRICT")
    fused = forward_padded(env.build_gpt(seed=seed), ids, mask, temperature=0.7, packed=False)
    assert last_path().path == "hook"
    assert (fallback.logprobs - fused.logprobs).abs().max() <= LP_TOL
    assert (fallback.entropy - fused.entropy).abs().max() <= ENT_TOL


@pytest.mark.parametrize("b,s", [(5, 5), (3, 7)])
def test_unfused_fallback_per_sequence_temperature(megatron_tp1, seed, b, s):
    """A [b] temperature is one value per row on the unfused fallback too, also when b == s (where
    broadcasting [b] against [b, s] would silently pair it with positions instead)."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    old = env.build_with_class(env.no_postprocess_gpt_class(), seed=seed)
    ids = torch.randint(0, 262, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, s - 2:] = False  # one padded row
    temperature = 0.4 + 2.0 * torch.rand(b, generator=gen)
    fallback = forward_padded(old, ids, mask, temperature=temperature, packed=False, strict=False)
    assert last_path().path == "unfused"
    fused = forward_padded(env.build_gpt(seed=seed), ids, mask, temperature=temperature, packed=False)
    assert last_path().path == "hook"
    assert (fallback.logprobs - fused.logprobs).abs().max() <= LP_TOL
    assert (fallback.entropy - fused.entropy).abs().max() <= ENT_TOL
    assert (fused.logprobs[mask[:, 1:].nonzero()[:, 0], mask[:, 1:].nonzero()[:, 1]] != 0).all()


def test_forward_padded_bad_input(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    ids = torch.randint(0, 262, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    with pytest.raises(TypeError, match="input_ids"):
        forward_padded(model, ids.float(), mask)
    with pytest.raises(ValueError, match="attention_mask"):
        forward_padded(model, ids, mask[:, :5])
    with pytest.raises(ValueError, match="temperature"):
        forward_padded(model, ids, mask, temperature=torch.ones(3))
    with pytest.raises(ValueError, match="temperature"):
        forward_padded(model, ids, mask, temperature=0.0)
    for bad in ("x", None, True):
        with pytest.raises(TypeError, match="temperature"):
            forward_padded(model, ids, mask, temperature=bad)
        with pytest.raises(TypeError, match="temperature"):
            forward_packed(model, [ids[0]], temperature=bad)
    with pytest.raises(ValueError, match="position_ids"):
        forward_padded(model, ids, mask, torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="strict"):
        forward_padded(model, ids, mask, strict="yes")
    with pytest.raises(ValueError, match="temperature"):
        forward_packed(model, [ids[0], ids[1]], temperature=torch.ones(3))
    with pytest.raises(ValueError, match="post_process=False"):
        forward_padded(env.build_gpt(post_process=False, seed=seed), ids, mask)


def test_fp8_config_sets_the_padding(megatron_tp1, seed):
    from logitless.megatron.forward import parallel_layout
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    assert parallel_layout(model).align == 1
    model.config.fp8 = "hybrid"          # read only by the packing layout here (FP8 needs TE + GPU to run)
    try:
        assert parallel_layout(model).align == 16
    finally:
        model.config.fp8 = None


def test_forward_without_entropy_under_no_grad(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(packed_attention=True, seed=seed)
    ids, mask = env.ragged_batch(gen)
    with torch.no_grad():
        full = forward_padded(model, ids, mask, temperature=1.1)
        lean = forward_padded(model, ids, mask, temperature=1.1, with_entropy=False)
        packed = forward_packed(model, [ids[i][mask[i]] for i in range(ids.shape[0])], temperature=1.1,
                                with_entropy=False)
    assert lean.entropy is None and packed.entropy is None and not lean.logprobs.requires_grad
    assert (lean.logprobs - full.logprobs).abs().max() <= LP_TOL
    for i, lp in enumerate(packed.logprobs):
        assert (lp - full.logprobs[i][mask[i]]).abs().max() <= LP_TOL
