"""One rank of the two-process check of the fused loss on verl's Megatron engine under pipeline parallelism 2 (gloo,
CPU), with and without 2 virtual stages per rank (a 4-layer tiny Qwen2): per case, verl's unfused Megatron actor
and the fused-kernel actor with ``install(fused_loss=True)`` make one update on the same batch (verl's ``ppo_loss``,
or its ``distillation_ppo_loss``) through Megatron's pipeline schedule (1F1B, or interleaved); this rank's
parameters after the step (its own stages' layers; the embedding on the first stage, the output layer on the last)
and (the last stage, verl's source rank) the metrics must agree. Writes {case: [ok, message]} through tests/ranks.py.

What the pipeline needs on CPU is in verl_megatron_engine.py's set-up already (test-side only): megatron-core's
p2p communication calls ``torch.cuda.synchronize()`` after gloo's ``batch_isend_irecv`` (for the shapes, which
verl's variable sequence lengths send every time, unconditionally), a no-op under ``mcore_env.cpu_streams``;
the schedules' ``device="cuda"`` token counters go to the CPU through ``mcore_env.CudaOnCpu``. gloo runs the
batched isend / irecv themselves.

``run(rank, init_file, tmp_dir, out_dir)`` is spawned on two ranks by test_verl_megatron_fused_loss.py
(tests/ranks.py's ``spawn``).
"""
from functools import partial

from verl_megatron_ranks import TOPK_CLAMPS, TOPK_TASK, assert_hook, fused_update, run_rank, verl_update

P = "actor_rollout_ref.actor."
M = "actor_rollout_ref.actor.megatron."
PIPE = [f"{M}pipeline_model_parallel_size=2"]
VIRTUAL = [f"{M}virtual_pipeline_model_parallel_size=2"]
TOKEN_MEAN = [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01", f"{P}clip_ratio_c=1.2"]
GSPO = [f"{P}policy_loss.loss_mode=gspo", f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True",
        f"{P}kl_loss_type=mse", f"{P}entropy_coeff=-0.02", f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03"]
SAPO = [f"{P}policy_loss.loss_mode=sapo", f"{P}loss_agg_mode=seq-mean-token-sum", f"{P}use_kl_loss=True",
        f"{P}kl_loss_type=kl", f"{P}entropy_coeff=0.02", f"{P}tau_pos=1.3", f"{P}tau_neg=0.8"]
# (case, engine settings, loss settings (actor overrides, or verl's distillation as (mode, settings)), micro-batch
# settings)
SETTINGS = (
    ("pp2-token-mean", PIPE, TOKEN_MEAN, None),
    ("pp2-gspo-seq-mean-dynamic", PIPE, GSPO, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    # verl's interleaved schedule takes a number of micro-batches divisible by the pipeline size: 6 sequences in 2
    ("pp2-vp2-token-mean", PIPE + VIRTUAL, TOKEN_MEAN, {"micro_batch_size_per_gpu": 3}),
    ("pp2-vp2-sapo-seq-mean-token-sum", PIPE + VIRTUAL, SAPO, {"micro_batch_size_per_gpu": 3}),
    # verl's distillation (verl_megatron_ranks' cases): the divergence on the last stage
    ("pp2-distill-topk-task-rewards", PIPE, TOPK_TASK, None),
    ("pp2-vp2-distill-topk-clamps", PIPE + VIRTUAL, TOPK_CLAMPS, {"micro_batch_size_per_gpu": 3}),
)
CASES = [c[0] for c in SETTINGS]


THD = ["actor_rollout_ref.model.use_remove_padding=True"]


def check(r, engine, loss, micro) -> None:
    import verl_megatron_engine as vme
    plain, fused = r.actors([*THD, *engine], one_layout=True)
    tensors, meta, overrides, entry, exercised = r.batch(31, loss)
    want = verl_update(plain, tensors, meta, overrides, micro)
    got, rec = fused_update(fused, tensors, meta, overrides, micro)
    tf = fused.worker.engine.tf_config
    assert tf.pipeline_model_parallel_size == 2, tf
    assert len(fused.worker.engine.module) == (2 if VIRTUAL[0] in engine else 1)
    if r.rank == 1:          # the last stage ran the processor
        assert_hook(rec, entry)
        exercised(want[0])
    assert (want[0] is not None) == (r.rank == 1), "metrics expected on the last stage only"
    vme.assert_same_update(plain.initial, got, want)


def run(rank: int, init_file: str, tmp_dir: str, out_dir: str) -> None:
    run_rank(rank, init_file, tmp_dir, out_dir, [(case, partial(check, engine=engine, loss=loss, micro=micro))
                                                 for case, engine, loss, micro in SETTINGS], layers=4)
