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
