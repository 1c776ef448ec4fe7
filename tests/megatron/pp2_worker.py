"""One rank of the two-stage pipeline check (gloo, CPU, PP 2; with and without 2 virtual stages per rank):
logitless.megatron's output processor (log-probs and entropy, and the fused policy loss) on the last stage, run
through megatron-core's own pipeline schedule (``get_forward_backward_func``: 1F1B, or the interleaved schedule
under virtual stages; activations and their gradients sent between the ranks by its p2p communication), against
the same model chunks run through the same schedule with the model's own logits and the loss formed from them in
float64 (tests/policy64.py). Per case: each micro-batch's loss, log-probs and entropy (last stage), and the
gradient of every parameter of this rank's chunks. Writes {case: [ok, message]} through tests/ranks.py.

What CPU needs (test set-up only): mcore_env's two workarounds; ``mcore_env.CudaOnCpu`` while the schedule runs
(megatron-core 0.19.2's schedules count tokens in ``torch.zeros([], dtype=torch.int, device="cuda")``: schedules.py,
the no-pipelining, interleaved and 1F1B functions); and ``batch_p2p_sync=False``: its p2p calls
``torch.cuda.synchronize()`` after ``batch_isend_irecv`` when that flag is on (the default), which a CPU build of
torch cannot run. gloo runs the batched isend / irecv themselves (torch 2.13, checked here by running them).

``run(rank, init_file, seed, out_dir)`` is spawned on two ranks by test_megatron_pp2.py (tests/ranks.spawn).
"""
import traceback

PP = 2
LAYERS = 4
B, S, MICRO = 2, 9, 4
LP_TOL = ENT_TOL = 2e-5
GRAD_TOL = 1e-4
LOSSES = ("logprobs", "policy-token-mean", "policy-seq-mean-token-mean")
CASES = [f"pp2-{v}-{loss}" for v in ("novp", "vp2") for loss in LOSSES]
SPEC = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.02)


def _chunks(env, torch, vpp, seed):
    from megatron.core import parallel_state as ps
    chunks = []
    for vp in range(vpp or 1):
        stage = None if vpp is None else vp
        chunks.append(env.build_gpt(
            layers=LAYERS, seed=seed + 7 * ps.get_pipeline_model_parallel_rank() + vp,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage), vp_stage=stage,
            pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=vpp,
            pipeline_dtype=torch.float32, batch_p2p_sync=False))
    return chunks


def _micro_batches(env, torch, seed, vocab):
    """The same micro-batches on both ranks: ids, labels (a prompt and some padding ignored), per-token
    temperatures, and the policy inputs near the log-probs of a model of this size."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(MICRO):
        ids, pos, labels = env.random_batch(B, S, vocab, gen)
        labels[:, :2] = -100
        labels[1, 7:] = -100
        out.append(dict(ids=ids, pos=pos, labels=labels, temperature=0.6 + torch.rand(B, S, generator=gen),
                        a=torch.randn(B, S, generator=gen), c=torch.randn(B, S, generator=gen),
                        adv=torch.randn(B, 1, generator=gen),
                        old=-4.0 - 2.0 * torch.rand(B, S, generator=gen),
                        ref=-4.0 - 2.0 * torch.rand(B, S, generator=gen)))
    return out


def _run_schedule(env, torch, chunks, batches, fused, loss):
    """One forward and backward of every micro-batch through megatron-core's schedule; returns the last
    stage's per-micro-batch (loss, log-probs, entropy) and this rank's parameter gradients."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from logitless.losses import PolicyLoss
    from logitless.megatron import FusedOutputProcessorContext, fused_output_processor
    from policy64 import aggregate64, term64
    mask = env.causal_mask(S)
    seen = []

    def own_logits(*, hidden_states, output_layer, output_weight, scale_logits=None, **_):
        z, _ = output_layer(hidden_states, weight=output_weight)
        return (scale_logits(z) if scale_logits is not None else z).transpose(0, 1)

    def step(data_iterator, model, *args):
        mb = next(data_iterator)
        if fused:
            policy = None
            if loss != "logprobs":
                policy = PolicyLoss(advantages=mb["adv"], old_logprobs=mb["old"], ref_logprobs=mb["ref"],
                                    loss_agg=loss.removeprefix("policy-"), **SPEC)
            ctx = FusedOutputProcessorContext(temperature=mb["temperature"], loss=policy)
            out = model(mb["ids"], mb["pos"], mask, labels=mb["labels"], output_processor=fused_output_processor,
                        output_processor_context=ctx)
        else:
            out = model(mb["ids"], mb["pos"], mask, labels=mb["labels"], output_processor=own_logits)

        def loss_func(output):
            valid = mb["labels"] != -100
            if fused and loss == "logprobs":
                lp, ent = output
                value = (mb["a"] * lp).sum() + (mb["c"] * ent).sum()
            elif fused:
                value, lp, ent = output.loss * 1.0, output.logprobs, output.entropy
            else:
                lp, ent = env.reference_from_logits(output, torch.where(valid, mb["labels"], 0), mb["temperature"])
                lp, ent = torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)
                if loss == "logprobs":
                    value = (mb["a"].double() * lp).sum() + (mb["c"].double() * ent).sum()
                else:
                    adv = torch.broadcast_to(mb["adv"].double(), lp.shape)
                    f, _, _ = term64(lp, ent, adv, mb["old"].double(), mb["ref"].double(), **SPEC)
                    value = aggregate64(f, valid, loss.removeprefix("policy-"))
            # cloned: the schedule divides the returned loss by the number of micro-batches in place
            seen.append((value.detach().double().clone(), lp.detach().double(), ent.detach().double()))
            return value, {}

        return out, loss_func

    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    iterators = [iter(batches) for _ in chunks]
    with env.CudaOnCpu():
        get_forward_backward_func()(forward_step_func=step,
                                    data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks,
                                    num_microbatches=MICRO, seq_length=S, micro_batch_size=B, forward_only=False)
    grads = {f"{i}.{n}": p.grad for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    return seen, grads


def _check(torch, got, want, last_stage):
    (seen_got, g_got), (seen_want, g_want) = got, want
    if last_stage:
        assert len(seen_got) == len(seen_want) == MICRO, (len(seen_got), len(seen_want))
        for (l1, lp1, e1), (l0, lp0, e0) in zip(seen_got, seen_want, strict=True):
            assert abs(float(l1 - l0)) <= 1e-5 * max(1.0, abs(float(l0))), (float(l1), float(l0))
            assert float((lp1 - lp0).abs().max()) <= LP_TOL and float((e1 - e0).abs().max()) <= ENT_TOL
    else:
        assert not seen_got and not seen_want, "a loss ran on a stage that is not the last"
    assert g_got.keys() == g_want.keys()
    for name, w in g_want.items():
        g = g_got[name]
        assert w is not None and g is not None, f"{name}: no gradient"
        assert float(w.norm()) > 0, f"{name}: zero gradient (the case would test nothing)"
        err = float((g.double() - w.double()).norm()) / float(w.double().norm())
        assert err <= GRAD_TOL, (name, err)


def run(rank: int, init_file: str, seed: int, out_dir: str) -> None:
    import torch
    torch.set_num_threads(1)
    from megatron.core import parallel_state as ps

    import mcore_env as env
    from ranks import finish
    results = {}
    try:
        for vpp, tag in ((None, "novp"), (2, "vp2")):
            try:
                env.init_cpu_megatron(rank=rank, world_size=PP, init_file=init_file, pp=PP, vpp=vpp)
                chunks = _chunks(env, torch, vpp, seed)
                batches = _micro_batches(env, torch, seed + 1, chunks[0].vocab_size)
                last = ps.is_pipeline_last_stage()
                for loss in LOSSES:
                    case = f"pp2-{tag}-{loss}"
                    try:
                        want = _run_schedule(env, torch, chunks, batches, False, loss)
                        got = _run_schedule(env, torch, chunks, batches, True, loss)
                        _check(torch, got, want, last)
                        if last:
                            from logitless.megatron import last_path
                            assert last_path().path == "hook", last_path()
                        results[case] = [True, ""]
                    except Exception:  # noqa: BLE001 - recorded per case
                        results[case] = [False, traceback.format_exc()[-3000:]]
            finally:
                ps.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - reported to the parent test
        results["setup"] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
