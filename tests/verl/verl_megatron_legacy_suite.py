"""``logitless.verl.install(fused_loss=True)`` on verl 0.9.1's Megatron engine with megatron-core 0.16.1 (no
output-processor hook: verl's legacy fused forward, which logitless' legacy patch replaces for the fused
micro-batches): ``TrainingWorker.train_mini_batch`` -> ``MegatronEngineWithLMHead``, TP 1 on a 1-rank gloo group
(the CPU recipe of verl_megatron_engine.py), one SGD step against verl's own unfused Megatron path
(``use_fused_kernels=False``) on the same batch and parameters: every parameter, every metric verl logs (names and
values), ``last_path()`` saying "legacy"; verl's compute_log_prob, a fallback setting and verl's distillation
(forward_kl_topk, k3) on that release too.
Not collected by the main suite (no test_ prefix): test_verl_legacy.py runs it with .venv-legacy's python."""
import pytest
import torch
import verl_engine as ve

from required import import_or_skip

ve.stub_server_modules()
import_or_skip("megatron.core", "the legacy venv has megatron-core 0.16.1")
import_or_skip("mbridge", "make setup installs mbridge into .venv-legacy")
import_or_skip("verl.workers.engine.megatron", "make setup installs verl (--no-deps) and its import deps")

import verl_megatron_engine as vme  # noqa: E402
from verl_megatron_engine import assert_same_update  # noqa: E402

import logitless.verl as lv  # noqa: E402

P = "actor_rollout_ref.actor."
THD = ["actor_rollout_ref.model.use_remove_padding=True"]


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    """(verl's unfused actor, an actor built with verl's fused kernels) from the same checkpoint, THD
    micro-batches; Megatron's model-parallel state destroyed after the module."""
    from megatron.core.package_info import __version__
    assert tuple(int(x) for x in __version__.split(".")[:2]) < (0, 18), __version__
    path = str(tmp_path_factory.mktemp("qwen2"))
    ve.save_tiny_qwen2(path, seed=3, tied=True)
    plain = vme.Actor(path, THD)
    fused = vme.Actor(path, [*THD, "actor_rollout_ref.model.use_fused_kernels=True"])
    assert fused.worker.engine.engine_config.use_fused_kernels
    yield plain, fused
    lv.uninstall()
    vme.teardown()


def _gpt(actor):
    from verl.utils.megatron_utils import unwrap_model
    return unwrap_model(actor.worker.engine.module[0])


# (actor settings, engine settings): vanilla token-mean; gspo seq-mean-token-mean over micro-batches of 3; vanilla
# seq-mean-token-sum with a KL loss and an entropy bonus, dual clip active, dynamic micro-batch sizes
CASES = {
    "vanilla-token-mean": ([f"{P}loss_agg_mode=token-mean"], {}),
    "gspo-seq-mean-token-mean": ([f"{P}policy_loss.loss_mode=gspo", f"{P}loss_agg_mode=seq-mean-token-mean",
                                  f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"],
                                 {"micro_batch_size_per_gpu": 3}),
    "vanilla-kl-entropy": ([f"{P}loss_agg_mode=seq-mean-token-sum", f"{P}use_kl_loss=True",
                            f"{P}kl_loss_type=low_var_kl", f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02",
                            f"{P}clip_ratio_c=1.2"],
                           {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_loss_legacy_matches_verl_megatron_update(actors, case):
    plain, fused = actors
    settings, engine = CASES[case]
    gen = torch.Generator().manual_seed(11 + sorted(CASES).index(case))
    tensors, meta = ve.rollout_batch(gen, plain.model_dir)
    entropy = any("entropy_coeff" in s for s in settings)
    verl_forward = _gpt(fused).__dict__["forward"]          # verl's legacy fused forward, per instance
    assert _gpt(fused)._verl_fused_forward_mode == "legacy"
    want = plain.update(tensors, meta, settings, calculate_entropy=entropy, mini_batch_size=6, engine=engine)
    lv.install(fused_loss=True, strict=True)
    try:
        got = fused.update(tensors, meta, settings, calculate_entropy=entropy, mini_batch_size=6, engine=engine)
    finally:
        lv.uninstall()
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("legacy", "verl.policy_loss", ""), rec
    assert rec.backend in ("chunked", "triton")
    assert_same_update(plain.initial, got, want)
    gpt = _gpt(fused)        # verl's forward back in place, logitless' patch gone
    assert gpt.__dict__["forward"] == verl_forward and "_logitless_forward_backup" not in gpt.__dict__
    if case == "vanilla-kl-entropy":
        assert max(want[0]["actor/pg_clipfrac_lower"]) > 0, "dual clip never active: the case tests nothing"
    if case.startswith("gspo"):
        assert max(want[0]["actor/pg_clipfrac"]) > 0, "no clip event: the case does not test the clipping"
    if case == "vanilla-token-mean":       # verl's compute_log_prob: its legacy fused forward, logitless' head
        lp_want, ent_want = plain.infer(tensors, meta, settings)
        lv.install(fused_loss=True, strict=True)
        try:
            lp, ent = fused.infer(tensors, meta, settings)
        finally:
            lv.uninstall()
        assert (lv.last_path().path, lv.last_path().entry) == ("legacy", "verl")
        assert float((lp - lp_want).abs().max()) <= 2e-5 and float((ent - ent_want).abs().max()) <= 2e-5
        assert lp.abs().sum() > 0


def test_unfusable_setting_runs_verl_loss_on_legacy(actors):
    """A setting the fused loss does not reproduce (bypass_mode's batch-normalised IS weights): verl's own loss
    through its legacy fused forward, the same update as verl's unfused actor, recorded; refused under strict
    mode."""
    plain, fused = actors
    rc = "+actor_rollout_ref.actor.policy_loss.rollout_correction."
    settings = [f"{P}policy_loss.loss_mode=bypass_mode", f"{rc}loss_type=reinforce", f"{rc}rollout_is=token",
                f"{rc}rollout_is_batch_normalize=True", f"{P}use_kl_loss=True"]
    named = "rollout_is_batch_normalize=True"
    gen = torch.Generator().manual_seed(5)
    tensors, meta = ve.rollout_batch(gen, plain.model_dir)
    lv.install(fused_loss=True, strict=True)
    try:
        with pytest.raises(lv.FusedPathUnavailable, match=named):
            fused.update(tensors, meta, settings, calculate_entropy=True, mini_batch_size=6)
    finally:
        lv.uninstall()
    want = plain.update(tensors, meta, settings, calculate_entropy=True, mini_batch_size=6)
    lv.install(fused_loss=True)
    try:
        got = fused.update(tensors, meta, settings, calculate_entropy=True, mini_batch_size=6)
    finally:
        lv.uninstall()
    rec = lv.last_path()
    assert rec.path == "unfused" and rec.entry == "verl.policy_loss" and named in rec.reason, rec
    assert_same_update(plain.initial, got, want)


DL = ve.DL
# verl's distillation on the legacy release: (mode, distillation settings, actor settings)
DISTILLATION = {
    "topk-clamps": ("forward_kl_topk", [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=False",
                                        f"{DL}log_prob_min_clamp=-9.0", f"{DL}loss_max_clamp=0.3"], []),
    "topk-task-rewards": ("forward_kl_topk", [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.7",
                                              f"{DL}use_policy_gradient=False"],
                          [f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01"]),
    "k3-task-rewards": ("k3", [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.5",
                               f"{DL}use_policy_gradient=False"], [f"{P}use_kl_loss=True"]),
}


@pytest.mark.parametrize("case", sorted(DISTILLATION))
def test_distillation_legacy_matches_verl_megatron_update(actors, case):
    """verl's distillation (``distillation_ppo_loss``) through logitless' legacy patch (top-k: the divergence in
    verl's output processor; k3: verl's legacy fused forward on logitless' head) against verl's update from the
    model's logits: parameters, every metric, path "legacy", verl's instance forward back in place."""
    plain, fused = actors
    mode, dsettings, settings = DISTILLATION[case]
    gen = torch.Generator().manual_seed(41 + sorted(DISTILLATION).index(case))
    tensors, meta = ve.teacher_batch(gen, plain.model_dir, topk=mode == "forward_kl_topk")
    overrides = ve.distillation_enabled(plain.model_dir, mode, *dsettings) + settings
    entropy = any("entropy_coeff" in s for s in settings)
    verl_forward = _gpt(fused).__dict__["forward"]
    want = plain.update(tensors, meta, overrides, calculate_entropy=entropy, mini_batch_size=6)
    lv.install(fused_loss=True, strict=True)
    try:
        got = fused.update(tensors, meta, overrides, calculate_entropy=entropy, mini_batch_size=6)
    finally:
        lv.uninstall()
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("legacy", "verl.distillation", ""), rec
    ve.check_distillation_case(want[0], mode, dsettings)
    assert_same_update(plain.initial, got, want)
    assert _gpt(fused).__dict__["forward"] == verl_forward
