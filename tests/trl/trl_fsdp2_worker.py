"""One rank of the two-process GRPOTrainer check under FSDP2 (gloo, CPU), spawned by test_trl_fsdp2.py.

accelerate 1.16 does not run FSDP on CPU (``Accelerator(cpu=True, fsdp_plugin=...)`` over two processes comes
out MULTI_CPU: its state selects DistributedType.FSDP only for GPU-like device types), so the sharding is what
accelerate's FSDP2 applies, done here: ``fully_shard`` on each decoder layer, then on the root. Each rank builds
a real GRPOTrainer on the same tiny Qwen2, makes its own rollout with TRL's code, perturbs the policy (ratios
!= 1), shards it, and compares on its batch TRL's own per-token log-probs / entropies, loss and the gradients
FSDP2 reduces with ``logitless.trl.enable(trainer)`` and ``enable(trainer, fused_loss=True)``."""
import datetime
import os
import traceback

import torch
import torch.distributed as dist

from ranks import finish

CASES = ["log-probs and entropies", "enable(trainer): loss and reduced gradients",
         "enable(trainer, fused_loss=True): loss and reduced gradients"]
TOL, GRAD_TOL = 1e-5, 1e-4


def _setup(folder, out_dir, seed, mesh):
    import trl_tiny
    from torch.distributed.fsdp import fully_shard
    trainer = trl_tiny.grpo_trainer(folder, out_dir, seed=seed, loss_type="bnpo", beta=0.04,
                                    use_bias_correction_kl=False, num_iterations=2)
    torch.manual_seed(seed + 1 + dist.get_rank())   # a different rollout per rank
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    gen = torch.Generator().manual_seed(seed)         # the same perturbation on every rank
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    model = trainer.model
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return trainer, inputs


def _loss_and_grads(trainer, inputs):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


def _compare(got, want) -> str:
    (loss, grads), (loss_trl, grads_trl) = got, want
    assert abs(loss.item() - loss_trl.item()) <= TOL, (loss.item(), loss_trl.item())
    assert grads.keys() == grads_trl.keys() and grads_trl
    worst = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in grads_trl.items())
    assert worst <= GRAD_TOL, worst
    return f"loss {loss.item():.7f} (TRL {loss_trl.item():.7f}), worst grad rel err {worst:.1e}"


def run(rank: int, folder: str, seed: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import logitless.trl as lt
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        trainer, inputs = _setup(folder, os.path.join(out_dir, f"out{rank}"), seed, init_device_mesh("cpu", (2,)))
        assert type(trainer.model.lm_head.weight).__name__ == "DTensor"
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        keep = inputs["completion_ids"].size(1)

        def logps():
            with torch.no_grad():
                return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_entropy=True)

        def case_logps():
            lt.disable(trainer)
            lp_trl, ent_trl, _ = logps()
            lt.enable(trainer)
            lp, ent, _ = logps()
            err = max(float((lp - lp_trl).abs().max()), float((ent - ent_trl).abs().max()))
            assert err <= TOL and lp_trl.abs().sum() > 0, err
            return f"max err {err:.1e}"

        def case_loss(fused_loss):
            lt.disable(trainer)
            want = _loss_and_grads(trainer, inputs)
            lt.enable(trainer, fused_loss=fused_loss)
            return _compare(_loss_and_grads(trainer, inputs), want)

        checks = [case_logps, lambda: case_loss(False), lambda: case_loss(True)]
        for case, check in zip(CASES, checks, strict=True):
            try:
                results[case] = [True, check()]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
    except Exception:
        results["setup"] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
