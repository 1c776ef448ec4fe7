"""``install(fused_loss=True)`` under verl's Ulysses sequence parallelism: the FSDP engine with
``ulysses_sequence_parallel_size=2`` on two gloo ranks (CPU), its real ``train_mini_batch`` with verl's loss
against the fused loss on the same engine and batch (verl_ulysses.py; its CPU attention does verl's Ulysses
all-to-alls around an exact attention, since verl's own Ulysses attention is a patch of flash-attention). The
engine's unfused update is also held to the single-rank engine's (no sequence parallelism) on the same batch,
so the harness is checked too."""
import math

import pytest
import torch
import verl_engine as ve

from ranks import check, spawn
from required import import_or_skip

ve.stub_server_modules()
import_or_skip("verl.workers.engine_workers", "make setup installs verl (--no-deps) and its import deps")
import verl_ulysses  # noqa: E402

P = "actor_rollout_ref.actor."
PACKED = {"use_remove_padding": True}
# (name, actor overrides, engine settings, seed): sequences split across the two ranks in every case
CASES = [
    ("vanilla", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.02",
                 f"{P}clip_ratio_c=1.2"], PACKED, 71),
    ("gspo", [f"{P}policy_loss.loss_mode=gspo", f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03",
              f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True", f"{P}kl_loss_type=mse",
              f"{P}entropy_coeff=0.01"], {**PACKED, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}, 72),
    ("geo_mean", [f"{P}policy_loss.loss_mode=geo_mean", f"{P}loss_agg_mode=seq-mean-token-sum",
                  f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.02"], {**PACKED, "micro_batch_size_per_gpu": 3}, 73),
    ("kl_cov", [f"{P}policy_loss.loss_mode=kl_cov", f"{P}policy_loss.kl_cov_ratio=0.2",
                f"{P}policy_loss.ppo_kl_coef=0.5", f"{P}loss_agg_mode=token-sum", f"{P}entropy_coeff=0.02"],
     PACKED, 74),
    ("untied-token-mean", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl+", f"{P}entropy_coeff=-0.02"],
     PACKED, 76),
    ("fsdp1-seq-mean-token-mean", [f"{P}policy_loss.loss_mode=cispo", f"{P}clip_ratio_low=0.1",
                                   f"{P}clip_ratio_high=0.2", f"{P}loss_agg_mode=seq-mean-token-mean",
                                   f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.02", *verl_ulysses.FSDP1],
     PACKED, 77),
    ("distill-topk-only", [f"{ve.DL}use_task_rewards=False", f"{ve.DL}use_policy_gradient=False",
                           f"{ve.DL}log_prob_min_clamp=-12.0", f"{ve.DL}loss_max_clamp=0.3"], PACKED, 78),
    ("distill-topk-task-rewards", [f"{ve.DL}use_task_rewards=True", f"{ve.DL}distillation_loss_coef=0.7",
                                   f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}entropy_coeff=0.01"],
     {**PACKED, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}, 79),
    ("triton-seq-mean-token-sum-norm", [f"{P}loss_agg_mode=seq-mean-token-sum-norm", f"{P}use_kl_loss=True",
                                        f"{P}kl_loss_type=abs", f"{P}entropy_coeff=0.02"], PACKED, 75),
]
PARAM_TOL, STEP_TOL, METRIC_TOL = 1e-4, 1e-4, 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_ulysses")
    ve.save_tiny_qwen2(str(tmp), seed=3, tied=True)
    ve.save_tiny_qwen2(str(tmp / "untied"), seed=4, tied=False)
    return tmp, spawn(verl_ulysses.run, (str(tmp / "store"), str(tmp), CASES, str(tmp)), 2, str(tmp))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ulysses_fused_matches_verl_update(runs, case):
    tmp, results = runs
    name = case[0]
    check(results, name)
    for rank, res in enumerate(results):
        out = res[name][1]
        entry = "verl.distillation" if name.startswith("distill") else "verl.policy_loss"
        assert out["record"][:3] == ["fsdp", entry, ""], out["record"]
        assert out["forward"] == ("forward_with_triton_backend" if name.startswith("triton")
                                  else "forward_with_torch_backend"), out["forward"]
        if name.startswith("untied"):
            assert "lm_head.weight" in out["params"]
        assert (out["module"] == "FullyShardedDataParallel") == name.startswith("fsdp1"), out["module"]
        params = out["params"]
        step_norm = math.sqrt(sum(p["step"] ** 2 for p in params.values()))
        assert step_norm > 1e-3
        for n, p in params.items():
            assert p["diff"] <= PARAM_TOL * p["norm"] + 1e-12, (rank, n, p)
            assert p["step_diff"] <= STEP_TOL * step_norm, (rank, n, p)
    got, want = results[0][name][1]["got"], results[0][name][1]["want"]     # rank 0 collects the metrics
    assert set(want) <= set(got), set(want) - set(got)
    for key, w in want.items():
        if key.startswith(("perf/", "mfu")):
            continue
        tol = STEP_TOL if key == "grad_norm" else 3e-5 if key == "actor/entropy_loss" else METRIC_TOL
        for g, x in zip(got[key], w, strict=True):
            assert abs(g - x) <= tol * max(1.0, abs(x)), (key, g, x)


def test_ulysses_engine_matches_single_rank(runs):
    """The harness: verl's sp=2 update (unfused) equals verl's single-rank update on the same batch."""
    tmp, _ = runs
    name, overrides, engine, seed = CASES[0]
    actor = ve.Actor(str(tmp), ["actor_rollout_ref.model.use_fused_kernels=True"])
    gen = torch.Generator().manual_seed(seed)
    tensors, meta = ve.rollout_batch(gen, str(tmp), is_weights=True)
    _, single = actor.update(tensors, meta, overrides, calculate_entropy=True, mini_batch_size=6, engine=engine)
    sp2 = torch.load(tmp / f"{name}.pt")
    assert sorted(sp2) == sorted(single)
    moved = max(float((single[n] - p0).norm()) for n, p0 in zip(single, actor.initial_full(), strict=True))
    assert moved > 1e-3
    for n, p in single.items():
        assert float((sp2[n] - p).norm()) <= 1e-5 * float(p.norm()) + 1e-12, n


def test_empty_rank_falls_back():
    """A packed micro-batch too short for every sp rank to hold a token: named (make_plan falls back)."""
    from logitless.verl import ulysses
    assert ulysses.empty_rank(6, 2) is None and ulysses.empty_rank(2, 2) is None
    assert ulysses.empty_rank(7, 4) is None                 # slices of 2: the last holds token 7
    assert "6 packed tokens" in ulysses.empty_rank(6, 4)    # slices of 2: the last is padding only
    assert ulysses.empty_rank(1, 2) is not None
    assert "padded to 16" in ulysses.empty_rank(7, 2, bucket_pad=9)    # slices of 8: the second is padding
    assert ulysses.empty_rank(9, 2, bucket_pad=7) is None
