"""``logitless.verl.install(fused_loss=True)`` on verl 0.9.1's distillation (``distillation.enabled``): the actor's
real update (``TrainingWorker.train_mini_batch`` -> ``FSDPEngineWithLMHead``, FSDP2 on a 1-rank gloo group, see
verl_engine.py) with verl's ``distillation_ppo_loss``, on the same batch and from the same parameters as verl's own
update from the model's logits (an actor without fused kernels, logitless not installed): parameters after one
SGD step, every metric verl logs (the distillation/* ones included), and ``last_path()``.

The teacher's top-k is what verl's teacher workers hand the actor: per position of each padded sequence, the
k ids and log-probs of a teacher's next-token distribution (here the student model's own logits plus noise, so
the teacher's and the student's top-k partly overlap), converted by verl's ``left_right_2_no_padding``."""
import pytest
import torch
import verl_engine as ve
from verl_engine import run

from required import import_or_skip

ve.stub_server_modules()
import_or_skip("verl.workers.engine_workers", "make setup installs verl (--no-deps) and its import deps")

from test_verl_fused_loss import assert_same_update  # noqa: E402

import logitless.verl as lv  # noqa: E402
from logitless.verl import FusedPathUnavailable  # noqa: E402

DL = ve.DL
P = ve.P
teacher_batch, enabled = ve.teacher_batch, ve.distillation_enabled


@pytest.fixture(scope="module")
def actors(model_dir):
    """(verl's actor without fused kernels: the logits path, the one verl's top-k distillation runs on; an actor
    with verl's fused kernels, backend "torch", the one logitless runs on)."""
    return ve.Actor(model_dir), ve.Actor(model_dir, ["actor_rollout_ref.model.use_fused_kernels=True"])


pytestmark = pytest.mark.usefixtures("uninstalled")      # tests/verl/conftest.py


# (name, loss mode, distillation settings, actor settings, engine settings)
CASES = [
    ("topk-only-clamps", "forward_kl_topk",
     [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=False", f"{DL}log_prob_min_clamp=-12.0",
      f"{DL}loss_max_clamp=0.3"], [], {"use_remove_padding": True}),
    ("topk-task-rewards", "forward_kl_topk",
     [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.7", f"{DL}use_policy_gradient=False"],
     [f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}entropy_coeff=0.01", f"{P}use_kl_loss=True"],
     {"use_remove_padding": False}),
    ("topk-policy-gradient", "forward_kl_topk",
     [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=True", f"{DL}log_prob_min_clamp=-9.0"],
     [f"{P}loss_agg_mode=token-sum"], {"use_remove_padding": True, "micro_batch_size_per_gpu": 3}),
    ("topk-dynamic-bsz", "forward_kl_topk",
     [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=2.0", f"{DL}use_policy_gradient=False",
      f"{DL}loss_max_clamp=0.2"], [f"{P}loss_agg_mode=seq-mean-token-sum-norm"],
     {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ("k3-task-rewards", "k3",
     [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.5", f"{DL}use_policy_gradient=False",
      f"{DL}loss_max_clamp=0.8"], [f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01"], {"use_remove_padding": True}),
    ("k1-policy-gradient", "k1", [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=True"], [],
     {"use_remove_padding": False}),
]


@pytest.mark.parametrize("name, mode, dsettings, settings, engine", CASES, ids=[c[0] for c in CASES])
def test_distillation_matches_verl_update(model_dir, actors, name, mode, dsettings, settings, engine):
    plain, fused = actors
    topk = mode == "forward_kl_topk"
    gen = torch.Generator().manual_seed(31 + len(name))
    tensors, meta = teacher_batch(gen, model_dir, topk=topk)
    overrides = enabled(model_dir, mode, *dsettings) + settings
    entropy = any("entropy_coeff" in s for s in settings)
    want = run(plain, tensors, meta, overrides, fused=False, calculate_entropy=entropy, engine=engine)
    got = run(fused, tensors, meta, overrides, fused=True, strict=True, calculate_entropy=entropy, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.distillation", ""), rec
    m = want[0]
    if topk:
        for key in ("distillation/student_mass", "distillation/teacher_mass", "distillation/overlap_ratio",
                    "distillation/overlap_token_advantage", "distillation/loss_min", "distillation/loss_max"):
            assert key in m, key
        assert 0 < m["distillation/overlap_ratio"][0] < 1, "the top-k sets never (or always) overlap"
    clamp = next((float(s.split("=")[1]) for s in dsettings if "loss_max_clamp" in s), None)
    if clamp is not None:
        assert max(m["distillation/loss_max"]) > clamp, "loss_max_clamp never binds: the case tests nothing"
    assert_same_update(fused, got, want)


def test_log_prob_min_clamp_binds(model_dir, actors):
    """The clamp case above clamps: some student log-prob at the teacher's ids lies below it."""
    _, fused = actors
    assert ve.clamp_binds(model_dir, 31 + len("topk-only-clamps"), -12.0) == (True, True)


def test_unfused_distillation_is_refused_under_strict(model_dir, actors):
    """On the actor without fused kernels the model builds the logits: verl's own distillation loss runs,
    recorded as unfused; strict mode raises naming use_fused_kernels."""
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
    assert_same_update(plain, got, want)
