"""A tiny rotary GPTModel for verl's Megatron forward helpers on CPU, and verl's own unfused
log-prob / entropy computation to compare with. Shared by the hook-mode tests (megatron-core 0.19)
and the legacy suite (0.16.1, run in .venv-legacy)."""
from __future__ import annotations

import torch

import mcore_env

VOCAB = 262


def build_rope_gpt(seed: int, tied: bool = False, sequence_parallel: bool = False, tp: int = 1):
    """fp32 GPTModel with rotary positions (verl's packed THD forwards pass position ids that only a
    rotary model ignores) and the test-only packed attention of mcore_env; random weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=48, num_attention_heads=4, use_cpu_initialization=True,
                            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
                            sequence_parallel=sequence_parallel)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = mcore_env.packed_attention_class()
    layer_spec = spec
    if sequence_parallel:
        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
        spec.submodules.input_layernorm = mcore_env.SequenceParallelTorchNorm
        spec.submodules.pre_mlp_layernorm = mcore_env.SequenceParallelTorchNorm
        layer_spec = TransformerBlockSubmodules(layer_specs=[spec] * 2, layer_norm=mcore_env.SequenceParallelTorchNorm)
    model = GPTModel(config=cfg, transformer_layer_spec=layer_spec, vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type="rope", share_embeddings_and_output_weights=tied)
    with torch.no_grad():   # widen the logits so log-probs and entropies vary (see mcore_env.build_gpt)
        for name, p in model.named_parameters():
            if "output_layer" in name or "word_embeddings" in name:
                p.mul_(25.0)
    return model


def verl_logits_processor(logits, label, temperature):
    """verl's unfused head (MegatronEngine._lm_head_logits_processor without its optional extras):
    divide by the temperature in place, entropy with vocab_parallel_entropy, log-probs with
    vocab_parallel_log_probs_from_logits on a copy (Megatron's cross entropy works in place)."""
    from verl.utils.megatron.tensor_parallel import vocab_parallel_entropy, vocab_parallel_log_probs_from_logits
    temperature = temperature.clone()
    temperature[temperature <= 0] = 1e-8          # verl's rule: packing pads the temperature with zeros
    logits = logits.div(temperature.unsqueeze(-1).to(logits.dtype))
    entropy = vocab_parallel_entropy(logits)
    return {"entropy": entropy, "log_probs": vocab_parallel_log_probs_from_logits(logits.clone(), label)}


def padded_batch(gen, b=3, s=11):
    """input_ids [b, s], attention mask (right padding, as verl's rollout batches), next-token labels."""
    ids = torch.randint(0, VOCAB, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.bool)
    mask[0, 8:] = False
    mask[2, 5:] = False
    labels = torch.roll(ids, -1, dims=1)
    pos = torch.arange(s).expand(b, s).contiguous()
    return ids, mask, labels, pos


def nested_batch(gen, lengths=(7, 4, 10)):
    """verl engine input: a jagged nested tensor of token ids (no padding)."""
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    return torch.nested.nested_tensor(seqs, layout=torch.jagged)


def run_gen(model, ids, mask, labels, pos, temperature, fused: bool):
    """verl's generation-path forward: fused (fused_forward_model_gen) or unfused (model_forward_gen
    with verl's own logits processor). Returns {"log_probs", "entropy"} [b, s]."""
    if fused:
        from verl.models.mcore.model_forward_fused import fused_forward_model_gen
        return fused_forward_model_gen(False)(model, ids, pos, mask, labels, mask, temperature, {})
    from verl.models.mcore.model_forward import model_forward_gen
    temp = torch.full(ids.shape, float(temperature))
    out = model_forward_gen(False)(model, ids, mask, pos, {}, logits_processor=verl_logits_processor,
                                   logits_processor_args={"label": labels, "temperature": temp})
    out["log_probs"] = out["log_probs"].masked_fill(~mask, 0.0)
    return out


def run_engine(model, ids, temperature, fused: bool):
    """verl's engine forward on nested (no-padding) input: fused (fused_forward_model_engine) or
    unfused (gptmodel_forward_model_engine with verl's logits processor). Returns padded
    {"log_probs", "entropy"} [b, max_len]."""
    if fused:
        from verl.models.mcore.model_forward_fused import fused_forward_model_engine
        out = fused_forward_model_engine(False)(model, ids, ids.clone(), {}, temperature, True, 0)
    else:
        from verl.models.mcore.model_forward import gptmodel_forward_model_engine
        lengths = ids.offsets().diff().tolist()
        temp = torch.nested.nested_tensor([torch.full((n,), float(temperature)) for n in lengths],
                                          layout=torch.jagged)
        out = gptmodel_forward_model_engine(model, ids, {}, logits_processor=verl_logits_processor,
                                            logits_processor_args={"label": ids.clone(), "temperature": temp},
                                            pad_token_id=0, data_format="thd")
    return {k: (v.to_padded_tensor(0.0) if v.is_nested else v) for k, v in out.items()}


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


LP_TOL = ENT_TOL = 2e-5
GRAD_TOL = 1e-4


def compare(fused_model, ref_model, run, gen):
    """``run(model, fused)`` -> {"log_probs", "entropy"}: verl's fused forward on ``fused_model``
    (logitless installed) against verl's unfused forward on ``ref_model`` (the same model in hook
    mode; a copy with the same weights in legacy mode, where verl's patch replaces the forward).
    Asserts values and every parameter gradient agree; returns logitless' record of the fused call."""
    from logitless.megatron import last_path
    fused_model.zero_grad(set_to_none=True)
    fused = run(fused_model, True)
    record = last_path()
    shape = fused["log_probs"].shape
    a, c = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    ((a * fused["log_probs"]).sum() + (c * fused["entropy"]).sum()).backward()
    g_fused = grads(fused_model)

    ref_model.zero_grad(set_to_none=True)
    ref = run(ref_model, False)
    ((a * ref["log_probs"]).sum() + (c * ref["entropy"]).sum()).backward()
    g_ref = grads(ref_model)

    assert fused["log_probs"].dtype == torch.float32 and fused["entropy"].dtype == torch.float32
    assert fused["log_probs"].abs().sum() > 0
    e_lp = float((fused["log_probs"] - ref["log_probs"]).abs().max())
    e_ent = float((fused["entropy"] - ref["entropy"]).abs().max())
    assert e_lp <= LP_TOL and e_ent <= ENT_TOL, (e_lp, e_ent)
    assert g_fused.keys() == g_ref.keys() and g_ref
    for name, g in g_ref.items():
        assert mcore_env.rel_err(g_fused[name], g) <= GRAD_TOL, name
    return record
