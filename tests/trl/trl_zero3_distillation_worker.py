"""One rank of the two-process distillation check under DeepSpeed ZeRO-3 (deepspeed's CPU accelerator, gloo),
spawned by test_trl_distillation_zero3.py. Each rank builds a real trainer (DistillationTrainer, GKDTrainer), makes
its own batch with TRL's code, keeps unsharded copies of both models, then puts the student into a ZeRO-3 engine
(every parameter partitioned: the heads are 0-element placeholders between calls) and the teacher into one without
an optimizer, as TRL's ``prepare_deepspeed`` does. The enabled trainer's loss on the engines (the student's head
gathered by its own call, the teacher's by ``sharded_head.whole_weight``) against TRL's own loss on the unsharded
copies of the same rank's batch: the loss, the entropy TRL logs from (DistillationTrainer) and the full gradients
(``safe_get_full_grad``: ZeRO averages them over the ranks, so the reference's are averaged too).

Accelerate's DeepSpeed plugin is not used: on CPU its state is ``MULTI_CPU`` (as for FSDP2, see
trl_fsdp2_worker.py), so the engines are built here with ``deepspeed.initialize`` and handed to the trainer's own
methods. TRL's own loss does not run on the engines themselves: it reads both ``lm_head.weight`` without calling the
heads, which under ZeRO-3 are the placeholders (checked below, so the test says so if TRL starts gathering them)."""
import contextlib
import copy
import datetime
import os
import traceback

import torch
import torch.distributed as dist

from logitless.tools.common import env_set
from ranks import finish

CASES = ["DistillationTrainer beta=0.5, num_items_in_batch", "DistillationTrainer beta=1.0, temperature=1.3",
         "GKDTrainer beta=0.3, batchmean", "TRL's own loss on the engines"]
TOL, GRAD_TOL = 1e-5, 1e-4
ZERO3 = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


@contextlib.contextmanager
def _deepspeed_env():
    """RANK and WORLD_SIZE, which DeepSpeed's set-up reads, for its calls only: set while a trainer is built, they
    would make accelerate's state multi-process (asking for MASTER_ADDR) where the trainers here are each rank's own.
    LOCAL_RANK, which the engines read in every forward too, stays set (``run``)."""
    with env_set(RANK=dist.get_rank(), WORLD_SIZE=dist.get_world_size()):
        yield


def _engines(trainer):
    """(student engine, teacher engine, unsharded student, unsharded teacher)."""
    import deepspeed
    student, teacher = trainer.model, trainer.teacher_model
    plain_student, plain_teacher = copy.deepcopy(student), copy.deepcopy(teacher)
    for plain in (plain_student, plain_teacher):
        # SFTTrainer (GKD's base) sets an instance forward that calls the original model's forward from a closure,
        # which deepcopy does not copy: the copy would run the engine's model. Without fused_lm_head it is the
        # class's forward, so the copy gets that.
        plain.__dict__.pop("forward", None)
    with _deepspeed_env():
        deepspeed.init_distributed(dist_backend="gloo")   # adopts the process group (once)
        engine, *_ = deepspeed.initialize(model=student, optimizer=torch.optim.SGD(student.parameters(), lr=0.0),
                                          config=copy.deepcopy(ZERO3))
        teacher_engine, *_ = deepspeed.initialize(model=teacher, config=copy.deepcopy(ZERO3))
    teacher_engine.eval()
    for model in (student, teacher):
        head = model.lm_head.weight
        assert head.numel() == 0 and len(head.ds_shape) == 2, head.shape   # really partitioned
    return engine, teacher_engine, plain_student, plain_teacher


def _full_grads(engine):
    from deepspeed.utils import safe_get_full_grad
    return {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}


def _mean_grads(model):
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def _compare(got_loss, want_loss, got, want, extra="") -> str:
    assert abs(got_loss - want_loss) <= TOL * max(1.0, abs(want_loss)), (got_loss, want_loss)
    assert sorted(n for n, g in got.items() if g is not None) == sorted(want)
    worst = max(float((got[n].view_as(g) - g).norm() / g.norm().clamp_min(1e-30)) for n, g in want.items())
    assert worst <= GRAD_TOL, worst
    return f"loss {got_loss:.7f} (TRL {want_loss:.7f}){extra}, worst grad rel err {worst:.1e}"


def _distillation(student, teacher, out_dir, seed, count, **config) -> str:
    import trl_tiny

    import logitless.trl as lt
    trainer = trl_tiny.distillation_trainer(student, teacher, out_dir, seed=seed, **config)
    torch.manual_seed(seed + 1 + dist.get_rank())   # different completions per rank
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in trl_tiny.prompts()])
    num_items = None
    if count:   # TRL's count over both ranks' completions, divided by the process count
        num_items = inputs["completion_mask"].sum().float()
        dist.all_reduce(num_items)
        num_items /= dist.get_world_size()
    engine, teacher_engine, plain, plain_teacher = _engines(trainer)
    # TRL's own loss on the unsharded copies, as its compute_loss runs it
    trainer.model, trainer.teacher_model = plain, plain_teacher
    want_loss, want_ent, want_n = trainer._forward_redirection(plain, plain, trainer._compute_loss, plain, inputs,
                                                               num_items)
    want_loss.backward()
    want = _mean_grads(plain)
    # the enabled trainer on the ZeRO-3 engines
    trainer.model, trainer.teacher_model = engine, teacher_engine
    lt.enable(trainer)
    loss, ent, n = trainer._forward_redirection(engine, engine.module, trainer._compute_loss, engine.module, inputs,
                                                num_items)
    engine.backward(loss)
    got = _full_grads(engine)
    assert int(n) == int(want_n) and int(n) > 0
    assert abs(ent.item() - want_ent.item()) <= TOL * max(1.0, abs(want_ent.item())), (ent.item(), want_ent.item())
    return _compare(loss.item(), want_loss.item(), got, want, f", entropy sum {ent.item():.5f}")


def _gkd(student, teacher, out_dir, seed) -> str:
    import trl_tiny

    import logitless.trl as lt
    trainer = trl_tiny.experimental_distillation_trainer("gkd", student, teacher, out_dir, seed=seed, beta=0.3)
    trainer.model.train()
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    inputs = trainer.data_collator(examples[dist.get_rank()::2])   # each rank its own conversations
    engine, teacher_engine, plain, plain_teacher = _engines(trainer)
    trainer.model, trainer.teacher_model = plain, plain_teacher
    want_loss = trainer.compute_loss(plain, dict(inputs))
    want_loss.backward()
    want = _mean_grads(plain)
    trainer.model, trainer.teacher_model = engine, teacher_engine
    lt.enable(trainer)
    loss = trainer.compute_loss(engine, dict(inputs))
    engine.backward(loss)
    return _compare(loss.item(), want_loss.item(), _full_grads(engine), want)


def _trl_on_engines(student, teacher, out_dir, seed) -> str:
    """TRL's own DistillationTrainer loss on the ZeRO-3 engines reads the heads' placeholders: it raises (if it
    ever stops raising, the comparison above can move to TRL's own path on the engines)."""
    import trl_tiny
    trainer = trl_tiny.distillation_trainer(student, teacher, out_dir, seed=seed, beta=0.5)
    torch.manual_seed(seed + 1 + dist.get_rank())
    trainer.model.train()
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in trl_tiny.prompts()])
    engine, teacher_engine, *_ = _engines(trainer)
    trainer.model, trainer.teacher_model = engine, teacher_engine
    try:
        trainer._forward_redirection(engine, engine.module, trainer._compute_loss, engine.module, inputs, None)
    except RuntimeError as exc:
        return f"TRL's own loss on the engines raises: {str(exc).splitlines()[0][:200]}"
    raise AssertionError("TRL's own loss ran on the ZeRO-3 engines: compare the enabled trainer with it there")


def run(rank: int, student: str, teacher: str, seed: int, out_dir: str) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"   # before deepspeed is imported
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=180))
    results = {}
    runs = [lambda d: _distillation(student, teacher, d, seed, True, beta=0.5),
            lambda d: _distillation(student, teacher, d, seed, False, beta=1.0, temperature=1.3),
            lambda d: _gkd(student, teacher, d, seed),
            lambda d: _trl_on_engines(student, teacher, d, seed)]
    try:
        for i, (case, call) in enumerate(zip(CASES, runs, strict=True)):
            try:
                results[case] = [True, call(os.path.join(out_dir, f"out{rank}-{i}"))]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
