"""One rank of the two-process check of the fused loss on verl's Megatron engine (gloo, CPU, tensor parallelism
2): per case, verl's unfused Megatron actor and the fused-kernel actor with ``install(fused_loss=True)`` make one
update on the same batch; this rank's parameter shards after the step and (rank 0, verl's source rank) the
metrics must agree. Writes {case: [ok, message]} through tests/ranks.py.

    python verl_megatron_tp2_worker.py RANK WORLD INIT_FILE TMP_DIR OUT_DIR
"""
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "megatron")]

P = "actor_rollout_ref.actor."
NOSP = ["+actor_rollout_ref.actor.megatron.override_transformer_config.sequence_parallel=False"]
SP = []        # mbridge turns sequence parallelism on at TP > 1
TOKEN_MEAN = [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01", f"{P}clip_ratio_c=1.2"]
GSPO = [f"{P}policy_loss.loss_mode=gspo", f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True",
        f"{P}kl_loss_type=mse", f"{P}entropy_coeff=-0.02", f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"]
# (case, engine settings, loss settings)
CASES = (
    ("tp2-nosp-token-mean", NOSP, TOKEN_MEAN),
    ("tp2-nosp-gspo-seq-mean", NOSP, GSPO),
    ("tp2-sp-token-mean", SP, TOKEN_MEAN),
    ("tp2-sp-gspo-seq-mean", SP, GSPO),
)
VOCAB = 262            # Megatron splits the vocabulary over the TP ranks (mbridge does not pad it)


def main():
    rank, world, init_file, model_dir, out_dir = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                  sys.argv[5])
    import torch
    torch.set_num_threads(1)
    import verl_engine as ve
    ve.stub_server_modules()
    import verl_megatron_engine as vme

    import logitless.verl as lv
    from ranks import finish
    vme.setup(rank, world, init_file)
    ve.VOCAB = VOCAB
    model_dir = os.path.join(model_dir, "qwen2")
    if rank == 0:                  # transformers saves on the main process only
        ve.save_tiny_qwen2(model_dir, seed=3, tied=True)
    torch.distributed.barrier()
    thd = ["actor_rollout_ref.model.use_remove_padding=True",
           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]
    results = {}
    built = {}
    for case, engine, loss in CASES:
        try:
            key = tuple(engine)
            if key not in built:
                built[key] = (vme.Actor(model_dir, [*thd, *engine]),
                              vme.Actor(model_dir, [*thd, *engine, "actor_rollout_ref.model.use_fused_kernels=True"]))
            plain, fused = built[key]
            gen = torch.Generator().manual_seed(31)            # the same batch on both ranks
            tensors, meta = ve.rollout_batch(gen, model_dir)
            want = plain.update(tensors, meta, loss, calculate_entropy=True, mini_batch_size=6)
            lv.install(fused_loss=True, strict=True)
            try:
                got = fused.update(tensors, meta, loss, calculate_entropy=True, mini_batch_size=6)
                rec = lv.last_path()
            finally:
                lv.uninstall()
            assert (rec.path, rec.entry, rec.reason) == ("hook", "verl.policy_loss", ""), rec
            tf = fused.worker.engine.tf_config
            assert tf.tensor_model_parallel_size == 2 and tf.sequence_parallel == (engine is SP), tf.sequence_parallel
            assert (want[0] is not None) == (rank == 0), "metrics expected on verl's source rank only"
            vme.assert_same_update(plain.initial, got, want)
            results[case] = [True, ""]
        except Exception:  # noqa: BLE001 - reported to the parent test
            results[case] = [False, traceback.format_exc()[-3000:]]
    vme.teardown()
    finish(results, out_dir, rank)


if __name__ == "__main__":
    main()
