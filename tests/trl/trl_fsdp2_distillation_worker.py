"""One rank of the two-process DistillationTrainer check under FSDP2 (gloo, CPU), spawned by
test_trl_distillation_fsdp2.py. As in trl_fsdp2_worker.py (which says why accelerate's own FSDP2 is not used on CPU),
``fully_shard`` on each decoder layer and then the root, here of both the student and the teacher. Each rank builds a
real DistillationTrainer, samples its own completions with TRL's code, shards both models and compares, on its batch,
TRL's own ``_compute_loss`` run as TRL's ``compute_loss`` runs it (through the student's wrapper) with the enabled
trainer's: the loss, the entropy sum and token count TRL logs from, and the gradients FSDP2 reduces."""
import datetime
import os
import traceback

import torch
import torch.distributed as dist

from ranks import finish

CASES = ["beta=0.5, num_items_in_batch", "beta=1.0, temperature=1.3, token mean"]
TOL, GRAD_TOL = 1e-5, 1e-4


def _setup(student, teacher, out_dir, seed, mesh, **config):
    import trl_tiny
    from torch.distributed.fsdp import fully_shard
    trainer = trl_tiny.distillation_trainer(student, teacher, out_dir, seed=seed, **config)
    torch.manual_seed(seed + 1 + dist.get_rank())   # different completions per rank
    trainer.model.train()
    inputs = trainer._generate_and_score_completions(
        [{"prompt": p} for p in trl_tiny.prompts()])
    for model in (trainer.model, trainer.teacher_model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return trainer, inputs


def _loss_and_grads(trainer, inputs, num_items):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    # what DistillationTrainer.compute_loss runs (its metric gathering apart: accelerate's state is not this group's)
    loss, entropy_sum, n_valid = trainer._forward_redirection(model, model, trainer._compute_loss, model, inputs,
                                                              num_items)
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), entropy_sum.detach(), int(n_valid), grads


def _compare(got, want) -> str:
    loss, ent, n, grads = got
    loss_trl, ent_trl, n_trl, grads_trl = want
    assert abs(loss.item() - loss_trl.item()) <= TOL * max(1.0, abs(loss_trl.item())), (loss.item(), loss_trl.item())
    assert abs(ent.item() - ent_trl.item()) <= TOL * max(1.0, abs(ent_trl.item())), (ent.item(), ent_trl.item())
    assert n == n_trl and n > 0
    assert grads.keys() == grads_trl.keys() and grads_trl
    worst = max(float((grads[k] - g).norm() / g.norm().clamp_min(1e-30)) for k, g in grads_trl.items())
    assert worst <= GRAD_TOL, worst
    return f"loss {loss.item():.7f} (TRL {loss_trl.item():.7f}), worst grad rel err {worst:.1e}"


def run(rank: int, student: str, teacher: str, seed: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import logitless.trl as lt
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=180))
    results = {}
    try:
        mesh = init_device_mesh("cpu", (2,))
        settings = [dict(beta=0.5), dict(beta=1.0, temperature=1.3)]
        for case, config in zip(CASES, settings, strict=True):
            try:
                trainer, inputs = _setup(student, teacher, os.path.join(out_dir, f"out{rank}"), seed, mesh, **config)
                assert type(trainer.model.lm_head.weight).__name__ == "DTensor"
                assert type(trainer.teacher_model.lm_head.weight).__name__ == "DTensor"
                # train: TRL's count over both ranks' completions, divided by the process count; else the token mean
                count = None
                if "num_items" in case:
                    total = inputs["completion_mask"].sum().float()
                    dist.all_reduce(total)
                    count = total / dist.get_world_size()
                lt.disable(trainer)
                want = _loss_and_grads(trainer, inputs, count)
                lt.enable(trainer)
                results[case] = [True, _compare(_loss_and_grads(trainer, inputs, count), want)]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
    except Exception:
        results["setup"] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
