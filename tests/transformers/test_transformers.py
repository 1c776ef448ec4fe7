"""logitless.transformers.fused_forward on real transformers models built from configs (random
weights, no hub): log-probs, entropy and parameter gradients against the model's own logits in
float64, with padding, packing, given labels and temperatures of every shape."""
from __future__ import annotations

import pytest
import torch

import logitless
import transformers as tf
from logitless.transformers import fused_forward
from reference64 import logprobs_entropy64, rel_err

V, H = 1031, 48
TOL_LP, TOL_ENT, TOL_GRAD = 2e-5, 2e-5, 1e-4
# The reference starts from the model's float32 logits, whose rounding grows with their size: a head that scales
# its logits (cohere's logit_scale 3 at temperature 0.5) gives log-probs near -40, where float32 rounding alone
# is ~2e-5 (seen once: 2.3e-5). Log-prob errors are therefore allowed TOL_LP plus 1e-6 of the value.
LP_REL = 1e-6


def lp_close(got, want) -> bool:
    """Fused log-probs against the float64 reference: within TOL_LP + LP_REL * |want| everywhere."""
    return bool(((got.double() - want).abs() <= TOL_LP + LP_REL * want.abs()).all())
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)


def tiny_model(kind: str, **overrides) -> torch.nn.Module:
    """A 2-layer model of ``kind`` with random weights, its head rescaled so logits have std ~2."""
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, **overrides}))
    elif kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**COMMON, "tie_word_embeddings": False, **overrides}))
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**COMMON, "head_dim": 12, **overrides}))
    elif kind == "gpt2":
        cfg = tf.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, **overrides)
        model = tf.GPT2LMHeadModel(cfg)
        assert model.lm_head.weight is model.transformer.wte.weight  # the tied case is really tied
    elif kind == "gemma2":
        cfg = tf.Gemma2Config(**{**COMMON, "head_dim": 12, "query_pre_attn_scalar": 12, "sliding_window": 5,
                                 "final_logit_softcapping": None, **overrides})
        model = tf.Gemma2ForCausalLM(cfg)
    elif kind == "cohere":
        model = tf.CohereForCausalLM(tf.CohereConfig(**{**COMMON, **overrides}))
    elif kind == "granite":
        model = tf.GraniteForCausalLM(tf.GraniteConfig(**{**COMMON, **overrides}))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        model.get_output_embeddings().weight.normal_(0.0, 0.3)
    return model.eval()


def padded_batch(b: int, s: int, side: str):
    """input_ids [b, s] and attention_mask [b, s] with 0..s//2 pads per row on ``side``."""
    ids = torch.randint(0, V, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    for row in range(b):
        n_pad = int(torch.randint(0, s // 2 + 1, ()))
        if row == 0:
            n_pad = max(n_pad, 1)  # at least one padded row
        if side == "left":
            mask[row, :n_pad] = 0
        else:
            mask[row, s - n_pad:] = 0
    return ids, mask


def expected_targets(ids, mask=None, pos=None, ignore=-100):
    """The target of each position, written out position by position (independent of the library)."""
    b, s = ids.shape
    out = torch.full((b, s), ignore, dtype=torch.long)
    for i in range(b):
        for t in range(s - 1):
            if mask is not None and not (mask[i, t] and mask[i, t + 1]):
                continue
            if pos is not None and int(pos[i, t + 1]) != int(pos[i, t]) + 1:
                continue
            out[i, t] = ids[i, t + 1]
    return out


def reference_from_logits(logits, targets, temperature=1.0, ignore=-100):
    """(logprobs, entropy) float64 [b, s] from the model's own logits [b, s, V]."""
    z = logits.double()
    if torch.is_tensor(temperature):
        t = temperature.double()
        z = z / (t[:, None, None] if t.dim() == 1 else t[..., None])
    else:
        z = z / temperature
    logp = torch.log_softmax(z, -1)
    valid = targets != ignore
    lp = logp.gather(-1, torch.where(valid, targets, 0)[..., None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def grads_of(model, lp, ent, a, b):
    model.zero_grad(set_to_none=True)
    (a * lp).sum().add((b * ent).sum()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_against_model(model, ids, mask=None, pos=None, shift_labels=None, temperature=1.0, targets=None,
                        ref_temperature=None):
    """fused_forward vs the unfused path (model logits -> float64 log_softmax): values and grads."""
    targets = targets if targets is not None else (shift_labels if shift_labels is not None
                                                   else expected_targets(ids, mask, pos))
    fused = fused_forward(model, ids, attention_mask=mask, position_ids=pos, shift_labels=shift_labels,
                          temperature=temperature)
    assert logitless.last_backend() == "chunked"  # CPU tensors: the chunked backend, no silent fallback
    # use_cache=False: with a cache, transformers ignores the packing in position_ids
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, targets, temperature if ref_temperature is None
                                            else ref_temperature)

    valid = targets != -100
    assert fused.logprobs.dtype == torch.float32 and fused.logprobs.shape == ids.shape
    assert torch.isfinite(fused.logprobs).all() and torch.isfinite(fused.entropy).all()
    assert valid.any() and (~valid).any()
    assert (fused.logprobs[~valid] == 0).all() and (fused.entropy[~valid] == 0).all()
    assert (fused.logprobs[valid] <= 0).all() and (fused.entropy[valid] >= 0).all()
    assert lp_close(fused.logprobs, ref_lp), (fused.logprobs.double() - ref_lp).abs().max()
    assert (fused.entropy.double() - ref_ent).abs().max() <= TOL_ENT

    a, b = torch.randn(ids.shape), torch.randn(ids.shape)
    g_fused = grads_of(model, fused.logprobs, fused.entropy, a, b)
    g_ref = grads_of(model, ref_lp, ref_ent, a.double(), b.double())
    assert g_fused.keys() == g_ref.keys() and len(g_ref) > 10
    for name, g in g_ref.items():
        assert torch.isfinite(g_fused[name]).all(), name
        assert rel_err(g_fused[name], g) <= TOL_GRAD, (name, rel_err(g_fused[name], g))
    return fused


@pytest.fixture(autouse=True)
def several_vocab_chunks(monkeypatch):
    # the chunked backend then streams the vocabulary in several chunks with a ragged last one
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(3 * 300))


MODELS = ["llama", "qwen2", "qwen3", "gpt2", "gemma2"]


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("side,temp", [("left", "scalar"), ("right", "per_sequence")])
def test_padded_batch_matches_model_logits(kind, side, temp):
    model = tiny_model(kind)
    ids, mask = padded_batch(3, 9, side)
    temperature = 0.7 if temp == "scalar" else torch.rand(3) * 1.5 + 0.5
    check_against_model(model, ids, mask, temperature=temperature)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_given_shift_labels_are_used_as_they_are(kind):
    model = tiny_model(kind)
    ids = torch.randint(0, V, (2, 8))
    labels = torch.randint(0, V, (2, 8))
    labels[0, 3] = labels[1, :2] = -100
    temperature = torch.rand(2, 8) + 0.5  # per token
    check_against_model(model, ids, shift_labels=labels, temperature=temperature)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_packed_row_never_crosses_a_sequence(kind):
    """One padding-free row of three sequences equals the three sequences run on their own."""
    model = tiny_model(kind)
    lengths = [5, 3, 6]
    seqs = [torch.randint(0, V, (1, n)) for n in lengths]
    ids = torch.cat(seqs, 1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    temps = torch.rand(3) + 0.5  # one temperature per packed sequence
    per_token = torch.cat([t.expand(n) for t, n in zip(temps, lengths, strict=True)])[None]
    packed = check_against_model(model, ids, pos=pos, temperature=temps, ref_temperature=per_token,
                                 targets=expected_targets(ids, pos=pos))
    start = 0
    for seq, n, t in zip(seqs, lengths, temps, strict=True):
        alone = fused_forward(model, seq, temperature=float(t))
        for got, want in zip(packed, alone, strict=True):
            assert (got[0, start:start + n] - want[0]).abs().max() <= TOL_LP
        assert packed.logprobs[0, start + n - 1] == 0  # the last token of each sequence is not scored
        start += n


def test_bfloat16_model_matches_float64_of_its_bf16_values():
    model = tiny_model("llama").to(torch.bfloat16)
    ids, mask = padded_batch(2, 7, "left")
    fused = fused_forward(model, ids, mask, temperature=0.9)
    targets = expected_targets(ids, mask)
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    ref_lp, ref_ent = logprobs_entropy64(hidden, model.lm_head.weight, targets, temperature=0.9)
    assert fused.logprobs.dtype == torch.float32
    assert (fused.logprobs.double() - ref_lp).abs().max() <= 1e-3
    assert (fused.entropy.double() - ref_ent).abs().max() <= 2e-3
    a = torch.randn(ids.shape)
    g_fused = grads_of(model, fused.logprobs, fused.entropy, a, a)
    g_ref = grads_of(model, ref_lp, ref_ent, a.double(), a.double())
    for name, g in g_ref.items():
        assert rel_err(g_fused[name], g) <= 1e-2, name


def test_without_entropy_returns_the_same_logprobs():
    model = tiny_model("qwen2")
    ids, mask = padded_batch(2, 6, "right")
    both = fused_forward(model, ids, mask)
    only = fused_forward(model, ids, mask, with_entropy=False)
    assert only.entropy is None
    assert torch.equal(only.logprobs, both.logprobs)


def test_nothing_to_score_gives_zeros_and_connected_graph():
    model = tiny_model("llama")
    ids = torch.randint(0, V, (2, 5))
    res = fused_forward(model, ids, labels=torch.full((2, 5), -100))
    assert logitless.last_backend() == "chunked"
    assert (res.logprobs == 0).all() and (res.entropy == 0).all()
    (res.logprobs.sum() + res.entropy.sum()).backward()  # no error, zero gradients
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_gradient_checkpointing_in_train_mode():
    model = tiny_model("llama")
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()  # dropout is 0 in these configs, so train mode is still deterministic
    ids, mask = padded_batch(2, 8, "left")
    check_against_model(model, ids, mask, temperature=1.2)


def test_cpu_autocast_uses_the_heads_autocast_dtype():
    """Under autocast the model's head multiplies in bfloat16; so does logitless (fp32 accumulation)."""
    model = tiny_model("qwen3")
    ids, mask = padded_batch(2, 7, "right")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fused_forward(model, ids, mask, temperature=1.1)
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    ref_lp, ref_ent = logprobs_entropy64(hidden.bfloat16(), model.lm_head.weight.bfloat16(),
                                         expected_targets(ids, mask), temperature=1.1)
    assert fused.logprobs.dtype == torch.float32
    assert (fused.logprobs.double() - ref_lp).abs().max() <= 1e-3
    assert (fused.entropy.double() - ref_ent).abs().max() <= 2e-3
    (fused.logprobs.sum() + fused.entropy.sum()).backward()
    assert model.lm_head.weight.grad.dtype == torch.float32 and torch.isfinite(model.lm_head.weight.grad).all()


def test_a_training_step_leaves_its_record():
    """fused_forward and fused_policy_loss on a model each leave the record of their step (path "fused", their
    entry, the op's backend and precision), written over the op's own."""
    from logitless.record import last_path, serial_now
    from logitless.transformers import fused_policy_loss
    model = tiny_model("llama")
    model.train()
    ids, mask = padded_batch(2, 8, "left")
    for entry in ("transformers.fused_forward", "transformers.fused_policy_loss"):
        since = serial_now()
        if entry.endswith("fused_forward"):
            loss = fused_forward(model, ids, mask).logprobs.sum()
        else:
            loss = fused_policy_loss(model, ids, mask, advantages=torch.randn(2, 1)).loss
        loss.backward()
        rec = last_path()
        assert rec.serial > since and (rec.path, rec.entry) == ("fused", entry), rec
        assert rec.backend == logitless.last_backend() and rec.precision is not None
