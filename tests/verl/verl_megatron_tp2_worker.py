"""One rank of the two-process check of the fused loss on verl's Megatron engine (gloo, CPU, tensor parallelism
2): per case, verl's unfused Megatron actor and the fused-kernel actor with ``install(fused_loss=True)`` make one
update on the same batch (with verl's ``ppo_loss``, or with its ``distillation_ppo_loss`` on a batch carrying the
teacher's top-k / log-probs); this rank's parameter shards after the step and (rank 0, verl's source rank) the
metrics must agree. Writes {case: [ok, message]} through tests/ranks.py.

``run(rank, init_file, tmp_dir, out_dir)`` is spawned on two ranks by test_verl_megatron_fused_loss.py
(tests/ranks.py's ``spawn``).
"""
from functools import partial

from verl_megatron_ranks import K3_TASK, TOPK_CLAMPS, TOPK_TASK, assert_hook, fused_update, run_rank, verl_update

P = "actor_rollout_ref.actor."
NOSP = ["+actor_rollout_ref.actor.megatron.override_transformer_config.sequence_parallel=False"]
SP = []        # mbridge turns sequence parallelism on at TP > 1
TOKEN_MEAN = [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01", f"{P}clip_ratio_c=1.2"]
GSPO = [f"{P}policy_loss.loss_mode=gspo", f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True",
        f"{P}kl_loss_type=mse", f"{P}entropy_coeff=-0.02", f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"]
GEO_MEAN = [f"{P}policy_loss.loss_mode=geo_mean", f"{P}loss_agg_mode=token-mean", f"{P}use_kl_loss=True",
            f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.02", f"{P}clip_ratio_low=0.1",
            f"{P}clip_ratio_high=0.15"]
# (case, engine settings, loss settings: actor overrides, or verl's distillation as (mode, settings))
SETTINGS = (
    ("tp2-nosp-token-mean", NOSP, TOKEN_MEAN),
    ("tp2-nosp-gspo-seq-mean", NOSP, GSPO),
    ("tp2-sp-token-mean", SP, TOKEN_MEAN),
    ("tp2-sp-gspo-seq-mean", SP, GSPO),
    ("tp2-sp-geo-mean", SP, GEO_MEAN),
    ("tp2-nosp-distill-topk-clamps", NOSP, TOPK_CLAMPS),
    ("tp2-sp-distill-topk-clamps", SP, TOPK_CLAMPS),
    ("tp2-sp-distill-topk-task-rewards", SP, TOPK_TASK),
    ("tp2-nosp-distill-k3-task-rewards", NOSP, K3_TASK),
)
CASES = [c[0] for c in SETTINGS]
VOCAB = 262            # Megatron splits the vocabulary over the TP ranks (mbridge does not pad it)
THD = ["actor_rollout_ref.model.use_remove_padding=True",
       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]


def check(r, engine, loss) -> None:
    import verl_megatron_engine as vme
    plain, fused = r.actors([*THD, *engine])
    tensors, meta, overrides, entry, exercised = r.batch(31, loss)
    want = verl_update(plain, tensors, meta, overrides)
    got, rec = fused_update(fused, tensors, meta, overrides)
    assert_hook(rec, entry)
    if want[0] is not None:
        exercised(want[0])
    tf = fused.worker.engine.tf_config
    assert tf.tensor_model_parallel_size == 2 and tf.sequence_parallel == (engine is SP), tf
    assert (want[0] is not None) == (r.rank == 0), "metrics expected on verl's source rank only"
    vme.assert_same_update(plain.initial, got, want)


def run(rank: int, init_file: str, tmp_dir: str, out_dir: str) -> None:
    run_rank(rank, init_file, tmp_dir, out_dir, [(case, partial(check, engine=engine, loss=loss))
                                                 for case, engine, loss in SETTINGS], vocab=VOCAB)
