"""One rank of the two-process check of the fused loss on verl's Megatron engine (gloo, CPU, tensor parallelism
2): per case, verl's unfused Megatron actor and the fused-kernel actor with ``install(fused_loss=True)`` make one
update on the same batch (with verl's ``ppo_loss``, or with its ``distillation_ppo_loss`` on a batch carrying the
teacher's top-k / log-probs); this rank's parameter shards after the step and (rank 0, verl's source rank) the
metrics must agree. Writes {case: [ok, message]} through tests/ranks.py.

``run(rank, init_file, tmp_dir, out_dir)`` is spawned on two ranks by test_verl_megatron_fused_loss.py
(tests/ranks.py's ``spawn``).
"""
import os
import traceback

P = "actor_rollout_ref.actor."
NOSP = ["+actor_rollout_ref.actor.megatron.override_transformer_config.sequence_parallel=False"]
SP = []        # mbridge turns sequence parallelism on at TP > 1
TOKEN_MEAN = [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01", f"{P}clip_ratio_c=1.2"]
GSPO = [f"{P}policy_loss.loss_mode=gspo", f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True",
        f"{P}kl_loss_type=mse", f"{P}entropy_coeff=-0.02", f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"]
GEO_MEAN = [f"{P}policy_loss.loss_mode=geo_mean", f"{P}loss_agg_mode=token-mean", f"{P}use_kl_loss=True",
            f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.02", f"{P}clip_ratio_low=0.1",
            f"{P}clip_ratio_high=0.15"]
DL = "distillation.distillation_loss."
# verl's distillation (verl_engine.distillation_enabled with this mode and these settings): forward_kl_topk with
# both clamps, forward_kl_topk with task rewards (policy loss, KL loss, entropy bonus), k3 with task rewards
TOPK_CLAMPS = ("forward_kl_topk", [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=False",
                                   f"{DL}log_prob_min_clamp=-9.0", f"{DL}loss_max_clamp=0.3"])
TOPK_TASK = ("forward_kl_topk", [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.7",
                                 f"{DL}use_policy_gradient=False", f"{DL}log_prob_min_clamp=-10.0",
                                 f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True",
                                 f"{P}entropy_coeff=0.01"])
K3_TASK = ("k3", [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.5", f"{DL}use_policy_gradient=False",
                  f"{DL}loss_max_clamp=0.8", f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01"])
# (case, engine settings, loss settings: actor overrides, or (distillation mode, settings))
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


def run(rank: int, init_file: str, tmp_dir: str, out_dir: str) -> None:
    import torch
    torch.set_num_threads(1)
    import verl_engine as ve
    ve.stub_server_modules()
    import verl_megatron_engine as vme

    import logitless.verl as lv
    from ranks import finish
    results = {}
    try:
        vme.setup(rank, 2, init_file)
        ve.VOCAB = VOCAB
        model_dir = os.path.join(tmp_dir, "qwen2")
        if rank == 0:                  # transformers saves on the main process only
            ve.save_tiny_qwen2(model_dir, seed=3, tied=True)
        torch.distributed.barrier()
    except Exception:  # noqa: BLE001 - reported to the parent test
        results["setup"] = [False, traceback.format_exc()[-3000:]]
        finish(results, out_dir, rank)
        return
    thd = ["actor_rollout_ref.model.use_remove_padding=True",
           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    fused_kernels = "actor_rollout_ref.model.use_fused_kernels=True"
    built = {}
    try:
        for case, engine, loss in SETTINGS:
            try:
                key = tuple(engine)
                if key not in built:
                    built[key] = (vme.Actor(model_dir, [*thd, *engine]),
                                  vme.Actor(model_dir, [*thd, *engine, fused_kernels]))
                plain, fused = built[key]
                gen = torch.Generator().manual_seed(31)            # the same batch on both ranks
                tensors, meta, loss, entry, check = ve.case_batch(gen, model_dir, loss)
                want = plain.update(tensors, meta, loss, calculate_entropy=True, mini_batch_size=6)
                lv.install(fused_loss=True, strict=True)
                try:
                    got = fused.update(tensors, meta, loss, calculate_entropy=True, mini_batch_size=6)
                    rec = lv.last_path()
                finally:
                    lv.uninstall()
                assert (rec.path, rec.entry, rec.reason) == ("hook", entry, ""), rec
                if want[0] is not None:
                    check(want[0])
                tf = fused.worker.engine.tf_config
                assert tf.tensor_model_parallel_size == 2 and tf.sequence_parallel == (engine is SP), tf
                assert (want[0] is not None) == (rank == 0), "metrics expected on verl's source rank only"
                vme.assert_same_update(plain.initial, got, want)
                results[case] = [True, ""]
            except Exception:  # noqa: BLE001 - recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
        vme.teardown()
    finally:
        finish(results, out_dir, rank)
