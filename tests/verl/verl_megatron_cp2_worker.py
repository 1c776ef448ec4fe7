"""One rank of the two-process check of the fused loss on verl's Megatron engine under context parallelism 2
(gloo, CPU): per case, verl's unfused Megatron actor and the fused-kernel actor with ``install(fused_loss=True)``
make one update on the same batch; this rank's parameters after the step and (rank 0, verl's source rank) the
metrics must agree. Writes {case: [ok, message]} through tests/ranks.py.

``run(rank, init_file, tmp_dir, out_dir)`` is spawned on two ranks by test_verl_megatron_fused_loss.py
(tests/ranks.py's ``spawn``).
"""
import os
import traceback

P = "actor_rollout_ref.actor."
# (case, loss settings)
SETTINGS = (
    ("cp2-token-mean", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01",
                        f"{P}clip_ratio_c=1.2"]),
)
CASES = [c[0] for c in SETTINGS]


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
        model_dir = os.path.join(tmp_dir, "qwen2")
        if rank == 0:                  # transformers saves on the main process only
            ve.save_tiny_qwen2(model_dir, seed=3, tied=True)
        torch.distributed.barrier()
    except Exception:  # noqa: BLE001 - reported to the parent test
        results["setup"] = [False, traceback.format_exc()[-3000:]]
        finish(results, out_dir, rank)
        return
    thd = ["actor_rollout_ref.model.use_remove_padding=True",
           "actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    fused_kernels = "actor_rollout_ref.model.use_fused_kernels=True"
    try:
        plain = vme.Actor(model_dir, thd)
        fused = vme.Actor(model_dir, [*thd, fused_kernels])
        for case, loss in SETTINGS:
            try:
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
                assert tf.context_parallel_size == 2, tf
                vme.assert_same_update(plain.initial, got, want)
                results[case] = [True, ""]
            except Exception:  # noqa: BLE001 - recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
        vme.teardown()
    except Exception:  # noqa: BLE001
        results["build"] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
