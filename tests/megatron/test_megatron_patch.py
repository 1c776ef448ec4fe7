"""Mode detection, the legacy instance patch and its exact undo, wrapper unwrapping."""
import pytest
import torch
from torch import nn

from logitless.megatron import (
    detect,
    fused_forward_mode,
    fused_output_processor,
    last_path,
    patch_fused_forward,
    supports_output_processor_hook,
    unpatch_fused_forward,
)
from mcore_env import BACKUP, Wrapper


class Multimodal(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.language_model = lm
        self.vision = nn.Linear(2, 2)


def test_hook_mode_idempotent_and_untouched(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    cls_forward = type(model).forward
    n0 = detect.signature_inspections()
    assert supports_output_processor_hook(model)
    assert detect.signature_inspections() == n0 + 1      # the explicit check inspects
    for _ in range(2):
        assert patch_fused_forward(model) == "hook"
    for _ in range(2):
        assert unpatch_fused_forward(model) == "hook"
    assert patch_fused_forward(Wrapper(model)) == "hook"
    assert fused_forward_mode(model) == "hook"
    assert detect.signature_inspections() == n0 + 2      # the mode: resolved once, then cached
    assert "forward" not in model.__dict__ and BACKUP not in model.__dict__
    assert type(model).forward is cls_forward
    assert model.forward.__func__ is cls_forward


def _run_pair(env, model, gen, temperature):
    """Fused vs unfused logprobs/entropy/grads on ``model`` (MTP models score through their labels);
    returns the fused parameter gradients."""
    mtp = bool(model.config.mtp_num_layers)
    return env.compare_with_unfused(model, 3, 10, temperature, gen, with_labels=mtp)[0]


@pytest.mark.parametrize("tied,mtp", [(False, False), (True, False), (False, True)], ids=["untied", "tied", "mtp"])
def test_legacy_patch_numbers_and_exact_undo(megatron_tp1, seed, tied, mtp):
    """A forward without the hook parameters: legacy mode patches the instance only, gives the
    unfused path's numbers and gradients, and unpatch restores everything exactly."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    cls = env.old_signature_gpt_class()
    model = env.build_with_class(cls, tied=tied, mtp=mtp, seed=seed)
    assert not supports_output_processor_hook(model)
    n0 = detect.signature_inspections()
    assert fused_forward_mode(model) == "legacy"
    cls_dict = dict(vars(cls))
    for _ in range(2):
        assert patch_fused_forward(Wrapper(model)) == "legacy"
    patched = model.__dict__["forward"]
    assert patch_fused_forward(model) == "legacy" and model.__dict__["forward"] is patched   # one patch, one backup
    assert patched.__self__ is model
    grads = _run_pair(env, model, gen, 0.8)
    assert last_path() is not None
    assert "_postprocess" not in model.__dict__ and "forward" not in model.output_layer.__dict__
    if mtp:
        assert all(g is not None and g.norm() > 0 for n, g in grads.items() if n.startswith("mtp."))
    # the record says legacy
    ids, pos, labels = env.random_batch(2, 5, model.vocab_size, gen)
    with torch.no_grad():
        model(ids, pos, env.causal_mask(5), labels=labels, output_processor=fused_output_processor)
    assert last_path().path == "legacy" and last_path().entry == "processor"
    # without a processor the patched forward is the original one
    with torch.no_grad():
        ce = model(ids, pos, env.causal_mask(5), labels=labels)
    assert ce.shape == (2, 5)
    for _ in range(2):
        assert unpatch_fused_forward(model) == "legacy"
    assert "forward" not in model.__dict__ and BACKUP not in model.__dict__
    assert dict(vars(cls)) == cls_dict                      # the class was never touched
    assert patch_fused_forward(model) == "legacy" and "forward" in model.__dict__
    _run_pair(env, model, gen, 1.0)
    unpatch_fused_forward(model)
    assert "forward" not in model.__dict__ and BACKUP not in model.__dict__
    assert detect.signature_inspections() == n0 + 1


def test_legacy_patch_keeps_a_previous_instance_forward(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_with_class(env.old_signature_gpt_class(), seed=seed)
    calls = []
    original = model.forward

    def traced(*a, **k):
        calls.append(1)
        return original(*a, **k)

    model.forward = traced
    patch_fused_forward(model)
    ids, pos, labels = env.random_batch(2, 5, model.vocab_size)
    with torch.no_grad():
        out = model(ids, pos, env.causal_mask(5), labels=labels, output_processor=fused_output_processor)
    assert calls and out.logprobs.shape == (2, 5)
    unpatch_fused_forward(model)
    assert model.__dict__["forward"] is traced and BACKUP not in model.__dict__


def test_legacy_post_process_false_passes_through(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_with_class(env.old_signature_gpt_class(), post_process=False, seed=seed)
    patch_fused_forward(model)
    ids, pos, labels = env.random_batch(2, 7, 262)
    out = model(ids, pos, env.causal_mask(7), labels=labels, output_processor=fused_output_processor)
    assert torch.is_tensor(out) and out.shape == (7, 2, 48)
    unpatch_fused_forward(model)


def test_unwrapping(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    assert detect.unwrap_gpt_model(Wrapper(Wrapper(model))) is model
    assert detect.unwrap_gpt_model(Multimodal(Wrapper(model))) is model
    assert fused_forward_mode(Multimodal(model)) == "hook"


def test_not_a_gpt_model_is_a_clear_error(megatron_tp1):
    with pytest.raises(TypeError, match="no megatron.core GPTModel"):
        patch_fused_forward(Wrapper(nn.Linear(3, 3)))
    with pytest.raises(TypeError, match="no megatron.core GPTModel"):
        fused_forward_mode(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        unpatch_fused_forward("model")


def test_no_postprocess_model_is_unfused_mode(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_with_class(env.no_postprocess_gpt_class(), seed=seed)
    assert fused_forward_mode(model) == "unfused"
    assert patch_fused_forward(model) == "unfused" and "forward" not in model.__dict__


def test_hook_needs_both_parameters(megatron_tp1, seed):
    """Signature inspection: a forward with output_processor but no output_processor_context is
    not the hook."""
    from megatron.core.models.gpt import GPTModel
    env = megatron_tp1

    class HalfHook(GPTModel):
        def forward(self, input_ids, position_ids, attention_mask, labels=None, output_processor=None):
            return super().forward(input_ids, position_ids, attention_mask, labels=labels,
                                   output_processor=output_processor)

    model = env.build_with_class(HalfHook, seed=seed)
    assert not supports_output_processor_hook(model)
    assert fused_forward_mode(model) == "legacy"
