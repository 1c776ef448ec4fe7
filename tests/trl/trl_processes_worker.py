"""One rank of the two-process GRPOTrainer check of the fused loss (gloo, CPU), spawned by
test_trl_fused_loss_processes.py.

accelerate sees two processes (RANK / WORLD_SIZE / LOCAL_RANK set, the gloo group made here first), so TRL's own
code runs as under ``accelerate launch``: each rank draws its own prompts and rollouts, ``num_items_in_batch`` is
gathered over both ranks' generation batches, the metrics are reduced / gathered across ranks. Per case each rank
builds a GRPOTrainer in train mode with 2 gradient-accumulation steps (steps_per_generation 2), makes its
generation batch with TRL's ``_prepare_inputs`` (generation, then the split into the two micro-batches; signed
random advantages in place of the rewards', which are often all 0 for such short completions), perturbs
the policy (the same on both ranks: ratios != 1) and, on each micro-batch, compares TRL's ``_compute_loss`` with
``enable(trainer, fused_loss=True)``'s: loss, parameter gradients, every metric, the adaptive-entropy state
(and once more in eval mode, where TRL neither splits nor accumulates).
Completions end early (an EOS made likely by ``exponential_decay_length_penalty``) and truncated ones are masked
(``mask_truncated_completions``), so the ranks score different numbers of tokens."""
import datetime
import os
import traceback

import torch
import torch.distributed as dist

from ranks import finish

TOL, GRAD_TOL = 1e-5, 1e-4
ACCUMULATION = 2
COMMON = dict(gradient_accumulation_steps=ACCUMULATION, num_iterations=2, mask_truncated_completions=True,
              generation_kwargs={"exponential_decay_length_penalty": (1, 2.0)})
# loss types whose normaliser is num_items_in_batch (gathered over processes), and TRL's cross-process metrics
CASES = {
    "dapo-kl-entropy_bonus": dict(loss_type="dapo", beta=0.02, entropy_coef=0.01),
    # _last_world_entropy: the last window's entropy (below the target: the bonus applies in this window)
    "dapo-adaptive_entropy": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.01,
                                  entropy_target=100.0, _last_world_entropy=5.0),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),
    "vespo": dict(loss_type="vespo"),
    "grpo-sequence-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05, epsilon=3e-4,
                             epsilon_high=4e-4),
    # TRL's quantile spans both processes' entropies: logitless' entropy_quantile_group (the default group)
    "top_entropy_quantile-entropy_bonus": dict(loss_type="dapo", top_entropy_quantile=0.5, entropy_coef=0.02),
    "top_entropy_quantile-grpo-kl": dict(loss_type="grpo", top_entropy_quantile=0.3, beta=0.02),
}


def _run(trainer, inputs, compute):
    model = trainer.model
    mode = "train" if model.training else "eval"
    model.zero_grad(set_to_none=True)
    trainer._metrics[mode].clear()
    loss = compute(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics[mode].items()}


def _micro_batches(trainer, seed):
    """TRL's _prepare_inputs on this rank's generation batch: both micro-batches of the accumulation window,
    and the two ranks' numbers of scored tokens. Drawn again (both ranks, on the same counts) until the ranks
    score different numbers of tokens (else a per-process count would pass for the gathered one) and every
    micro-batch scores some."""
    trainer.model.train()
    for attempt in range(8):
        torch.manual_seed(seed + 1 + dist.get_rank() + 2 * attempt)          # a different rollout per rank
        generation_batch = next(iter(trainer.get_train_dataloader()))
        micro = []
        for step in range(ACCUMULATION):
            trainer._step = step
            micro.append(trainer._prepare_inputs(generation_batch))
        tokens = [float(m["completion_mask"].sum()) for m in micro]
        counts = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(counts, torch.tensor([sum(tokens), min(tokens)]))
        if counts[0][0] != counts[1][0] and min(float(c[1]) for c in counts) > 0:
            # signed advantages whatever the rewards drew: a micro-batch is one prompt's group, whose
            # completions often score alike (advantages 0: a loss of 0 without KL, which compares nothing)
            gen = torch.Generator().manual_seed(seed + 17 + dist.get_rank())
            for m in micro:
                m["advantages"] = torch.randn(m["advantages"].shape, generator=gen)
            return micro, [float(c[0]) for c in counts]
    raise AssertionError(f"no rollout with different token counts per rank in 8 draws: {counts}")


def _compare_micro_batch(trainer, inputs, sync) -> tuple[str, list]:
    import trl_tiny

    import logitless.trl as lt
    from trl import GRPOTrainer

    trainer.accelerator.gradient_state._set_sync_gradients(sync)     # the optimizer step closes the window
    state = trl_tiny.trainer_state(trainer)
    loss_trl, g_trl, m_trl = _run(trainer, inputs, lambda m, i: GRPOTrainer._compute_loss(trainer, m, i))
    state_trl = trl_tiny.trainer_state(trainer)
    for k, v in state.items():
        setattr(trainer, k, v)
    lt.enable(trainer, fused_loss=True)
    try:
        loss, g, m = _run(trainer, inputs, trainer._compute_loss)
    finally:
        lt.disable(trainer)
    failures = []        # checked after the run: a failed check must not leave this rank out of step

    def expect(ok, what):
        if not ok:
            failures.append(str(what))
    for k, v in state_trl.items():           # TRL's controller state, which goes on to the next micro-batch
        got = getattr(trainer, k)
        expect((v is None) == (got is None), k)
        if v is not None and got is not None:
            v, got = torch.as_tensor(v, dtype=torch.float64), torch.as_tensor(got, dtype=torch.float64)
            expect(torch.allclose(got, v, rtol=TOL, atol=TOL), (k, got, v))      # inf (no entropy yet) too
    expect(loss_trl.abs() > 0, "TRL's loss is 0")
    expect(abs(loss.item() - loss_trl.item()) <= TOL * max(1.0, abs(loss_trl.item())), ("loss", loss, loss_trl))
    expect(g.keys() == g_trl.keys() and g_trl, ("gradients of", sorted(g), sorted(g_trl)))
    worst = max(float((g[n] - gt).norm() / gt.norm().clamp_min(1e-30)) for n, gt in g_trl.items() if n in g)
    expect(worst <= GRAD_TOL, ("worst gradient relative error", worst))
    expect(m.keys() == m_trl.keys(), ("metrics", sorted(m), sorted(m_trl)))
    for key, want in m_trl.items():
        got = m.get(key, [])
        expect(len(got) == len(want), (key, got, want))
        for got_v, want_v in zip(got, want, strict=False):
            expect(abs(got_v - want_v) <= TOL * max(1.0, abs(want_v)), (key, got_v, want_v))
    return (f"loss {loss.item():.7f} (TRL {loss_trl.item():.7f}), worst grad rel err {worst:.1e}, "
            f"metrics {sorted(m_trl)}"), failures


def _case(folder, out_dir, seed, config) -> str:
    import trl_tiny


    config = dict(config)
    attrs = {k: config.pop(k) for k in list(config) if k.startswith("_")}
    trainer = trl_tiny.grpo_trainer(folder, out_dir, seed=seed, **COMMON, **config)
    for k, v in attrs.items():
        setattr(trainer, k, v)
    assert trainer.accelerator.num_processes == 2 and trainer.args.steps_per_generation == ACCUMULATION
    micro, counts = _micro_batches(trainer, seed)
    # the normaliser of dapo / cispo / vespo: every rank's scored tokens of the generation batch
    local = counts[dist.get_rank()]
    items = float(micro[0]["num_items_in_batch"])
    assert items == sum(counts) != 2 * local, (items, counts)
    gen = torch.Generator().manual_seed(seed)            # the same perturbation on every rank
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.2 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    trainer.current_gradient_accumulation_steps = ACCUMULATION
    msgs = [f"tokens: this rank {local:.0f}, both {items:.0f}"]
    failures = []
    for j, inputs in enumerate(micro):
        msg, bad = _compare_micro_batch(trainer, inputs, sync=j == ACCUMULATION - 1)
        msgs.append(f"micro-batch {j}: {msg}")
        failures += [f"micro-batch {j}: {f}" for f in bad]
    trainer.model.eval()            # evaluation: no accumulation (num_items_in_batch / processes for dapo)
    msg, bad = _compare_micro_batch(trainer, micro[0], sync=True)
    msgs.append(f"eval: {msg}")
    failures += [f"eval: {f}" for f in bad]
    if failures:
        raise AssertionError(f"seed {seed}: " + "; ".join(failures))
    return "; ".join(msgs)


def run(rank: int, folder: str, seed: int, out_dir: str) -> None:
    # what accelerate reads to see two CPU processes (the group itself is made here, before it looks)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for case, config in CASES.items():
            try:
                results[case] = [True, _case(folder, os.path.join(out_dir, f"out{rank}"), seed, config)]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
