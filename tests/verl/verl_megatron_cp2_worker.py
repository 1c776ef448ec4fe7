"""One rank of the two-process check of the fused loss on verl's Megatron engine under context parallelism 2
(gloo, CPU, TP 1; verl_megatron_engine.py with mcore_env's CPU context-parallel attention): per case, verl's
unfused Megatron actor and the fused-kernel actor with ``install(fused_loss=True)`` make one update on the same
batch (verl's ``ppo_loss``, or its ``distillation_ppo_loss``); this rank's parameters after the step and (rank 0,
verl's source rank) the metrics must agree. A loss
the fused path does not run under CP (sequence-coupled) raises under strict mode, naming the setting, and
otherwise runs verl's own loss, recorded. Writes {case: [ok, message]} through tests/ranks.py.

``run(rank, init_file, tmp_dir, out_dir)`` is spawned on two ranks by test_verl_megatron_fused_loss.py
(tests/ranks.py's ``spawn``).
"""
import os
import traceback

from verl_megatron_tp2_worker import K3_TASK, TOPK_CLAMPS, TOPK_TASK

P = "actor_rollout_ref.actor."
MB3 = {"micro_batch_size_per_gpu": 3}
DYN = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}
# (case, loss settings, engine settings, rollout_is_weights, the refusal named under strict mode or None)
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
    # verl's distillation (verl_megatron_tp2_worker's cases): each rank's divergence on its zigzag rows, verl's loss
    # on the gathered ones
    ("cp2-distill-topk-clamps", TOPK_CLAMPS, {}, False, None),
    ("cp2-distill-topk-task-rewards", TOPK_TASK, DYN, True, None),
    ("cp2-distill-k3-task-rewards", K3_TASK, MB3, False, None),
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
        cp = ["actor_rollout_ref.model.use_remove_padding=True",
              "actor_rollout_ref.actor.megatron.context_parallel_size=2"]
        plain = vme.Actor(model_dir, cp)
        fused = vme.Actor(model_dir, [*cp, "actor_rollout_ref.model.use_fused_kernels=True"])
        tf = fused.worker.engine.tf_config
        assert tf.context_parallel_size == 2 and tf.tensor_model_parallel_size == 1, tf
    except Exception:  # noqa: BLE001 - reported to the parent test
        results["setup"] = [False, traceback.format_exc()[-3000:]]
        finish(results, out_dir, rank)
        return

    def update(actor, gen_seed, loss, engine, is_weights, *, install=False, strict=True):
        gen = torch.Generator().manual_seed(gen_seed)            # the same batch on both ranks
        tensors, meta, overrides, entry, check = ve.case_batch(gen, model_dir, loss, is_weights=is_weights)
        if install:
            lv.install(fused_loss=True, strict=strict)
        try:
            out = actor.update(tensors, meta, overrides, calculate_entropy=True, mini_batch_size=6, engine=engine)
        finally:
            lv.uninstall()
        if not install and out[0] is not None:
            check(out[0])
        return out, entry
    try:
        for i, (case, loss, engine, is_weights, refused) in enumerate(SETTINGS):
            try:
                seed = 31 + i
                want, entry = update(plain, seed, loss, engine, is_weights)
                if refused is not None:
                    try:
                        update(fused, seed, loss, engine, is_weights, install=True)
                        raise AssertionError("strict mode did not refuse the loss under context parallelism")
                    except lv.FusedPathUnavailable as exc:
                        assert refused in str(exc), exc
                    got, _ = update(fused, seed, loss, engine, is_weights, install=True, strict=False)
                    rec = lv.last_path()
                    assert rec.path == "unfused" and refused in rec.reason, rec
                else:
                    got, _ = update(fused, seed, loss, engine, is_weights, install=True)
                    rec = lv.last_path()
                    assert (rec.path, rec.entry, rec.reason) == ("hook", entry, ""), rec
                assert (want[0] is not None) == (rank == 0), "metrics expected on verl's source rank only"
                vme.assert_same_update(plain.initial, got, want)
                if case.startswith("cp2-vanilla") and rank == 0:
                    assert max(want[0]["actor/pg_clipfrac_lower"]) > 0, "dual clip never active"
                results[case] = [True, ""]
            except Exception:  # noqa: BLE001 - recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
        vme.teardown()
    finally:
        finish(results, out_dir, rank)
