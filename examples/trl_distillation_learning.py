"""Does on-policy distillation still learn with logitless' fused loss? TRL's DistillationTrainer, one seed, two losses.

    python examples/trl_distillation_learning.py --out runs/distill-cpu --plot               # CPU, a few minutes
    python examples/trl_distillation_learning.py --size gpu --out runs/distill-gpu --plot    # CUDA: bf16, V = 151936
    python examples/trl_distillation_learning.py --mode fused --steps 3 --out runs/x        # one run, in this process
    python examples/trl_distillation_learning.py --plot-only --out runs/distill-cpu         # plot runs already made

The task: words "w0", "w1", ... (a word-level tokenizer made in code; nothing from the Hub) where the next word of a
sequence is always the following task word, w_i -> w_(i+1) (mod ``--task-words``). A teacher (a random Qwen2 built
from a config) is trained on it briefly with the usual next-token loss; a smaller, random student is then distilled
from it with TRL's DistillationTrainer: the student samples completions of prompts of consecutive words (task words
only: the rest of the vocabulary is suppressed in sampling, not in the loss, which spans the whole head), and its
next-token distribution at each completion token is trained toward the teacher's (TRL's generalized JSD, ``--beta``,
0.5 here; TRL's default 1.0, the reverse KL, moves a near-uniform student toward a near-one-hot teacher slowly: on the
CPU size from seed 0, 0.015 held-out accuracy after 60 steps at lr 2e-2, where the JSD reaches 0.89 in 40).
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

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# the GRPO learning script's tokenizer, step meter and run records, shared by both learning scripts
import trl_grpo_learning as common  # noqa: E402

MODES = ("trl", "fused")
# per-size defaults; every one can be overridden by its flag
SIZES = {
    "cpu": dict(vocab=1031, task_words=256, hidden=96, layers=2, heads=4, kv_heads=2, student_hidden=48,
                student_layers=1, student_heads=4, prompts=8, prompt_words=4, completion_length=12, lr=1e-2,
                steps=40, teacher_steps=100, teacher_lr=3e-3, teacher_batch=32, eval_every=4, dtype="float32"),
    "gpu": dict(vocab=151936, task_words=4096, hidden=1024, layers=4, heads=16, kv_heads=4, student_hidden=512,
                student_layers=2, student_heads=8, prompts=32, prompt_words=8, completion_length=128, lr=3e-3,
                steps=80, teacher_steps=600, teacher_lr=1e-3, teacher_batch=64, eval_every=5, dtype="bfloat16"),
    # what the test runs: the smallest shapes that still make a distillation step
    "tiny": dict(vocab=259, task_words=256, hidden=48, layers=1, heads=4, kv_heads=2, student_hidden=32,
                 student_layers=1, student_heads=4, prompts=4, prompt_words=3, completion_length=6, lr=3e-3,
                 steps=3, teacher_steps=30, teacher_lr=3e-3, teacher_batch=16, eval_every=1, dtype="float32"),
}
# what shapes the saved models: a change of any of these makes them again
MODEL_KEYS = ("vocab", "task_words", "hidden", "layers", "heads", "kv_heads", "student_hidden", "student_layers",
              "student_heads", "prompt_words", "completion_length", "teacher_steps", "teacher_lr", "teacher_batch",
              "dtype", "model_seed")
LOGGED = ("loss", "grad_norm", "entropy", "learning_rate")
HELD_OUT = 256          # held-out sequences


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the models, the JSON of each run and the plot")
    p.add_argument("--mode", choices=MODES, help="run only this mode, in this process")
    p.add_argument("--modes", default=",".join(MODES), help="modes to run, each in a fresh process")
    p.add_argument("--seed", type=int, default=0, help="the trainer's seed (sampling, data order)")
    p.add_argument("--noise-seeds", default="1,2", help="extra trl seeds for the run-to-run noise ('' for none)")
    p.add_argument("--model-seed", type=int, default=0, help="the seed of the teacher's and student's weights")
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    for name in SIZES["cpu"]:
        p.add_argument("--" + name.replace("_", "-"), type=type(SIZES["cpu"][name]), default=None)
    p.add_argument("--beta", type=float, default=0.5, help="TRL's beta: 0 forward KL, 0.5 the JSD, 1 reverse KL")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling and divergence temperature (TRL's)")
    p.add_argument("--plot", action="store_true", help="after the runs, draw the curves and print the table")
    p.add_argument("--plot-only", action="store_true", help="only plot the runs already in --out")
    p.add_argument("--png", default=None, help="where the plot goes (default OUT/distillation_curves.png)")
    args = p.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype not in ("float32", "bfloat16"):
        p.error(f"--dtype must be float32 or bfloat16, got {args.dtype!r}")
    if not 2 <= args.task_words <= args.vocab - 3:
        p.error(f"--task-words must lie in [2, vocab - 3 = {args.vocab - 3}], got {args.task_words}")
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


def train_teacher(args, device) -> tuple:
    """The teacher, trained on the rule with the usual next-token loss (AdamW, ``--teacher-steps``); its held-out
    accuracy. Float32 master weights, autocast in bf16 on the GPU size."""
    torch.manual_seed(args.model_seed)
    teacher = qwen2(args, args.hidden, args.layers, args.heads, args.kv_heads).to(device)
    opt = torch.optim.AdamW(teacher.parameters(), lr=args.teacher_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.model_seed + 1)
    train_starts, _ = split_starts(args)
    length = args.prompt_words + args.completion_length
    bf16 = args.dtype == "bfloat16"
    teacher.train()
    for _ in range(args.teacher_steps):
        pick = train_starts[torch.randint(0, len(train_starts), (args.teacher_batch,), generator=gen)]
        rows = sequences(args, args.teacher_batch, length, gen, pick).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = teacher(input_ids=rows, labels=rows).loss
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
    common._write(path, record)
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
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                            category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")      # see trl_grpo_learning.run_one
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
    from trl import DistillationConfig, DistillationTrainer
    hf_logging.disable_progress_bar()
    models = prepare_models(args)
    path = os.path.join(args.out, f"{mode}-seed{seed}.json")
    record = {"mode": mode, "seed": seed, "model_seed": args.model_seed, "machine": common.machine(),
              "versions": common.versions(), "models": models,
              "settings": {k: v for k, v in vars(args).items() if k not in (
                  "out", "mode", "modes", "plot", "plot_only", "png", "noise_seeds", "seed")}}
    dtype = getattr(torch, args.dtype)
    folder = os.path.join(args.out, "models")
    student = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "student"), dtype=dtype)
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
    if mode == "fused":
        import logitless
        record["logitless_backend"] = logitless.last_backend()
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    steps = []
    for row in meter.rows:
        h = logs.get(row["step"], {})
        steps.append({**row, **{k: h[k] for k in LOGGED if h.get(k) is not None}})
        if row["step"] in evals:
            steps[-1]["heldout_accuracy"] = evals[row["step"]]
    record["heldout_accuracy_start"] = evals[0]
    record["steps"] = steps
    record["summary"] = summarise(steps)
    common._write(path, record)
    s = record["summary"]
    print(f"{mode} seed {seed}: loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, held-out accuracy "
          f"{evals[0]:.3f} -> {s['final_heldout']:.3f}, step {s['median_step_s']:.3f} s (median), peak "
          f"{s['peak_mib']:.1f} MiB (+{s['rise_median_mib']:.1f} over a step's start, median); {path}")
    return record


def summarise(steps, window: int = 5) -> dict:
    """Mean loss of the first / last ``window`` steps, the last held-out accuracy, the median step time, the largest
    peak, a step's peak rise over its start (median, and the largest after step 1)."""
    losses = [s["loss"] for s in steps if "loss" in s]
    held = [s["heldout_accuracy"] for s in steps if "heldout_accuracy" in s]
    rises = [s["peak_over_start_bytes"] for s in steps]
    mib = 2.0 ** 20
    return {"first_loss": statistics.fmean(losses[:window]) if losses else float("nan"),
            "final_loss": statistics.fmean(losses[-window:]) if losses else float("nan"),
            "final_heldout": held[-1] if held else float("nan"),
            "median_step_s": statistics.median(s["step_time_s"] for s in steps) if steps else float("nan"),
            "peak_mib": max((s["peak_bytes"] for s in steps), default=0) / mib,
            "rise_median_mib": statistics.median(rises) / mib if rises else float("nan"),
            "rise_max_mib": max(rises[1:] or rises or [0]) / mib}


# ---------------------------------------------------------------- several runs, the plot, the table

def run_all(args, argv):
    """The models once, then every requested mode (and the noise seeds of trl), each in a fresh process."""
    runs = [(m, args.seed) for m in args.modes.split(",") if m]
    runs += [("trl", int(s)) for s in args.noise_seeds.split(",") if s.strip()]
    bad = [m for m, _ in runs if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; known: {', '.join(MODES)}")
    prepare_models(args)
    passed = common._strip(argv, ("--modes", "--noise-seeds", "--seed", "--png"), ("--plot", "--plot-only"))
    for mode, seed in runs:
        cmd = [sys.executable, os.path.abspath(__file__), *passed, "--mode", mode, "--seed", str(seed)]
        print(f"== {mode} seed {seed}", flush=True)
        subprocess.run(cmd, check=True)


def load_runs(out_dir):
    runs = [r for r in common.load_runs(out_dir) if r.get("mode") in MODES]
    order = {m: i for i, m in enumerate(MODES)}
    runs.sort(key=lambda r: (r["seed"], order[r["mode"]]))
    return runs


def curve(run, key):
    return {s["step"]: s[key] for s in run.get("steps", []) if key in s}


def distance(a, b, key):
    """Mean absolute difference of two runs' ``key`` over the steps where both have it."""
    ca, cb = curve(a, key), curve(b, key)
    common_steps = sorted(set(ca) & set(cb))
    return statistics.fmean(abs(ca[s] - cb[s]) for s in common_steps) if common_steps else float("nan")


def table(runs) -> str:
    """One row per run; ``peak`` is CUDA's max_memory_allocated on a GPU, the process's peak RSS on CPU."""
    lines = ["| mode | seed | loss, first 5 steps | loss, last 5 steps | held-out accuracy: start -> end | "
             "step time (median) | peak memory | a step's peak over its start: median (max after step 1) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s = summarise(r["steps"])
        lines.append(f"| {r['mode']} | {r['seed']} | {s['first_loss']:.4f} | {s['final_loss']:.4f} | "
                     f"{r['heldout_accuracy_start']:.3f} -> {s['final_heldout']:.3f} | {s['median_step_s']:.3f} s | "
                     f"{s['peak_mib']:.1f} MiB | {s['rise_median_mib']:.1f} MiB ({s['rise_max_mib']:.1f} MiB) |")
    return "\n".join(lines)


def distances(runs) -> list:
    """Each run's distance to TRL's loss at the first seed (loss per step, held-out accuracy per evaluation): fused
    at the same seed against TRL's other seeds, the run-to-run noise."""
    base = [r for r in runs if r["mode"] == "trl"]
    if not base:
        return []
    ref = base[0]
    out = []
    for r in runs:
        if r is ref:
            continue
        la, lb = curve(r, "loss"), curve(ref, "loss")
        apart = next((st for st in sorted(set(la) & set(lb))
                      if abs(la[st] - lb[st]) > 1e-4 * max(abs(lb[st]), 1e-3)), None)
        out.append(f"{r['mode']} seed {r['seed']} vs trl seed {ref['seed']}: mean |loss difference| per step "
                   f"{distance(r, ref, 'loss'):.5f}, mean |held-out accuracy difference| per evaluation "
                   f"{distance(r, ref, 'heldout_accuracy'):.4f}, first step whose loss differs by more than 1e-4 "
                   f"(relative): {apart}")
    return out


def plot(runs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_held) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=100)
    styles = {"trl": dict(color="tab:blue", linewidth=4, alpha=0.45), "fused": dict(color="tab:orange", linewidth=1.4)}
    for r in runs:
        style = dict(styles[r["mode"]])
        if r["mode"] == "trl" and r["seed"] != runs[0]["seed"]:
            style.update(color="tab:gray", linestyle="--", linewidth=1.1, alpha=1.0)
        label = {"trl": "TRL's loss", "fused": "logitless"}[r["mode"]] + f" (seed {r['seed']})"
        for ax, key in ((ax_loss, "loss"), (ax_held, "heldout_accuracy")):
            c = curve(r, key)
            if key == "heldout_accuracy":
                c = {0: r["heldout_accuracy_start"], **c}
            ax.plot(list(c), list(c.values()), label=label, **style)
    s = runs[0]["settings"]
    where = runs[0]["machine"].split(",")[0].split(":")[0]
    ax_loss.set_ylabel(f"loss (TRL's generalized JSD, beta {s.get('beta')})")
    ax_held.set_ylabel("held-out next-word accuracy")
    for ax in (ax_loss, ax_held):
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    ax_held.legend(fontsize=8)
    fig.suptitle(f"TRL DistillationTrainer, V={s.get('vocab')}, teacher H={s.get('hidden')} -> student "
                 f"H={s.get('student_hidden')}, {s.get('dtype')}, {where}", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png)
    print(f"plot: {png}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.mode:
        run_one(args, args.mode, args.seed)
    elif not args.plot_only:
        run_all(args, argv)
    if args.plot or args.plot_only:
        runs = load_runs(args.out)
        if not runs:
            raise SystemExit(f"no runs in {args.out}")
        plot(runs, args.png or os.path.join(args.out, "distillation_curves.png"))
        print(table(runs))
        for line in distances(runs):
            print(line)


if __name__ == "__main__":
    main()
