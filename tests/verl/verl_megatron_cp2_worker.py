"""One rank of the two-process check of the fused loss on verl's Megatron engine under context parallelism 2
(gloo, CPU, TP 1; verl_megatron_engine.py with mcore_env's CPU context-parallel attention): per case, verl's
unfused Megatron actor and the fused-kernel actor with ``install(fused_loss=True)`` make one update on the same
batch (verl's ``ppo_loss``, or its ``distillation_ppo_loss``); this rank's parameters after the step and (rank 0,
verl's source rank) the metrics must agree. A loss the fused path does not run under CP (sequence-coupled) raises
under strict mode, naming the setting, and otherwise runs verl's own loss, recorded. Writes {case: [ok, message]}
through tests/ranks.py.

``run(rank, init_file, tmp_dir, out_dir)`` is spawned on two ranks by test_verl_megatron_fused_loss.py
(tests/ranks.py's ``spawn``).
"""
from functools import partial

from verl_megatron_ranks import K3_TASK, TOPK_CLAMPS, TOPK_TASK, assert_hook, fused_update, run_rank, verl_update

P = "actor_rollout_ref.actor."
MB3 = {"micro_batch_size_per_gpu": 3}
DYN = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}
# (case, loss settings (actor overrides, or verl's distillation as (mode, settings)), engine settings,
# rollout_is_weights, the refusal named under strict mode or None)
SETTINGS = (
    ("cp2-vanilla-token-mean", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01",
                                f"{P}clip_ratio_c=1.2"], {}, False, None),
    ("cp2-cispo-token-sum", [f"{P}policy_loss.loss_mode=cispo", f"{P}loss_agg_mode=token-sum",
                             f"{P}use_kl_loss=True", f"{P}kl_loss_type=mse", f"{P}kl_loss_coef=0.1",
                             f"{P}entropy_coeff=-0.02", f"{P}clip_ratio_low=0.1", f"{P}clip_ratio_high=0.2"],
     MB3, True, None),
    ("cp2-dppo-tv-seq-mean-token-sum-norm", [f"{P}policy_loss.loss_mode=dppo_tv",
                                             f"{P}loss_agg_mode=seq-mean-token-sum-norm", f"{P}loss_scale_factor=5",
                                             f"{P}clip_ratio_low=0.05", f"{P}clip_ratio_high=0.08",
                                             f"{P}entropy_coeff=0.02"], DYN, False, None),
    ("cp2-gpg-seq-mean-token-sum", [f"{P}policy_loss.loss_mode=gpg", f"{P}loss_agg_mode=seq-mean-token-sum",
                                    f"{P}use_kl_loss=True", f"{P}kl_loss_type=kl"], {}, True, None),
    ("cp2-dro-token-mean", [f"{P}policy_loss.loss_mode=dro", f"{P}policy_loss.dro_beta=0.3", f"{P}use_kl_loss=True",
                            f"{P}kl_loss_type=abs", f"{P}entropy_coeff=0.02"], MB3, False, None),
    ("cp2-bypass-token-sum", [f"{P}policy_loss.loss_mode=bypass_mode", f"{P}loss_agg_mode=token-sum",
                              f"{P}clip_ratio=0.2", f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.02"], {}, True, None),
    ("cp2-gspo-refused", [f"{P}policy_loss.loss_mode=gspo", f"{P}loss_agg_mode=seq-mean-token-mean",
                          f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"], {}, False,
     "loss_mode='gspo' under context parallelism"),
    ("cp2-seq-mean-token-mean-refused", [f"{P}loss_agg_mode=seq-mean-token-mean"], {}, False,
     "loss_agg_mode='seq-mean-token-mean' under context parallelism"),
    # verl's distillation (verl_megatron_ranks' cases): each rank's divergence on its zigzag rows, verl's loss on
    # the gathered ones
    ("cp2-distill-topk-clamps", TOPK_CLAMPS, {}, False, None),
    ("cp2-distill-topk-task-rewards", TOPK_TASK, DYN, True, None),
    ("cp2-distill-k3-task-rewards", K3_TASK, MB3, False, None),
)
CASES = [c[0] for c in SETTINGS]


CP = ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.megatron.context_parallel_size=2"]


def prepare(r) -> None:
    tf = r.actors(CP)[1].worker.engine.tf_config
    assert tf.context_parallel_size == 2 and tf.tensor_model_parallel_size == 1, tf


def check(r, case, seed, loss, engine, is_weights, refused) -> None:
    import verl_megatron_engine as vme

    import logitless.verl as lv
    plain, fused = r.actors(CP)

    def batch():                # each update on a batch of its own, the same on both ranks and in each update
        return r.batch(seed, loss, is_weights=is_weights)
    tensors, meta, overrides, entry, exercised = batch()
    want = verl_update(plain, tensors, meta, overrides, engine)
    if want[0] is not None:
        exercised(want[0])
    if refused is not None:
        try:
            fused_update(fused, *batch()[:3], engine)
            raise AssertionError("strict mode did not refuse the loss under context parallelism")
        except lv.FusedPathUnavailable as exc:
            assert refused in str(exc), exc
        got, rec = fused_update(fused, *batch()[:3], engine, strict=False)
        assert rec.path == "unfused" and refused in rec.reason, rec
    else:
        got, rec = fused_update(fused, *batch()[:3], engine)
        assert_hook(rec, entry)
    assert (want[0] is not None) == (r.rank == 0), "metrics expected on verl's source rank only"
    vme.assert_same_update(plain.initial, got, want)
    if case.startswith("cp2-vanilla") and r.rank == 0:
        assert max(want[0]["actor/pg_clipfrac_lower"]) > 0, "dual clip never active"


def run(rank: int, init_file: str, tmp_dir: str, out_dir: str) -> None:
    run_rank(rank, init_file, tmp_dir, out_dir,
             [(case, partial(check, case=case, seed=31 + i, loss=loss, engine=engine, is_weights=is_weights,
                             refused=refused))
              for i, (case, loss, engine, is_weights, refused) in enumerate(SETTINGS)], prepare=prepare)
