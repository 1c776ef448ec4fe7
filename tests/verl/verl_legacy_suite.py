"""verl's legacy fused forward (``_fused_GPTModel_forward``, verl's per-instance patch for
megatron-core releases without the output-processor hook) on a real megatron-core 0.16.1 GPTModel
with logitless installed, against verl's unfused path on a model with the same weights. Not
collected by the main suite (no test_ prefix): test_verl_legacy.py runs it with .venv-legacy's python."""
import pytest
import torch

from required import import_or_skip

import_or_skip("megatron.core", "the legacy venv has megatron-core 0.16.1")
import_or_skip("verl.models.mcore.model_forward_fused", "make setup installs verl (--no-deps) into .venv-legacy")

import logitless.verl as lv  # noqa: E402


@pytest.fixture(scope="module")
def env():
    import verl_mcore

    import mcore_env
    mcore_env.init_cpu_megatron()
    yield verl_mcore
    lv.uninstall()
    mcore_env.teardown_cpu_megatron()


def _pair(env, seed, tied=False):
    """A model patched by verl for its fused forward, and an unpatched one with the same weights."""
    from verl.models.mcore.model_forward_fused import patch_fused_forward
    fused, ref = env.build_rope_gpt(seed, tied=tied), env.build_rope_gpt(seed, tied=tied)
    patch_fused_forward(fused)
    return fused, ref


def test_release_has_no_hook(env, seed):
    from megatron.core.package_info import __version__
    assert tuple(int(x) for x in __version__.split(".")[:2]) < (0, 18), __version__
    fused, _ = _pair(env, seed)
    assert fused._verl_fused_forward_mode == "legacy" and "forward" in fused.__dict__


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gen_forward_legacy_matches_verl_unfused(env, seed, tied):
    gen = torch.Generator().manual_seed(seed)
    fused, ref = _pair(env, seed, tied)
    ids, mask, labels, pos = env.padded_batch(gen)
    lv.install()
    record = env.compare(fused, ref, lambda m, f: env.run_gen(m, ids, mask, labels, pos, 0.7, f), gen)
    assert record.path == "legacy" and record.entry == "verl" and record.backend in ("chunked", "triton")
    assert record.model is not None and record.model.endswith("GPTModel"), record


def test_engine_forward_legacy_matches_verl_unfused(env, seed):
    gen = torch.Generator().manual_seed(seed)
    fused, ref = _pair(env, seed)
    ids = env.nested_batch(gen)
    lv.install()
    record = env.compare(fused, ref, lambda m, f: env.run_engine(m, ids, 1.3, f), gen)
    assert record.path == "legacy" and record.entry == "verl"


def test_uninstall_restores_verl_kernel(env, seed):
    import verl.models.mcore.model_forward_fused as mff
    lv.uninstall()
    kernel = mff.linear_cross_entropy
    lv.install()
    assert mff.linear_cross_entropy is not kernel
    lv.uninstall()
    assert mff.linear_cross_entropy is kernel


def test_1f1b_overlap_runs_verls_own_function_without_the_plan_hook(env, seed):
    """megatron-core 0.16.1's build_schedule_plan has no output_processor hook: logitless.verl's
    gptmodel_forward_1f1b_overlap falls back to verl's own function (its _postprocess patch of the plan), whose
    head is logitless' (path "legacy"). Run through the plan's forward and backward (streams as no-ops on CPU),
    against verl's unfused generation forward (verl's vocab-parallel log-probs on the model's logits) on a model
    with the same weights: log-probs (verl's function returns no entropy) and every parameter gradient.
    megatron-core's plan applies no final layernorm after dense layers (its post-process node runs one only for
    an empty decoder, and verl's replacement of that node's forward_impl is never called: the node holds the
    original method), so the models have none; then the plan and the forward compute the same hidden states."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    from verl.models.mcore import model_forward_1f1b_overlap as overlap

    import mcore_env
    from logitless.megatron import last_path, supports_schedule_plan_hook
    lv.install()
    assert getattr(overlap.gptmodel_forward_1f1b_overlap, "__wrapped__", None) is not None   # logitless' wrapper
    gen = torch.Generator().manual_seed(seed)
    model, ref = env.build_rope_gpt(seed), env.build_rope_gpt(seed)
    model.decoder.final_layernorm = ref.decoder.final_layernorm = None
    assert not supports_schedule_plan_hook(model)
    ids, mask, labels, pos = env.padded_batch(gen)
    a = torch.randn(ids.shape, generator=gen)
    model.zero_grad(set_to_none=True)
    with mcore_env.cpu_streams():
        plan = overlap.gptmodel_forward_1f1b_overlap(model, ids, pos, mask, labels=labels, labels_mask=mask,
                                                     temperature=0.8)
        out = Plan.run(plan, None)
        record = last_path()
        Plan.run(None, plan, b_grad=(a,))
    assert isinstance(out, tuple) and len(out) == 1, type(out)   # verl's own function: log-probs only
    assert (record.path, record.entry) == ("legacy", "verl") and record.model.endswith("GPTModel"), record
    got = env.grads(model)
    ref.zero_grad(set_to_none=True)
    want = env.run_gen(ref, ids, mask, labels, pos, 0.8, False)["log_probs"]
    (a * want).sum().backward()
    assert (out[0] - want).abs().max() <= env.LP_TOL and want[mask].abs().sum() > 0
    assert set(got) == set(env.grads(ref))
    for name, g in env.grads(ref).items():
        assert float((got[name] - g).norm() / g.norm().clamp_min(1e-30)) <= env.GRAD_TOL, name
