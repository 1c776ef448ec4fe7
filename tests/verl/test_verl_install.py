"""logitless.verl.install / uninstall: every replaced verl attribute and exactly what is put back,
idempotence, and strict mode turning verl's silent fallbacks to its non-fused path into errors."""
import importlib

import pytest
import torch

import logitless.verl as lv
from logitless.megatron import FusedPathUnavailable
from required import import_or_skip

TARGETS = {
    "fsdp.FusedLinearForPPO.forward": ("verl.utils.experimental.torch_functional", "FusedLinearForPPO", "forward"),
    "fsdp.kernel.linear_cross_entropy": ("verl.utils.kernel.linear_cross_entropy", None, "linear_cross_entropy"),
    "fsdp.patch_forward_with_backends": ("verl.models.transformers.monkey_patch", None, "patch_forward_with_backends"),
    "fsdp.engine.forward_step": ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead", "forward_step"),
    "megatron.linear_cross_entropy": ("verl.models.mcore.model_forward_fused", None, "linear_cross_entropy"),
    "megatron.1f1b_overlap.linear_cross_entropy": ("verl.models.mcore.model_forward_1f1b_overlap", None,
                                                   "linear_cross_entropy"),
    "megatron.1f1b_overlap.forward": ("verl.models.mcore.model_forward_1f1b_overlap", None,
                                      "gptmodel_forward_1f1b_overlap"),
    "megatron.patch_fused_forward": ("verl.models.mcore.model_forward_fused", None, "patch_fused_forward"),
    "megatron.engine.maybe_enable_fused_kernels": ("verl.workers.engine.megatron.transformer_impl", "MegatronEngine",
                                                   "_maybe_enable_fused_kernels"),
    "megatron.engine.forward_step": ("verl.workers.engine.megatron.transformer_impl", "MegatronEngineWithLMHead",
                                     "forward_step"),
    "megatron.fused_output_processor": ("verl.models.mcore.model_forward_fused", None, "fused_output_processor"),
    **{f"worker.{m}": ("verl.workers.engine_workers", "ActorRolloutRefWorker", m)
       for m in ("compute_log_prob", "compute_ref_log_prob", "update_actor")},
}


def _owner(module, owner):
    mod = importlib.import_module(module)
    return mod if owner is None else getattr(mod, owner)


def _snapshot():
    return {name: vars(_owner(m, o))[a] for name, (m, o, a) in TARGETS.items()}


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    # checked here rather than at import, so a run that deselects these tests does not report them as skipped
    import_or_skip("verl.models.mcore.model_forward_fused", "make setup installs verl (--no-deps) and its import deps")
    import verl_engine
    verl_engine.stub_server_modules()      # verl's workers module imports its rollout server's (uvicorn, fastapi)
    monkeypatch.delenv("LOGITLESS_STRICT", raising=False)
    lv.uninstall()
    yield
    lv.uninstall()


def test_install_replaces_every_site_and_uninstall_restores_each_original():
    before = _snapshot()
    names = lv.install()
    assert set(names) == set(TARGETS) and lv.is_installed()
    assert all(state.startswith("installed") for state in lv.sites().values())
    during = _snapshot()
    for name in TARGETS:
        assert during[name] is not before[name], name
        assert during[name].__logitless_verl__ == name
    # the Megatron module imported the kernel by name: it must keep verl's kernel as its original
    mff = importlib.import_module("verl.models.mcore.model_forward_fused")
    assert lv.install() == names and _snapshot() == during            # idempotent
    lv.uninstall()
    assert not lv.is_installed() and _snapshot() == before
    assert all(_snapshot()[n] is before[n] for n in TARGETS)
    assert mff.linear_cross_entropy is before["megatron.linear_cross_entropy"]
    lv.uninstall()                                                    # a second uninstall is a no-op
    assert _snapshot() == before
    assert lv.install() == names and lv.sites()["megatron.linear_cross_entropy"].startswith("installed")


def test_class_attribute_restored_exactly():
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    cls_dict = dict(vars(FusedLinearForPPO))
    lv.install()
    assert FusedLinearForPPO.forward is not cls_dict["forward"]
    lv.uninstall()
    assert dict(vars(FusedLinearForPPO)) == cls_dict


def test_bad_arguments():
    with pytest.raises(TypeError, match="strict"):
        lv.install(strict="yes")
    with pytest.raises(TypeError, match="strict"):
        lv.install(strict=1)
    with pytest.raises(TypeError, match="fused_loss"):
        lv.install(fused_loss="yes")
    assert not lv.is_installed()


def _tiny_hf_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("how", ["off", "argument", "env"])
def test_strict_fsdp_unknown_backend(monkeypatch, how):
    """use_fused_kernels=True with no (or an unknown) backend: verl prints "Skipping monkey patch" and
    keeps the unfused forward; strict mode raises instead."""
    from transformers import Qwen2ForCausalLM
    if how == "env":
        monkeypatch.setenv("LOGITLESS_STRICT", "1")
    lv.install(strict=how == "argument")
    from verl.models.transformers import monkey_patch
    model = _tiny_hf_model()
    forward = Qwen2ForCausalLM.forward
    if how == "off":
        assert monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True,
                                                        fused_kernels_backend=None) is None
        assert Qwen2ForCausalLM.forward is forward and not hasattr(model, "_verl_fused_kernels_backend")
    else:
        with pytest.raises(FusedPathUnavailable, match="fused_kernels_backend=None"):
            monkey_patch.patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=None)
        assert Qwen2ForCausalLM.forward is forward
    # fused kernels not asked for: nothing to refuse, even in strict mode
    assert monkey_patch.patch_forward_with_backends(model, use_fused_kernels=False) is None


@pytest.mark.parametrize("how", ["off", "argument", "env"])
def test_strict_megatron_unsupported_model(monkeypatch, how):
    """verl's patch_fused_forward on a model with no GPTModel inside prints "... is not a supported for
    fused forward" and patches nothing; strict mode raises."""
    if how == "env":
        monkeypatch.setenv("LOGITLESS_STRICT", "yes")
    lv.install(strict=how == "argument")
    from verl.models.mcore import model_forward_fused
    model = torch.nn.Linear(2, 2)
    if how == "off":
        assert model_forward_fused.patch_fused_forward(model) is None
        assert "forward" not in model.__dict__
    else:
        with pytest.raises(FusedPathUnavailable, match="Linear"):
            model_forward_fused.patch_fused_forward(model)


@pytest.mark.parametrize("reason", ["no_remove_padding", "value_model", "mtp"])
def test_strict_megatron_engine_disables_fused_kernels(reason):
    """MegatronEngine._maybe_enable_fused_kernels switches use_fused_kernels off with a warning when
    remove-padding is off, for value models and with MTP; strict mode raises. verl's own method runs,
    on an object carrying just the engine state it reads."""
    from types import SimpleNamespace as NS

    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    def engine():
        return NS(engine_config=NS(use_fused_kernels=True, use_remove_padding=reason != "no_remove_padding"),
                  is_value_model=reason == "value_model", model_config=NS(mtp=NS(enable=reason == "mtp")))

    lv.install()
    e = engine()
    MegatronEngine._maybe_enable_fused_kernels(e)
    assert e.engine_config.use_fused_kernels is False
    lv.install(strict=True)                     # installing again updates the strict setting
    with pytest.raises(FusedPathUnavailable, match="use_fused_kernels off"):
        MegatronEngine._maybe_enable_fused_kernels(engine())
    off = NS(engine_config=NS(use_fused_kernels=False), is_value_model=False, model_config=NS(mtp=NS(enable=False)))
    MegatronEngine._maybe_enable_fused_kernels(off)   # not asked for: nothing to refuse


def test_uninstall_resets_strict():
    lv.install(strict=True)
    assert lv.strict_mode()
    lv.uninstall()
    assert not lv.strict_mode()
