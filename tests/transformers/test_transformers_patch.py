"""patch_model / unpatch_model on one instance, and wrapped models (PEFT LoRA, DistributedDataParallel)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import logitless
from logitless.transformers import FusedCausalLMOutput, fused_forward, is_patched, patch_model, unpatch_model
from reference64 import rel_err
from required import import_or_skip
from test_transformers import (
    TOL_ENT,
    TOL_GRAD,
    TOL_LP,
    V,
    expected_targets,
    grads_of,
    padded_batch,
    reference_from_logits,
    tiny_model,
)


def test_patch_is_instance_level_and_idempotent():
    model, other = tiny_model("llama"), tiny_model("llama")
    cls = type(model)
    class_forward = vars(cls)["forward"]
    ids, mask = padded_batch(3, 8, "left")

    assert patch_model(model, temperature=0.8) is model
    patch_model(model, temperature=0.8)  # again: same single patch
    assert is_patched(model) and not is_patched(other)
    assert vars(cls)["forward"] is class_forward and "forward" not in vars(other)

    out = model(input_ids=ids, attention_mask=mask)
    assert isinstance(out, FusedCausalLMOutput) and "logits" not in out.keys()
    assert logitless.last_backend() == "chunked"
    want = fused_forward(model, ids, mask, temperature=0.8)
    assert torch.equal(out.logprobs, want.logprobs) and torch.equal(out.entropy, want.entropy)
    assert other(input_ids=ids, attention_mask=mask).logits.shape == (3, 8, V)  # untouched instance

    patch_model(model, temperature=1.7, with_entropy=False)  # re-patching updates the settings
    out = model(input_ids=ids, attention_mask=mask)
    assert out.entropy is None
    assert torch.equal(out.logprobs, fused_forward(model, ids, mask, temperature=1.7).logprobs)
    out = model(input_ids=ids, attention_mask=mask, temperature=0.6, with_entropy=True)  # per-call override
    assert torch.equal(out.entropy, fused_forward(model, ids, mask, temperature=0.6).entropy)

    assert unpatch_model(model) is model
    unpatch_model(model)  # again: no-op
    assert not is_patched(model) and "forward" not in vars(model)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_lp, _ = reference_from_logits(logits, expected_targets(ids, mask), 0.8)
    assert (want.logprobs.double() - ref_lp).abs().max() <= TOL_LP
    assert vars(cls)["forward"] is class_forward


def test_patched_forward_gradients_and_label_conventions():
    model = patch_model(tiny_model("qwen2"))
    ids = torch.randint(0, V, (2, 9))
    # transformers' labels= convention: unshifted, the model scores position t against labels[t+1]
    hf_labels = ids.clone()
    hf_labels[0, :3] = -100  # a prompt
    out = model(input_ids=ids, labels=hf_labels)
    shifted = torch.full_like(ids, -100)
    shifted[:, :-1] = hf_labels[:, 1:]
    by_shift = model(input_ids=ids, shift_labels=shifted)  # already shifted: used as given
    assert torch.equal(out.logprobs, by_shift.logprobs)
    assert (out.logprobs[0, :2] == 0).all() and (out.logprobs[:, -1] == 0).all()

    a, b = torch.randn(ids.shape), torch.randn(ids.shape)
    g_fused = grads_of(model, out.logprobs, out.entropy, a, b)
    unpatch_model(model)
    logits = model(input_ids=ids, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, shifted)
    assert (out.logprobs.double() - ref_lp).abs().max() <= TOL_LP
    assert (out.entropy.double() - ref_ent).abs().max() <= TOL_ENT
    g_ref = grads_of(model, ref_lp, ref_ent, a.double(), b.double())
    assert g_fused.keys() == g_ref.keys()
    for name, g in g_ref.items():
        assert rel_err(g_fused[name], g) <= TOL_GRAD, name


def test_patched_packed_row_and_refusals():
    model = patch_model(tiny_model("llama"))
    lengths = [4, 6, 3]
    ids = torch.randint(0, V, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    out = model(input_ids=ids, position_ids=pos)
    want = fused_forward(model, ids, position_ids=pos)
    assert torch.equal(out.logprobs, want.logprobs)
    assert ((out.logprobs != 0) == (expected_targets(ids, pos=pos) != -100)).all()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, logits_to_keep=1)


def test_unpatch_restores_a_previous_instance_forward():
    model = tiny_model("gpt2")
    own = functools.partial(type(model).forward, model)
    model.forward = own  # e.g. a hook library's instance-level wrapper
    patch_model(model)
    assert "logprobs" in model(input_ids=torch.randint(0, V, (1, 5))).keys()
    unpatch_model(model)
    assert vars(model)["forward"] is own


def lora_model():
    peft = import_or_skip("peft", "make setup installs peft")
    base = tiny_model("llama")
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # LoRA B starts at zero; make the adapter change the output
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.2)
    return model, base


def test_peft_lora_model():
    model, base = lora_model()
    ids, mask = padded_batch(2, 8, "right")
    fused = fused_forward(model, ids, mask, temperature=1.3)
    assert not is_patched(model)  # fused_forward's temporary patch is gone
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, expected_targets(ids, mask), 1.3)
    assert (fused.logprobs.double() - ref_lp).abs().max() <= TOL_LP
    assert (fused.entropy.double() - ref_ent).abs().max() <= TOL_ENT
    a, b = torch.randn(ids.shape), torch.randn(ids.shape)
    g_fused = grads_of(model, fused.logprobs, fused.entropy, a, b)
    g_ref = grads_of(model, ref_lp, ref_ent, a.double(), b.double())
    assert g_ref.keys() == g_fused.keys() and all("lora_" in n for n in g_ref) and len(g_ref) == 8
    for name, g in g_ref.items():
        assert rel_err(g_fused[name], g) <= TOL_GRAD, name

    patch_model(model, temperature=1.3)
    assert is_patched(base) and "forward" in vars(base)  # the causal LM inside the adapter is patched
    out = model(input_ids=ids, attention_mask=mask)
    assert torch.equal(out.logprobs, fused.logprobs)
    unpatch_model(model)
    assert "forward" not in vars(base)


def test_lora_on_the_head_is_refused():
    peft = import_or_skip("peft", "make setup installs peft")
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="lm_head"):
        fused_forward(model, torch.randint(0, V, (1, 4)))
    with pytest.raises(ValueError, match="lm_head"):
        patch_model(model)


@pytest.fixture
def single_process_group(tmp_path):
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a multi-process default group is already initialised in this process")
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_distributed_data_parallel_wrapper(single_process_group):
    model = tiny_model("gpt2")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ids, mask = padded_batch(2, 7, "left")
    fused = fused_forward(ddp, ids, mask)  # through DDP.forward, so its reducer is prepared
    a, b = torch.randn(ids.shape), torch.randn(ids.shape)
    g_fused = grads_of(ddp, fused.logprobs, fused.entropy, a, b)
    logits = ddp(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, expected_targets(ids, mask))
    assert (fused.logprobs.double() - ref_lp).abs().max() <= TOL_LP
    g_ref = grads_of(ddp, ref_lp, ref_ent, a.double(), b.double())
    for name, g in g_ref.items():
        assert rel_err(g_fused[name], g) <= TOL_GRAD, name

    patch_model(ddp)
    assert is_patched(model) and "forward" not in vars(ddp)  # DDP's own forward keeps running
    out = ddp(input_ids=ids, attention_mask=mask)
    assert torch.equal(out.logprobs, fused.logprobs)
    out.logprobs.sum().backward()
    unpatch_model(ddp)
    assert not is_patched(model)
