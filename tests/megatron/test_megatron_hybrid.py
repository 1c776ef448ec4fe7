"""HybridModel (and the deprecated MambaModel wrapper) on CPU: a real HybridModel with a layer pattern
of attention ("*") and MLP ("-") layers (Mamba layers need CUDA kernels). megatron-core 0.19's
HybridModel.forward has no output_processor hook: logitless' instance patch intercepts its main
output-layer call. Every number against the same model's own unfused outputs and gradients."""
import pytest
import torch

from logitless.losses import PolicyLoss, PolicyLossOutput
from logitless.megatron import (
    FusedOutputProcessorContext,
    detect,
    forward_packed,
    forward_padded,
    fused_forward_mode,
    fused_output_processor,
    last_path,
    patch_fused_forward,
    supports_output_processor_hook,
    unpatch_fused_forward,
)
from mcore_env import BACKUP, ENT_TOL, GRAD_TOL, LP_TOL, Wrapper


def test_legacy_patch_idempotent_cached_and_exact_undo(megatron_tp1, seed):
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    env = megatron_tp1
    model = env.build_hybrid(seed=seed)
    cls_dict = dict(vars(HybridModel))
    n0 = detect.signature_inspections()
    assert not supports_output_processor_hook(Wrapper(model))
    for _ in range(2):
        assert patch_fused_forward(Wrapper(model)) == "legacy"
    patched = model.__dict__["forward"]
    assert patch_fused_forward(model) == "legacy" and model.__dict__["forward"] is patched
    for _ in range(2):
        assert unpatch_fused_forward(model) == "legacy"
    assert "forward" not in model.__dict__ and BACKUP not in model.__dict__
    assert dict(vars(HybridModel)) == cls_dict
    assert detect.signature_inspections() == n0 + 2        # the explicit check, then the cached mode


@pytest.mark.parametrize("tied,temp_kind", [(False, "per_token"), (True, "per_seq"), (False, "one")])
def test_hybrid_matches_unfused(megatron_tp1, seed, tied, temp_kind):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_hybrid(pattern="*-*-", tied=tied, seed=seed)
    assert patch_fused_forward(model) == "legacy"
    temperature = env.temperature_of_kind(temp_kind, 3, 11, gen)
    grads, rec, _ = env.compare_with_unfused(model, 3, 11, temperature, gen)
    assert rec.path == "legacy" and rec.backend in ("chunked", "triton", "reference") and rec.model == "HybridModel"
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert grads[head].norm() > 0 and grads["decoder.layers.0.self_attention.linear_qkv.weight"].norm() > 0
    assert grads["decoder.layers.1.mlp.linear_fc1.weight"].norm() > 0
    assert "forward" not in model.output_layer.__dict__


def test_mamba_model_wrapper(megatron_tp1, seed):
    from megatron.core.models.mamba import MambaModel
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_hybrid(pattern="-*", cls=MambaModel, seed=seed)
    assert fused_forward_mode(Wrapper(model)) == "legacy"
    patch_fused_forward(model)
    _, rec, _ = env.compare_with_unfused(model, 2, 9, 0.8, gen)
    assert rec.path == "legacy" and rec.model == "MambaModel"


def test_policy_loss_and_labels_none(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_hybrid(seed=seed, tied=True)
    patch_fused_forward(model)
    b, s = 2, 9
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    labels[:, :2] = -100
    mask = env.causal_mask(s)
    adv = torch.randn(b, 1, generator=gen)
    with torch.no_grad():                           # old log-probs near the current ones: ratios around 1
        now, _ = env.reference_from_logits(env.unfused_logits(model, ids, pos, mask), labels.clamp(min=0), 0.9)
    old = (now + 0.4 * torch.randn(b, s, generator=gen, dtype=torch.float64)).clamp(max=0.0).float()
    policy = PolicyLoss(advantages=adv, old_logprobs=old, clip_low=0.2, clip_high=0.3, loss_agg="token-mean")

    model.zero_grad(set_to_none=True)
    out = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor,
                output_processor_context=FusedOutputProcessorContext(temperature=0.9, loss=policy))
    assert isinstance(out, PolicyLossOutput) and last_path().path == "legacy"
    out.loss.backward()
    fused = env.param_grads(model)
    model.zero_grad(set_to_none=True)
    lp, _ = env.reference_from_logits(env.unfused_logits(model, ids, pos, mask), labels.clamp(min=0), 0.9)
    valid = labels != -100
    ratio = torch.exp(lp - old.double())
    a = adv.double()
    per_token = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.3))
    loss64 = per_token[valid].mean()
    loss64.backward()
    assert abs(out.loss.item() - loss64.item()) <= 1e-5
    for name, g in env.param_grads(model).items():
        if g is not None and g.norm() > 0:
            assert env.rel_err(fused[name], g) <= GRAD_TOL, name

    with torch.no_grad():                           # labels=None: the model's own logits
        got = model(ids, pos, mask, output_processor=fused_output_processor)
        assert torch.equal(got, model(ids, pos, mask))
    assert last_path().path == "legacy" and last_path().backend is None


def test_forward_padded_and_packed_on_hybrid(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_hybrid(packed_attention=True, seed=seed)
    ids, mask = env.ragged_batch(gen)
    temps = 0.6 + torch.rand(ids.shape[0], generator=gen)
    out = forward_padded(model, ids, mask, temperature=temps, strict=True)
    assert last_path().path == "legacy" and last_path().entry == "forward_padded" and last_path().model == "HybridModel"
    seqs = [ids[i][mask[i]] for i in range(ids.shape[0])]
    packed = forward_packed(model, seqs, temperature=temps, strict=True)
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            lp, ent = env.per_sequence_reference(model, seq, temps[i])
            assert (out.logprobs[i][mask[i]].double() - lp).abs().max() <= LP_TOL
            assert (out.entropy[i][mask[i]].double() - ent).abs().max() <= ENT_TOL
            assert (packed.logprobs[i].detach().double() - lp).abs().max() <= LP_TOL


def test_hook_mode_when_hybrid_forward_gains_the_hook(megatron_tp1, seed):
    """A HybridModel whose forward takes output_processor / output_processor_context (the upstream
    change in progress; emulated here by calling the processor with the hidden states the output
    layer would get): hook mode from the signature, nothing patched."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    env = megatron_tp1

    class HookedHybridModel(HybridModel):
        def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                    inference_context=None, runtime_gather_output=None, *, loss_mask=None,
                    packed_seq_params=None, output_processor=None, output_processor_context=None, **kw):
            if output_processor is None:
                return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                       inference_context, runtime_gather_output, loss_mask=loss_mask,
                                       packed_seq_params=packed_seq_params, **kw)
            caught = {}

            def grab(hidden, weight=None, runtime_gather_output=None):
                caught.update(hidden=hidden, weight=weight)
                raise StopIteration
            self.output_layer.forward = grab
            try:
                super().forward(input_ids, position_ids, attention_mask, decoder_input, labels,
                                inference_context, runtime_gather_output, loss_mask=loss_mask,
                                packed_seq_params=packed_seq_params, **kw)
            except StopIteration:
                pass
            finally:
                del self.output_layer.forward
            return output_processor(hidden_states=caught["hidden"], output_layer=self.output_layer,
                                    output_weight=caught["weight"], labels=labels, context=output_processor_context,
                                    runtime_gather_output=runtime_gather_output, scale_logits=self._scale_logits,
                                    compute_language_model_loss=self.compute_language_model_loss, config=self.config)

    gen = torch.Generator().manual_seed(seed)
    model = env.build_hybrid(cls=HookedHybridModel, seed=seed)
    assert supports_output_processor_hook(model) and patch_fused_forward(model) == "hook"
    assert "forward" not in model.__dict__
    _, rec, _ = env.compare_with_unfused(model, 2, 8, 1.1, gen)
    assert rec.path == "hook" and rec.model == "HookedHybridModel"
    ids, pos, _ = env.random_batch(2, 8, model.vocab_size, gen)
    with torch.no_grad():                           # labels=None through the hook: the model's own logits
        got = model(ids, pos, env.causal_mask(8), output_processor=fused_output_processor)
        assert (last_path().path, last_path().backend) == ("hook", None)
        assert torch.equal(got, model(ids, pos, env.causal_mask(8)))


@pytest.mark.parametrize("cls_name,tied", [("HybridModel", False), ("MambaModel", True)])
def test_labels_none_returns_the_models_own_output(megatron_tp1, seed, cls_name, tied):
    """labels=None through the legacy patch of a HybridModel / MambaModel: exactly the model's own output
    without the processor (logits [b, s, V]) and its parameter gradients; or, configured, the hidden states
    the output layer would have been given. No fused op runs, and the record says so."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    from megatron.core.models.mamba import MambaModel
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_hybrid(cls={"HybridModel": HybridModel, "MambaModel": MambaModel}[cls_name], tied=tied,
                             seed=seed)
    assert patch_fused_forward(Wrapper(model)) == "legacy"
    b, s = 2, 7
    ids, pos, _ = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    w = torch.randn(b, s, model.vocab_size, generator=gen)

    rec = env.assert_own_output_without_labels(
        model, lambda: Wrapper(model)(ids, pos, mask, output_processor=fused_output_processor), ids, pos, mask, w)
    assert (rec.path, rec.model, rec.backend) == ("legacy", cls_name, None) and "labels is None" in rec.reason

    seen = []
    handle = model.output_layer.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        hidden = model(ids, pos, mask, output_processor=fused_output_processor,
                       output_processor_context=FusedOutputProcessorContext(without_labels="hidden_states"))
        seen.clear()                                               # (the patch's intercepted call fired the hook)
        model(ids, pos, mask)
    handle.remove()
    assert len(seen) == 1 and hidden.shape == (s, b, 48) and torch.equal(hidden, seen[0])
    assert "forward" not in model.output_layer.__dict__


def test_float16module_wrapped_hybrid_bf16(megatron_tp1, seed):
    """A bf16 HybridModel inside Megatron's Float16Module: the patch reaches the inner model through the
    wrapper, the processor runs on the bf16 hidden states and the fp32 results come back through the wrapper;
    values against float64 from those very hidden states and the bf16 weight."""
    from megatron.core.transformer.module import Float16Module

    from reference64 import logprobs_entropy64
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    inner = env.build_hybrid(seed=seed, bf16=True)
    model = Float16Module(inner.config, inner)
    assert patch_fused_forward(model) == "legacy" and "forward" in inner.__dict__ and "forward" not in model.__dict__
    ids, pos, labels = env.random_batch(2, 8, 262, gen)
    mask = env.causal_mask(8)
    with torch.no_grad():
        lp, ent = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor,
                        output_processor_context=FusedOutputProcessorContext(temperature=0.9))
        rec = last_path()
        hidden = model(ids, pos, mask, labels=labels, output_processor=lambda **kw: kw["hidden_states"])
    assert (rec.path, rec.model) == ("legacy", "HybridModel") and lp.dtype == ent.dtype == torch.float32
    weight = inner.output_layer.weight
    assert weight.dtype == torch.bfloat16      # (the wrapper hands the hidden states back as fp32 of bf16 values)
    lp64, ent64 = logprobs_entropy64(hidden.to(torch.bfloat16).transpose(0, 1), weight, labels, 0.9)
    assert (lp.double() - lp64).abs().max() <= 1e-3
    assert (ent.double() - ent64).abs().max() <= 2e-3
