"""The legacy path against a real megatron-core release without the output_processor hook
(0.16.1 in .venv-legacy). Not collected by the main suite (its name has no test_ prefix):
test_megatron_legacy.py runs it with that venv's python. Same checks as the hook path.

With LOGITLESS_LEGACY_DUMP=path it also saves a model's weights, inputs and outputs there, so the
main suite can check that the current release's hook path gives equal numbers on equal weights.
"""
import os

import pytest
import torch

from logitless.megatron import (
    FusedPathUnavailable,
    detect,
    forward_packed,
    forward_padded,
    fused_forward_mode,
    last_path,
    patch_fused_forward,
    supports_output_processor_hook,
    unpatch_fused_forward,
)
from mcore_env import BACKUP, ENT_TOL, GRAD_TOL, LP_TOL


def _release():
    from megatron.core.package_info import __version__
    return tuple(int(x) for x in __version__.split(".")[:2])


def test_release_lacks_the_hook(megatron_tp1, seed):
    assert _release() < (0, 18), "this suite must run on a megatron-core release without the hook"
    model = megatron_tp1.build_gpt(seed=seed)
    assert not supports_output_processor_hook(model)
    assert fused_forward_mode(model) == "legacy"


def test_patch_idempotent_and_exact_undo(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    cls = type(model)
    cls_dict = dict(vars(cls))
    n0 = detect.signature_inspections()
    for _ in range(2):
        assert patch_fused_forward(model) == "legacy"
    patched = model.__dict__["forward"]
    assert BACKUP in model.__dict__
    for _ in range(2):
        assert unpatch_fused_forward(model) == "legacy"
    assert "forward" not in model.__dict__ and BACKUP not in model.__dict__
    assert patch_fused_forward(model) == "legacy" and model.__dict__["forward"] is not patched
    unpatch_fused_forward(model)
    assert "forward" not in model.__dict__ and BACKUP not in model.__dict__
    assert dict(vars(cls)) == cls_dict
    assert detect.signature_inspections() == n0 + 1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("temp_kind", ["scalar", "per_seq", "per_token", "one"])
def test_legacy_matches_unfused(megatron_tp1, seed, tied, temp_kind):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(tied=tied, seed=seed)
    patch_fused_forward(model)
    temperature = env.temperature_of_kind(temp_kind, 3, 12, gen)
    grads, record, _ = env.compare_with_unfused(model, 3, 12, temperature, gen)
    assert record.path == "legacy"
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert grads[head].norm() > 0 and grads["decoder.layers.0.self_attention.linear_qkv.weight"].norm() > 0
    assert "_postprocess" not in model.__dict__ and "forward" not in model.output_layer.__dict__


def test_legacy_mtp_parameters_get_gradients(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(mtp=True, seed=seed)
    patch_fused_forward(model)
    grads, record, _ = env.compare_with_unfused(model, 2, 11, 0.9, gen, with_labels=True)
    mtp = [g for n, g in grads.items() if n.startswith("mtp.")]
    assert record.path == "legacy" and mtp and all(g is not None and g.norm() > 0 for g in mtp)


def test_legacy_post_process_false_no_grad_and_labels_none(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    stage = env.build_gpt(post_process=False, seed=seed)
    patch_fused_forward(stage)
    ids, pos, labels = env.random_batch(2, 7, 262, gen)
    mask = env.causal_mask(7)
    assert env.run_fused(stage, ids, pos, mask, labels, 1.0).shape == (7, 2, 48)
    model = env.build_gpt(seed=seed)
    patch_fused_forward(model)
    with torch.no_grad():
        out = env.run_fused(model, ids, pos, mask, labels, 1.1, with_entropy=False)
        lp, _ = env.reference_from_logits(env.unfused_logits(model, ids, pos, mask), labels, 1.1)
    assert out.entropy is None and not out.logprobs.requires_grad
    assert (out.logprobs.double() - lp).abs().max() <= LP_TOL
    with torch.no_grad():                       # labels=None: the model's own logits, as without the processor
        assert torch.equal(env.run_fused(model, ids, pos, mask, None, 1.0), model(ids, pos, mask))
    assert last_path().path == "legacy" and last_path().backend is None


@pytest.mark.parametrize("packed", [True, False], ids=["thd", "bshd"])
def test_legacy_forward_padded_equals_per_sequence(megatron_tp1, seed, packed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(packed_attention=True, seed=seed)     # not patched by hand: forward_padded does it
    ids, mask = env.ragged_batch(gen)
    temps = 0.6 + torch.rand(ids.shape[0], generator=gen)
    out = forward_padded(model, ids, mask, temperature=temps, packed=packed, strict=True)
    rec = last_path()
    assert rec.path == "legacy" and rec.entry == "forward_padded" and rec.backend in ("chunked", "triton")
    with torch.no_grad():
        for i in range(ids.shape[0]):
            lp, ent = env.per_sequence_reference(model, ids[i][mask[i]], temps[i])
            assert (out.logprobs[i][mask[i]].double() - lp).abs().max() <= LP_TOL
            assert (out.entropy[i][mask[i]].double() - ent).abs().max() <= ENT_TOL


def test_legacy_forward_packed_grads(megatron_tp1, seed):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(packed_attention=True, seed=seed)
    seqs = [torch.randint(0, 262, (n,), generator=gen) for n in (6, 11, 3)]
    model.zero_grad(set_to_none=True)
    out = forward_packed(model, seqs, temperature=0.8)
    assert last_path().path == "legacy"
    sum(lp.sum() - 0.5 * e.sum() for lp, e in zip(out.logprobs, out.entropy, strict=True)).backward()
    fused = env.param_grads(model)
    model.zero_grad(set_to_none=True)
    ref = 0
    for i, seq in enumerate(seqs):
        lp, ent = env.per_sequence_reference(model, seq, 0.8)
        assert (out.logprobs[i].detach().double() - lp).abs().max() <= LP_TOL
        ref = ref + lp.sum() - 0.5 * ent.sum()
    ref.backward()
    for name, g in env.param_grads(model).items():
        if g is not None and g.norm() > 0:
            assert env.rel_err(fused[name], g) <= GRAD_TOL, name


def test_strict_passes_on_the_legacy_path(megatron_tp1, seed, monkeypatch):
    """Legacy is a fused path: strict mode (env var) does not refuse it."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    monkeypatch.setenv("LOGITLESS_STRICT", "1")
    model = env.build_gpt(seed=seed)
    ids, mask = env.ragged_batch(gen)
    forward_padded(model, ids, mask, packed=False)
    assert last_path().path == "legacy"
    assert issubclass(FusedPathUnavailable, RuntimeError)


def test_dump_for_cross_release_check(megatron_tp1, seed):
    """Saves weights, inputs and this release's outputs for test_megatron_legacy.py."""
    path = os.environ.get("LOGITLESS_LEGACY_DUMP")
    if not path:
        pytest.skip("LOGITLESS_LEGACY_DUMP not set: only the main suite's cross-release check needs this dump")
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(tied=True, seed=seed)
    ids, mask = env.ragged_batch(gen)
    temps = 0.6 + torch.rand(ids.shape[0], generator=gen)
    with torch.no_grad():
        out = forward_padded(model, ids, mask, temperature=temps, packed=False, strict=True)
    assert last_path().path == "legacy"
    weights = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and "_extra_state" not in k}
    torch.save({"weights": weights, "ids": ids, "mask": mask, "temps": temps, "logprobs": out.logprobs,
                "entropy": out.entropy, "release": _release()}, path)
