"""Does on-policy distillation still learn with logitless' fused loss? TRL's DistillationTrainer, one seed, two losses.

    python examples/trl_distillation_learning.py --out runs/distill-cpu --plot               # CPU, a few minutes
    python examples/trl_distillation_learning.py --size gpu --out runs/distill-gpu --plot    # CUDA: bf16, V = 151936
    python examples/trl_distillation_learning.py --mode fused --steps 3 --out runs/x        # one run, in this process
    python examples/trl_distillation_learning.py --plot-only --out runs/distill-cpu         # plot runs already made

The task: words "w0", "w1", ... (a word-level tokenizer made in code; nothing from the Hub) where the next word of a
sequence is always the following task word, w_i -> w_(i+1) (mod ``--task-words``). A teacher (a random Qwen2 built
from a config) is trained on it briefly with the usual next-token loss (``--teacher-contexts``: on consecutive runs
only, or on runs and on a prompt's run followed by random words: see ``teacher_batch``); a smaller, random student is
then distilled from it with TRL's DistillationTrainer: the student samples completions of prompts of consecutive
words (task words only: the rest of the vocabulary is suppressed in sampling, not in the loss, which spans the whole
head), and its next-token distribution at each completion token is trained toward the teacher's (TRL's generalized
JSD, ``--beta``). The CPU size: beta 0.5, the JSD; TRL's default 1.0, the reverse KL, moves a near-uniform student
toward a near-one-hot teacher slowly: from seed 0, 0.015 held-out accuracy after 60 steps at lr 2e-2, where the JSD
reaches 0.89 in 40. The GPU size: beta 0, the forward KL. The JSD's pull on the teacher's word falls with the
student's probability q of it (about q ln(1/q) / 2 of the cross-entropy's), and a near-uniform student over thousands
of words has q ~ 1e-3 or less: on one H200 the GPU size's first settings (4096 task words, JSD, teacher on runs
only, bf16 student weights, lr 3e-3, 40 steps) stayed at 0.0003 held-out accuracy, the loss flat at ~0.45 from step 5.
On CPU, a reduced GPU size (V 2051, 1024 task words, teacher H 128 on mixed contexts, student H 256 / 2 layers, 16
prompts, bf16, lr 3e-3, 40 steps) stayed at 0.001 with the JSD (bf16 or float32 student weights) and reached 0.95 at
step 20 and 1.000 at step 35 with the forward KL (a teacher trained on runs only was near one-hot on random contexts
at that size too: the GPU teacher's spread, see ``teacher_batch``, is not reproduced there).
The held-out metric: on sequences the student never trained on, the share of positions where the student's most
likely next word is the rule's (teacher-forced, no sampling).

Modes (each a fresh trainer from the same teacher and the same student weights; the same ``--seed`` samples the
same first batch):
  trl    TRL's own loss: ``DistillationTrainer._compute_loss`` (``trl.kernels.ChunkedDivergenceFunction``).
  fused  ``logitless.trl.enable(trainer)``: the same loss from ``logitless.losses.fused_distillation_loss``.

The teacher and the student's initial weights are made once per ``--out`` (OUT/models/, reused while the settings
that shape them are unchanged). Each run writes OUT/<mode>-seed<seed>.json: per step the loss, grad norm and the
student's entropy (TRL's logged metrics), the step's wall time and peak memory (CUDA: max_memory_allocated during
the step, and its rise over the step's start; CPU: the process's peak resident set, Linux VmHWM, reset at each
step), and every ``--eval-every`` steps the held-out accuracy. ``--noise-seeds`` adds ``trl`` runs with other
sampling seeds (same weights): their spread is the run-to-run noise the trl / fused difference is judged against.
``--plot`` draws the loss and held-out curves (OUT/distillation_curves.png or ``--png``) and prints a table.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the tokenizer, the step meter, the run records, the table and the plot, shared with trl_grpo_learning.py
import learning_runs as common  # noqa: E402

MODES = ("trl", "fused")
# per-size defaults; every one can be overridden by its flag
SIZES = {
    "cpu": dict(vocab=1031, task_words=256, hidden=96, layers=2, heads=4, kv_heads=2, student_hidden=48,
                student_layers=1, student_heads=4, prompts=8, prompt_words=4, completion_length=12, lr=1e-2,
                steps=40, teacher_steps=100, teacher_lr=3e-3, teacher_batch=32, eval_every=4, dtype="float32",
                teacher_contexts="runs", beta=0.5),
    # one H100: the teacher and each run (trl, fused, trl seed 1) in a minute or two each. The forward KL and the
    # teacher trained on mixed contexts: with the JSD (beta 0.5) and a teacher trained on consecutive runs only, 40
    # steps on one H200 left the student at 0.0003 held-out accuracy, its loss flat at ~0.45 from step 5 (see the
    # module's docstring). These settings have not been run on a GPU yet.
    "gpu": dict(vocab=151936, task_words=4096, hidden=1024, layers=4, heads=16, kv_heads=4, student_hidden=512,
                student_layers=2, student_heads=8, prompts=32, prompt_words=8, completion_length=64, lr=3e-3,
                steps=200, teacher_steps=400, teacher_lr=1e-3, teacher_batch=64, eval_every=10, dtype="bfloat16",
                teacher_contexts="mixed", beta=0.0),
    # what the test runs: the smallest shapes that still make a distillation step
    "tiny": dict(vocab=259, task_words=256, hidden=48, layers=1, heads=4, kv_heads=2, student_hidden=32,
                 student_layers=1, student_heads=4, prompts=4, prompt_words=3, completion_length=6, lr=3e-3,
                 steps=3, teacher_steps=30, teacher_lr=3e-3, teacher_batch=16, eval_every=1, dtype="float32",
                 teacher_contexts="runs", beta=0.5),
}
# what shapes the saved models: a change of any of these makes them again
MODEL_KEYS = ("vocab", "task_words", "hidden", "layers", "heads", "kv_heads", "student_hidden", "student_layers",
              "student_heads", "prompt_words", "completion_length", "teacher_steps", "teacher_lr", "teacher_batch",
              "dtype", "teacher_contexts", "model_seed")
LOGGED = ("loss", "grad_norm", "entropy", "learning_rate")
HELD_OUT = 256          # held-out sequences


def parse_args(argv=None):
    p = common.argument_parser(__doc__, MODES, SIZES, out="the models, the JSON of each run and the plot",
                               noise_seeds="1,2", weights="the teacher's and student's weights",
                               png_name="distillation_curves.png")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling and divergence temperature (TRL's)")
    args = common.parse_sized(p, argv, SIZES)
    if not 2 <= args.task_words <= args.vocab - 3:
        p.error(f"--task-words must lie in [2, vocab - 3 = {args.vocab - 3}], got {args.task_words}")
    if not 0.0 <= args.beta <= 1.0:
        p.error(f"--beta (TRL's: 0 the forward KL, 0.5 the JSD, 1 the reverse KL) must lie in [0, 1], got {args.beta}")
    if args.teacher_contexts not in ("runs", "mixed"):
        p.error(f"--teacher-contexts must be runs or mixed, got {args.teacher_contexts!r}")
    return args


# ---------------------------------------------------------------- the task, the teacher, the student

def sequences(args, n: int, length: int, gen: torch.Generator, starts: torch.Tensor | None = None) -> torch.Tensor:
    """n token-id rows of ``length`` consecutive task words (ids 3 + word), from random (or given) starts."""
    if starts is None:
        starts = torch.randint(0, args.task_words, (n,), generator=gen)
    words = (starts[:, None] + torch.arange(length)[None, :]) % args.task_words
    return words + 3


def split_starts(args):
    """(training starts, held-out starts): every fifth start is held out from the prompts."""
    starts = torch.arange(args.task_words)
    held = starts % 5 == 0
    return starts[~held], starts[held]


def qwen2(args, hidden, layers, heads, kv_heads):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    length = args.prompt_words + args.completion_length
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2 * length + 64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def heldout_accuracy(model, batch: torch.Tensor) -> float:
    """Share of the held-out positions where the model's most likely next token is the rule's (teacher-forced)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits = total = 0
    with torch.no_grad():
        for rows in batch.split(64):
            rows = rows.to(device)
            logits = model(input_ids=rows[:, :-1]).logits
            hits += (logits.argmax(-1) == rows[:, 1:]).sum().item()
            total += rows[:, 1:].numel()
    model.train(was_training)
    return hits / total


def heldout_batch(args) -> torch.Tensor:
    _, held = split_starts(args)
    gen = torch.Generator().manual_seed(4321)
    pick = held[torch.randint(0, len(held), (HELD_OUT,), generator=gen)]
    return sequences(args, HELD_OUT, args.prompt_words + args.completion_length, gen, pick)


def teacher_batch(args, gen: torch.Generator, train_starts: torch.Tensor) -> tuple:
    """(rows, labels) of one teacher step: ``--teacher-batch`` rows of consecutive task words from training starts.
    ``--teacher-contexts`` runs: every row consecutive, labels the rows (the model's shifted next-token loss).
    mixed: the second half of the rows keep their first ``--prompt-words`` words and have random task words after
    them -- the contexts a student's samples make while it is still random -- and every position of every row is
    labelled with the successor of its own word (the rule is the same in both halves). Trained on consecutive rows
    alone, a teacher is only taught the rule where the whole context agrees with it, and may
    then be far from one-hot on a student's samples (the GPU size's teacher of the 2026-12-06 run was: TRL's JSD at
    the first step, against a student near uniform over V, 0.566, where a near-one-hot teacher gives 0.693)."""
    length = args.prompt_words + args.completion_length
    pick = train_starts[torch.randint(0, len(train_starts), (args.teacher_batch,), generator=gen)]
    rows = sequences(args, args.teacher_batch, length, gen, pick)
    if args.teacher_contexts == "runs":
        return rows, rows
    half = args.teacher_batch // 2
    rows[half:, args.prompt_words:] = 3 + torch.randint(0, args.task_words, (args.teacher_batch - half,
                                                                             length - args.prompt_words), generator=gen)
    return rows, (rows - 3 + 1) % args.task_words + 3


def train_teacher(args, device) -> tuple:
    """The teacher, trained on the rule with the usual next-token loss (AdamW, ``--teacher-steps``; the rows of
    ``teacher_batch``); its held-out accuracy. Float32 master weights, autocast in bf16 on the GPU size."""
    torch.manual_seed(args.model_seed)
    teacher = qwen2(args, args.hidden, args.layers, args.heads, args.kv_heads).to(device)
    opt = torch.optim.AdamW(teacher.parameters(), lr=args.teacher_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.model_seed + 1)
    train_starts, _ = split_starts(args)
    bf16 = args.dtype == "bfloat16"
    teacher.train()
    for _ in range(args.teacher_steps):
        rows, labels = (t.to(device) for t in teacher_batch(args, gen, train_starts))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if args.teacher_contexts == "runs":
                loss = teacher(input_ids=rows, labels=rows).loss
            else:
                logits = teacher(input_ids=rows).logits
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(teacher.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return teacher, heldout_accuracy(teacher, heldout_batch(args)), loss.item()


def prepare_models(args) -> dict:
    """OUT/models/{teacher,student}: made once for these settings (OUT/models/settings.json), then reused."""
    folder = os.path.join(args.out, "models")
    settings = {k: getattr(args, k) for k in MODEL_KEYS}
    path = os.path.join(folder, "settings.json")
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["settings"] == settings:
            return saved
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    teacher, acc, last_loss = train_teacher(args, device)
    dtype = getattr(torch, args.dtype)
    teacher.to(dtype).save_pretrained(os.path.join(folder, "teacher"))
    torch.manual_seed(args.model_seed + 2)
    student = qwen2(args, args.student_hidden, args.student_layers, args.student_heads, args.student_heads)
    student.to(dtype).save_pretrained(os.path.join(folder, "student"))
    tok = common.build_tokenizer(args.vocab)
    for who in ("teacher", "student"):
        tok.save_pretrained(os.path.join(folder, who))
    record = {"settings": settings, "teacher_heldout_accuracy": acc, "teacher_last_loss": last_loss,
              "teacher_train_s": time.perf_counter() - t0,
              "student_heldout_accuracy": heldout_accuracy(student, heldout_batch(args))}
    common.write_record(path, record)
    print(f"teacher: held-out accuracy {acc:.3f} after {args.teacher_steps} steps (last loss {last_loss:.3f}, "
          f"{record['teacher_train_s']:.1f} s); the untrained student: {record['student_heldout_accuracy']:.3f}")
    return record


def outside_task(args) -> list:
    """The ids that are not task words: the special tokens and the words past ``--task-words``."""
    return [0, 1, 2] + list(range(3 + args.task_words, args.vocab))


def build_prompts(args, n: int = 512):
    """``n`` prompts of ``--prompt-words`` consecutive task words from the training starts (a fixed draw)."""
    train_starts, _ = split_starts(args)
    gen = torch.Generator().manual_seed(1234)
    pick = train_starts[torch.randint(0, len(train_starts), (n,), generator=gen)]
    rows = sequences(args, n, args.prompt_words, gen, pick) - 3
    return [" ".join(f"w{i}" for i in row.tolist()) for row in rows]


# ---------------------------------------------------------------- one run

def run_one(args, mode: str, seed: int) -> dict:
    """Distil the student from ``seed`` in this mode and write OUT/<mode>-seed<seed>.json (returned)."""
    common.quiet_trainer()
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer
    hf_logging.disable_progress_bar()
    models = prepare_models(args)
    path = os.path.join(args.out, f"{mode}-seed{seed}.json")
    record = common.new_record(args, mode, seed, models=models)
    dtype = getattr(torch, args.dtype)
    folder = os.path.join(args.out, "models")
    # the student trains on float32 master weights, bf16 only under the trainer's autocast (bf16=True): AdamW's
    # update of a bf16 weight is lost below half its spacing (2^-9 of it: a norm weight of 1 does not move at lr
    # 3e-3), and a bf16 second moment does not decay (0.999 v rounds to v); the frozen teacher runs in ``--dtype``
    student = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "student"), dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "teacher"), dtype=dtype)
    held = heldout_batch(args)
    with tempfile.TemporaryDirectory() as tmp:
        config = DistillationConfig(
            output_dir=os.path.join(tmp, "out"), seed=seed, max_steps=args.steps, learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
            per_device_train_batch_size=args.prompts, gradient_accumulation_steps=1,
            max_completion_length=args.completion_length, temperature=args.temperature, beta=args.beta,
            bf16=args.dtype == "bfloat16", use_cpu=not torch.cuda.is_available(), logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True,
            # the student samples task words only (the loss still spans the whole vocabulary): a word outside the
            # task is a context the teacher never saw, and teaches the student nothing
            generation_kwargs={"suppress_tokens": outside_task(args)})
        trainer = DistillationTrainer(model=student, teacher_model=teacher, args=config,
                                      train_dataset=Dataset.from_dict({"prompt": build_prompts(args)}),
                                      processing_class=common.build_tokenizer(args.vocab))
        trainer.remove_callback(PrinterCallback)
        if mode == "fused":
            import logitless.trl
            logitless.trl.enable(trainer)
        meter = common.StepMeter(trainer.accelerator.device)
        trainer.add_callback(meter.callback())
        evals = {0: heldout_accuracy(trainer.model, held)}

        class HeldOut(TrainerCallback):
            # after the meter's on_step_end (added first), so the evaluation is not in the step's time
            def on_step_end(self, targs, state, control, **kw):
                if state.global_step % args.eval_every == 0 or state.global_step == args.steps:
                    evals[state.global_step] = heldout_accuracy(trainer.model, held)

        trainer.add_callback(HeldOut())
        t0 = time.perf_counter()
        trainer.train()
        record["train_s"] = time.perf_counter() - t0
    steps = common.step_rows(meter, trainer, LOGGED)
    for row in steps:
        if row["step"] in evals:
            row["heldout_accuracy"] = evals[row["step"]]
    record["heldout_accuracy_start"] = evals[0]
    s = common.close_record(path, record, steps, summarise)
    print(f"{mode} seed {seed}: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, held-out accuracy "
          f"{evals[0]:.3f} -> {s['final_heldout']:.3f}, step {s['median_step_s']:.3f} s (median), peak "
          f"{s['peak_mib']:.1f} MiB (+{s['rise_median_mib']:.1f} over a step's start, median); {path}")
    return record


def summarise(steps, window: int = 5) -> dict:
    """Mean loss of the first / last ``window`` steps, the last held-out accuracy, the step time and memory
    (learning_runs.step_summary)."""
    losses = [s["loss"] for s in steps if "loss" in s]
    held = [s["heldout_accuracy"] for s in steps if "heldout_accuracy" in s]
    return {"first_loss": statistics.fmean(losses[:window]) if losses else float("nan"),
            "final_loss": statistics.fmean(losses[-window:]) if losses else float("nan"),
            "final_heldout": held[-1] if held else float("nan"),
            **common.step_summary(steps)}


# ---------------------------------------------------------------- the table, the distances, the plot

def table(runs) -> str:
    def cells(r):
        s = summarise(r["steps"])
        return [f"{s['first_loss']:.4f}", f"{s['final_loss']:.4f}",
                f"{r['heldout_accuracy_start']:.3f} -> {s['final_heldout']:.3f}"]
    return common.table(runs, ["loss, first 5 steps", "loss, last 5 steps", "held-out accuracy: start -> end"],
                        cells)


def distances(runs) -> list:
    """Each run's distance to TRL's loss at the first seed (loss per step, held-out accuracy per evaluation): fused
    at the same seed against TRL's other seeds, the run-to-run noise."""
    out = []
    for r, ref in common.against_first_trl(runs):
        la, lb = common.curve(r, "loss"), common.curve(ref, "loss")
        apart = next((st for st in sorted(set(la) & set(lb))
                      if abs(la[st] - lb[st]) > 1e-4 * max(abs(lb[st]), 1e-3)), None)
        out.append(f"{r['mode']} seed {r['seed']} vs trl seed {ref['seed']}: mean |loss difference| per step "
                   f"{common.distance(r, ref, 'loss'):.5f}, mean |held-out accuracy difference| per evaluation "
                   f"{common.distance(r, ref, 'heldout_accuracy'):.4f}, first step whose loss differs by more "
                   f"than 1e-4 (relative): {apart}")
    return out


def plot(runs, png):
    s = runs[0]["settings"]
    common.plot(
        runs, png, [(f"loss (TRL's generalized JSD, beta {s.get('beta')})", lambda r: common.curve(r, "loss")),
                    ("held-out next-word accuracy",
                     lambda r: {0: r["heldout_accuracy_start"], **common.curve(r, "heldout_accuracy")})],
        {"trl": "TRL's loss", "fused": "logitless"},
        f"TRL DistillationTrainer, V={s.get('vocab')}, teacher H={s.get('hidden')} -> student "
        f"H={s.get('student_hidden')}, {s.get('dtype')}, {common.where(runs)}", (10, 3.8))


def main(argv=None):
    common.main(sys.argv[1:] if argv is None else argv, __file__, MODES, parse_args, run_one,
               (plot, table, distances), "distillation_curves.png", prepare=prepare_models)


if __name__ == "__main__":
    main()
