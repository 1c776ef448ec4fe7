"""``logitless.verl.install(fused_loss=True)`` on verl 0.9.1's distillation on its Megatron engine
(``TrainingWorker.train_mini_batch`` -> ``MegatronEngineWithLMHead``, megatron-core 0.19.2 hook mode, TP 1 on a
1-rank gloo group, verl_megatron_engine.py) with verl's ``distillation_ppo_loss``: one SGD step on the same batch
and from the same parameters as verl's own update from the model's logits (the actor without fused kernels, whose
logits processor computes verl's vocab-parallel forward_kl_topk; logitless not installed): parameters after the
step, every metric verl logs (the distillation/* ones included, same names and values), and ``last_path()``.

The teacher's top-k are verl_engine.teacher_batch's: a teacher's next-token distribution at every position (the
student's logits plus noise), converted by verl's ``left_right_2_no_padding`` as the trainer hands them over. TP 2
(with and without sequence parallelism) runs in verl_megatron_tp2_worker.py."""
import pytest
import torch
import verl_engine as ve
from verl_engine import run

from required import import_or_skip

ve.stub_server_modules()
import_or_skip("megatron.core", "make setup installs megatron-core")
import_or_skip("mbridge", "make setup installs mbridge (the test extra)")
import_or_skip("verl.workers.engine.megatron", "make setup installs verl (--no-deps) and its import deps")

import verl_megatron_engine as vme  # noqa: E402
from verl_megatron_engine import assert_same_update  # noqa: E402

import logitless.verl as lv  # noqa: E402
from logitless.verl import FusedPathUnavailable  # noqa: E402

DL = ve.DL
P = ve.P
THD = ["actor_rollout_ref.model.use_remove_padding=True"]
teacher_batch, enabled = ve.teacher_batch, ve.distillation_enabled


@pytest.fixture(scope="module")
def actors(model_dir):
    """(verl's actor without fused kernels: the logits path, the one verl's top-k distillation runs on; the actor
    with verl's fused kernels, the one logitless runs on): the same weights, THD micro-batches."""
    plain = vme.Actor(model_dir, THD)
    fused = vme.Actor(model_dir, [*THD, "actor_rollout_ref.model.use_fused_kernels=True"])
    return plain, fused


pytestmark = pytest.mark.usefixtures("megatron_state", "uninstalled")      # tests/verl/conftest.py


# (name, loss mode, distillation settings, actor settings, engine settings)
CASES = [
    ("topk-only-clamps", "forward_kl_topk",
     [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=False", f"{DL}log_prob_min_clamp=-12.0",
      f"{DL}loss_max_clamp=0.3"], [], {}),
    ("topk-task-rewards", "forward_kl_topk",
     [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.7", f"{DL}use_policy_gradient=False",
      f"{DL}log_prob_min_clamp=-10.0"],
     [f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}entropy_coeff=0.01", f"{P}use_kl_loss=True"], {}),
    ("topk-policy-gradient", "forward_kl_topk",
     [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=True", f"{DL}log_prob_min_clamp=-9.0"],
     [f"{P}loss_agg_mode=token-sum"], {"micro_batch_size_per_gpu": 3}),
    ("topk-dynamic-bsz", "forward_kl_topk",
     [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=2.0", f"{DL}use_policy_gradient=False",
      f"{DL}loss_max_clamp=0.2"], [f"{P}loss_agg_mode=seq-mean-token-sum-norm"],
     {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ("k3-task-rewards", "k3",
     [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.5", f"{DL}use_policy_gradient=False",
      f"{DL}loss_max_clamp=0.8"], [f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01"], {}),
    ("k1-policy-gradient", "k1", [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=True"], [], {}),
]


@pytest.mark.parametrize("name, mode, dsettings, settings, engine", CASES, ids=[c[0] for c in CASES])
def test_distillation_matches_verl_megatron_update(model_dir, actors, name, mode, dsettings, settings, engine):
    plain, fused = actors
    gen = torch.Generator().manual_seed(31 + len(name))
    tensors, meta = teacher_batch(gen, model_dir, topk=mode == "forward_kl_topk")
    overrides = enabled(model_dir, mode, *dsettings) + settings
    entropy = any("entropy_coeff" in s for s in settings)
    want = run(plain, tensors, meta, overrides, fused=False, calculate_entropy=entropy, engine=engine)
    got = run(fused, tensors, meta, overrides, fused=True, strict=True, calculate_entropy=entropy, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("hook", "verl.distillation", ""), rec
    ve.check_distillation_case(want[0], mode, dsettings)
    assert_same_update(plain.initial, got, want)


def test_log_prob_min_clamp_binds_on_both_sides(model_dir):
    """The clamp cases clamp: some teacher log-prob and some student log-prob at the teacher's ids lie below
    -9 (verl's Megatron path then sums the masses after the clamp, which logitless follows there)."""
    assert ve.clamp_binds(model_dir, 31 + len("topk-policy-gradient"), -9.0) == (True, True)


def test_without_fused_kernels_runs_verls_loss_recorded(model_dir, actors):
    """On the actor without fused kernels the model builds the logits: verl's own distillation loss runs, recorded
    as unfused; strict mode raises naming use_fused_kernels."""
    plain, _ = actors
    gen = torch.Generator().manual_seed(3)
    tensors, meta = teacher_batch(gen, model_dir, topk=True)
    overrides = enabled(model_dir, "forward_kl_topk", f"{DL}use_task_rewards=False")
    with pytest.raises(FusedPathUnavailable, match="use_fused_kernels=False"):
        run(plain, tensors, meta, overrides, fused=True, strict=True)
    want = run(plain, tensors, meta, overrides, fused=False)
    got = run(plain, tensors, meta, overrides, fused=True)
    rec = lv.last_path()
    assert (rec.path, rec.entry) == ("unfused", "verl.distillation") and "use_fused_kernels" in rec.reason
    assert_same_update(plain.initial, got, want)


@pytest.mark.parametrize("setting, named", [
    ("legacy", "legacy fused forward"),
    ("context_parallel", "context_parallel_size=2 with tensor_model_parallel_size=2 and top-k distillation"),
    ("no_teacher_ids", "the micro-batch has no nested teacher_ids")])
def test_topk_setting_not_wired_is_refused_by_name(model_dir, actors, monkeypatch, setting, named):
    """A top-k setting the fused path does not run (verl's legacy fused-forward mode on a release with the hook,
    which logitless' legacy patch does not serve; context parallelism 2 with TP 2, their sizes reported so to the
    refusal; a batch without the teacher's top-k ids) is refused before the model runs, naming it, strict mode or
    not: verl's own fused forward has no top-k outputs to fall back on."""
    from megatron.core import parallel_state
    from verl.utils.megatron_utils import unwrap_model
    _, fused = actors
    gen = torch.Generator().manual_seed(4)
    tensors, meta = teacher_batch(gen, model_dir, topk=True)
    overrides = enabled(model_dir, "forward_kl_topk", f"{DL}use_task_rewards=False")
    model = unwrap_model(fused.worker.engine.module[0])
    if setting == "legacy":
        monkeypatch.setattr(model, "_verl_fused_forward_mode", "legacy")
    elif setting == "no_teacher_ids":
        del tensors["teacher_ids"]
    else:
        monkeypatch.setattr(parallel_state, "get_context_parallel_world_size", lambda: 2)
        monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: 0)
    cfg = fused.worker.engine.engine_config            # a frozen dataclass: set past its check, put back
    tp = cfg.tensor_model_parallel_size
    if setting == "context_parallel":
        object.__setattr__(cfg, "tensor_model_parallel_size", 2)
    try:
        with pytest.raises(FusedPathUnavailable, match=named):
            run(fused, tensors, meta, overrides, fused=True)
    finally:
        object.__setattr__(cfg, "tensor_model_parallel_size", tp)


def test_untied_head_matches_verl_megatron_update(tmp_path):
    """An untied output layer (the processor's output_weight is None: the divergence from output_layer.weight),
    forward_kl_topk with task rewards and a clamp, against verl's logits path."""
    ve.save_tiny_qwen2(str(tmp_path), seed=4, tied=False)
    plain = vme.Actor(str(tmp_path), THD)
    fused = vme.Actor(str(tmp_path), [*THD, "actor_rollout_ref.model.use_fused_kernels=True"])
    assert not fused.worker.engine.share_embeddings_and_output_weights
    gen = torch.Generator().manual_seed(17)
    tensors, meta = teacher_batch(gen, str(tmp_path), topk=True)
    dsettings = [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.3", f"{DL}use_policy_gradient=False",
                 f"{DL}log_prob_min_clamp=-8.0", f"{DL}loss_max_clamp=0.5"]
    overrides = enabled(str(tmp_path), "forward_kl_topk", *dsettings) + [f"{P}loss_agg_mode=token-sum"]
    want = run(plain, tensors, meta, overrides, fused=False)
    got = run(fused, tensors, meta, overrides, fused=True, strict=True)
    assert (lv.last_path().path, lv.last_path().entry) == ("hook", "verl.distillation")
    ve.check_distillation_case(want[0], "forward_kl_topk", dsettings)
    assert_same_update(plain.initial, got, want)
