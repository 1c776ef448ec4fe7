"""Does GRPO still learn with logitless' fused loss? TRL's GRPOTrainer, the same seed, three losses.

    python examples/trl_grpo_learning.py --out runs/cpu --plot                 # CPU: 3 runs, 2-4 min each
    python examples/trl_grpo_learning.py --size gpu --out runs/gpu --plot      # CUDA: bf16, V = 151936
    python examples/trl_grpo_learning.py --mode fused --steps 3 --out runs/x   # one run, in this process
    python examples/trl_grpo_learning.py --plot-only --out runs/cpu            # plot runs already made

A tiny Qwen2 with random weights is built from a config (nothing from the Hub) with a word-level tokenizer
made in code ("w0", "w1", ...); the prompts are random words. The reward is a rule a random policy can
improve on quickly: the share of completion words in a fixed target set (the words whose number is a
multiple of ``--target-every``; about 1/8 of the vocabulary, so a random policy scores about 0.12).

Modes (each run a fresh trainer from the same model weights and, for the same ``--seed``, the same sampling):
  trl    TRL's own GRPOTrainer: its log-probs and its ``_compute_loss``.
  fused  ``logitless.trl.enable(trainer, fused_loss=True)``: log-probs and the loss from logitless' fused
         policy loss (no [tokens x vocab] logits).
  liger  Liger-Kernel's ``LigerFusedLinearGRPOLoss`` as the trainer's loss. TRL 1.16's GRPOConfig has no
         ``use_liger_loss`` (only ``use_liger_kernel``, Liger's layer kernels, not its loss), so this mode
         puts Liger's loss into the trainer's ``_compute_loss`` the way TRL's ``use_liger_loss`` did (the
         backbone's last hidden state and the LM head's weight into Liger's chunked loss; TRL's old and
         reference log-probs). Needs liger-kernel and a CUDA GPU; elsewhere it says so and is skipped
         (``--liger-on-cpu`` runs it on CPU anyway, uncompiled, to check the mode, not its speed).

The loss settings are a common GRPO (DAPO-style) configuration: loss_type "dapo", clip 0.2 / 0.28, a k3 KL to
the reference model with beta 0.04 (TRL's bias-corrected KL, its default), two optimizer steps per generation
batch (``steps_per_generation=2``: the second step is off-policy, so the ratio and the clipping act).

Each run writes OUT/<mode>-seed<seed>.json: per step the loss, grad norm, KL, entropy, clip ratio, the mean
reward of the generation batch (logged on the steps that generate), the step's wall time and its peak memory
(CUDA: torch.cuda.max_memory_allocated during the step, and its rise over the step's start; CPU: the process's
resident-set high-water mark, Linux VmHWM reset at each step's start, and its rise over the step's start).
With several modes each run is a fresh process (so memory is the run's own). ``--noise-seeds`` adds runs of
``trl`` with other sampling seeds (same model weights): their spread is the run-to-run noise the trl / fused
difference is judged against. ``--plot`` draws every run's reward curve into OUT/reward_curves.png (or
``--png``) and prints a markdown table and the curve distances.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

MODES = ("trl", "fused", "liger")
# per-size defaults; every one can be overridden by its flag
SIZES = {
    "cpu": dict(vocab=2053, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, prompts=8, generations=8,
                completion_length=8, prompt_words=4, lr=5e-3, steps=100, dtype="float32"),
    "gpu": dict(vocab=151936, hidden=1024, layers=4, heads=16, kv_heads=4, intermediate=2816, prompts=16,
                generations=8, completion_length=256, prompt_words=16, lr=3e-4, steps=100, dtype="bfloat16"),
    # what the test runs: the smallest shapes that still make a GRPO step
    "tiny": dict(vocab=509, hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64, prompts=4, generations=4,
                 completion_length=6, prompt_words=3, lr=3e-3, steps=3, dtype="float32"),
}
LOGGED = ("loss", "grad_norm", "reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean",
          "completions/mean_length", "learning_rate")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the JSON of each run (and the plot)")
    p.add_argument("--mode", choices=MODES, help="run only this mode, in this process")
    p.add_argument("--modes", default=",".join(MODES), help="modes to run, each in a fresh process")
    p.add_argument("--seed", type=int, default=0, help="the trainer's seed (sampling, data order)")
    p.add_argument("--noise-seeds", default="1", help="extra trl seeds for the run-to-run noise ('' for none)")
    p.add_argument("--model-seed", type=int, default=0, help="the seed of the model's random weights")
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    for name in SIZES["cpu"]:
        p.add_argument("--" + name.replace("_", "-"), type=type(SIZES["cpu"][name]), default=None)
    p.add_argument("--target-every", type=int, default=8, help="target words: those whose number is a multiple")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.04)
    p.add_argument("--steps-per-generation", type=int, default=2)
    p.add_argument("--liger-on-cpu", action="store_true", help="run the liger mode without CUDA (a check only)")
    p.add_argument("--liger-uncompiled", action="store_true", help="Liger's loss without torch.compile")
    p.add_argument("--plot", action="store_true", help="after the runs, draw the reward curves and print the table")
    p.add_argument("--plot-only", action="store_true", help="only plot the runs already in --out")
    p.add_argument("--png", default=None, help="where the plot goes (default OUT/reward_curves.png)")
    args = p.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype not in ("float32", "bfloat16"):
        p.error(f"--dtype must be float32 or bfloat16, got {args.dtype!r}")
    return args


# ---------------------------------------------------------------- model, tokenizer, prompts, reward

def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from transformers import PreTrainedTokenizerFast
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for i in range(vocab_size - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.padding_side = "left"
    return fast


def build_model(folder: str, args) -> str:
    """A random tiny Qwen2 and its tokenizer saved to ``folder`` (TRL loads the reference model from it too).
    The same ``--model-seed`` gives the same weights in every mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(args.model_seed)
    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4 * (
                             args.prompt_words + args.completion_length) + 64,
                         pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # logits of std ~1 rather than ~0.02 x sqrt(H): a policy with preferences to move, not a uniform one
        model.lm_head.weight.normal_(0.0, 1.0 / math.sqrt(args.hidden))
    model.to(getattr(torch, args.dtype)).save_pretrained(folder)
    build_tokenizer(args.vocab).save_pretrained(folder)
    return folder


def build_prompts(args, n: int = 256):
    """``n`` prompts of ``--prompt-words`` random words (a fixed draw, the same in every run)."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, args.vocab - 3, (n, args.prompt_words), generator=gen)
    return [" ".join(f"w{i}" for i in row.tolist()) for row in ids]


def target_share(every: int):
    """The rule: the share of a completion's words whose number is a multiple of ``every`` (0 when empty)."""
    def reward(completions, **_):
        out = []
        for text in completions:
            words = [w for w in text.split() if w[:1] == "w" and w[1:].isdigit()]
            out.append(sum(int(w[1:]) % every == 0 for w in words) / max(len(words), 1))
        return out
    reward.__name__ = f"target_share_every_{every}"
    return reward


# ---------------------------------------------------------------- the liger mode

def liger_compute_loss(self, model, inputs):
    """Liger's ``LigerFusedLinearGRPOLoss`` in place of GRPOTrainer._compute_loss, as TRL's use_liger_loss
    ran it: the backbone's last hidden state at the positions that predict the completion, the LM head's
    weight, TRL's advantages and old / reference log-probs. Logs TRL's names for what Liger returns (kl,
    clip_ratio/region_mean). TRL's scaling for gradient accumulation and its dapo normaliser are kept."""
    unwrapped = self.accelerator.unwrap_model(model)
    prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
    completion_mask = inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
    keep = completion_ids.size(1)
    with self.accelerator.autocast():
        hidden = unwrapped.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    hidden = hidden[:, -keep - 1:-1, :]                     # position t predicts token t + 1
    mode = "train" if self.model.training else "eval"
    accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
    num_items = None
    if self.loss_type in ("dapo", "cispo", "vespo"):
        # TRL: num_items_in_batch spans the generation batch; one accumulation window's share of it
        num_items = inputs["num_items_in_batch"].float()
        if mode == "train":
            num_items = num_items * accumulation / self.args.steps_per_generation
    loss, metrics = self._liger_grpo_loss(
        _input=hidden, lin_weight=unwrapped.lm_head.weight, selected_token_ids=completion_ids,
        attention_mask=completion_mask, advantages=inputs["advantages"], bias=unwrapped.lm_head.bias,
        old_per_token_logps=inputs.get("old_per_token_logps"), ref_per_token_logps=inputs.get("ref_per_token_logps"),
        num_items_in_batch=num_items)
    if num_items is None:
        loss = loss / accumulation
    if self.beta != 0.0:
        self._metrics[mode]["kl"].append(self.accelerator.gather(metrics[0]).mean().item())
    self._metrics[mode]["clip_ratio/region_mean"].append(self.accelerator.gather(metrics[-1]).mean().item())
    return loss


def enable_liger(trainer, compiled: bool):
    import types

    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    a = trainer.args
    trainer._liger_grpo_loss = LigerFusedLinearGRPOLoss(
        beta=trainer.beta, compiled=compiled, use_ref_model=trainer.beta != 0.0, epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high, loss_type=trainer.loss_type, max_completion_length=a.max_completion_length,
        importance_sampling_level=trainer.importance_sampling_level, temperature=trainer.temperature,
        delta=a.delta, use_bias_correction_kl=bool(a.use_bias_correction_kl))
    trainer.__dict__["_compute_loss"] = types.MethodType(liger_compute_loss, trainer)


def liger_unavailable(args) -> str | None:
    """Why the liger mode cannot run here (None: it can)."""
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means it is not usable here
        return f"liger-kernel is not installed ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available() and not args.liger_on_cpu:
        return "no CUDA GPU here (Liger's GRPO loss is a GPU loss; --liger-on-cpu runs it anyway, as a check)"
    return None


# ---------------------------------------------------------------- measuring

def _status_kib(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


class StepMeter:
    """Wall time and peak memory of each optimizer step (generation, scoring, loss, backward, optimizer)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.rows = []

    def callback(self):
        from transformers import TrainerCallback
        meter = self

        class Meter(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                meter.begin()

            def on_step_end(self, args, state, control, **kw):
                meter.end(state.global_step)
        return Meter()

    def begin(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
        else:
            self.start_bytes = _status_kib("VmRSS") * 1024
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")                       # reset VmHWM to the current resident set
        self.t0 = time.perf_counter()

    def end(self, step):
        if self.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = _status_kib("VmHWM") * 1024
        self.rows.append({"step": step, "step_time_s": time.perf_counter() - self.t0, "peak_bytes": peak,
                          "peak_over_start_bytes": peak - self.start_bytes})


# ---------------------------------------------------------------- one run

def versions() -> dict:
    import logitless
    import transformers
    import trl
    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "trl": trl.__version__, "logitless": getattr(logitless, "__version__", "?")}
    try:
        from importlib.metadata import version

        import liger_kernel  # noqa: F401
        out["liger-kernel"] = version("liger-kernel")
    except Exception:  # noqa: BLE001 - not installed: not recorded
        pass
    return out


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {cpu}, {os.cpu_count()} cores"


def run_one(args, mode: str, seed: int) -> dict:
    """Train one mode from ``seed`` and write OUT/<mode>-seed<seed>.json (returned)."""
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                            category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        # DeepSpeed, where it is installed, is imported by accelerate and logs a WARNING when it finds no GPU;
        # naming the device it should use (its own DS_ACCELERATOR setting) is all it needs
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from datasets import Dataset
    from transformers.utils import logging as hf_logging

    from transformers import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer
    hf_logging.disable_progress_bar()
    path = os.path.join(args.out, f"{mode}-seed{seed}.json")
    record = {"mode": mode, "seed": seed, "model_seed": args.model_seed, "machine": machine(),
              "versions": versions(), "settings": {k: v for k, v in vars(args).items() if k not in (
                  "out", "mode", "modes", "plot", "plot_only", "png", "noise_seeds", "seed")}}
    if mode == "liger":
        why = liger_unavailable(args)
        if why:
            print(f"liger mode skipped: {why}")
            record["skipped"] = why
            _write(path, record)
            return record
    use_cpu = not torch.cuda.is_available()
    bf16 = args.dtype == "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(os.path.join(tmp, "model"), args)
        config = GRPOConfig(
            output_dir=os.path.join(tmp, "out"), seed=seed, max_steps=args.steps, learning_rate=args.lr,
            lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
            per_device_train_batch_size=args.prompts * args.generations // args.steps_per_generation,
            steps_per_generation=args.steps_per_generation, gradient_accumulation_steps=1,
            num_generations=args.generations, max_completion_length=args.completion_length, temperature=1.0,
            loss_type=args.loss_type, beta=args.beta, epsilon=0.2, epsilon_high=0.28,
            model_init_kwargs={"dtype": args.dtype}, bf16=bf16, use_cpu=use_cpu,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True)
        trainer = GRPOTrainer(model=folder, reward_funcs=target_share(args.target_every), args=config,
                              train_dataset=Dataset.from_dict({"prompt": build_prompts(args)}),
                              processing_class=build_tokenizer(args.vocab))
        trainer.remove_callback(PrinterCallback)
        if mode == "fused":
            import logitless.trl
            logitless.trl.enable(trainer, fused_loss=True)
        elif mode == "liger":
            enable_liger(trainer, compiled=torch.cuda.is_available() and not args.liger_uncompiled)
        meter = StepMeter(trainer.accelerator.device)
        trainer.add_callback(meter.callback())
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
    record["steps"] = steps
    record["summary"] = summarise(steps)
    _write(path, record)
    s = record["summary"]
    print(f"{mode} seed {seed}: reward {s['first_reward']:.3f} -> {s['final_reward']:.3f}, "
          f"step {s['median_step_s']:.3f} s (median), peak {s['peak_mib']:.1f} MiB "
          f"(+{s['rise_median_mib']:.1f} over a step's start, median); {path}")
    return record


def summarise(steps, window: int = 10) -> dict:
    """Rewards of the generation batches in the first / last ``window`` steps; the first step whose batch
    reached a reward of 0.5 and of 0.9; the median step time; the largest peak over the run; a step's peak
    rise over its start (median over the steps, and the largest after step 1, whose first calls allocate
    workspaces that later steps reuse)."""
    rewards = [(s["step"], s["reward"]) for s in steps if "reward" in s]
    last = steps[-1]["step"] if steps else 0
    first = [r for st, r in rewards if st <= window]
    final = [r for st, r in rewards if st > last - window]
    mib = 2.0 ** 20
    rises = [s["peak_over_start_bytes"] for s in steps]
    return {"first_reward": statistics.fmean(first) if first else float("nan"),
            "final_reward": statistics.fmean(final) if final else float("nan"),
            "step_to_0.5": next((st for st, r in rewards if r >= 0.5), None),
            "step_to_0.9": next((st for st, r in rewards if r >= 0.9), None),
            "median_step_s": statistics.median(s["step_time_s"] for s in steps) if steps else float("nan"),
            "peak_mib": max((s["peak_bytes"] for s in steps), default=0) / mib,
            "rise_median_mib": statistics.median(rises) / mib if rises else float("nan"),
            "rise_max_mib": max(rises[1:] or rises or [0]) / mib}


def _write(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


# ---------------------------------------------------------------- several runs, the plot, the table

def run_all(args, argv):
    """Every requested mode (and the noise seeds of trl), each in a fresh process running this script."""
    runs = [(m, args.seed) for m in args.modes.split(",") if m]
    runs += [("trl", int(s)) for s in args.noise_seeds.split(",") if s.strip()]
    bad = [m for m, _ in runs if m not in MODES]
    if bad:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; known: {', '.join(MODES)}")
    passed = _strip(argv, ("--modes", "--noise-seeds", "--seed", "--png"), ("--plot", "--plot-only"))
    for mode, seed in runs:
        cmd = [sys.executable, os.path.abspath(__file__), *passed, "--mode", mode, "--seed", str(seed)]
        print(f"== {mode} seed {seed}", flush=True)
        subprocess.run(cmd, check=True)


def _strip(argv, with_value, flags):
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in with_value:
            skip = "=" not in a
            continue
        if name in flags:
            continue
        out.append(a)
    return out


def load_runs(out_dir):
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*-seed*.json"))):
        with open(path) as f:
            runs.append(json.load(f))
    order = {m: i for i, m in enumerate(MODES)}
    runs.sort(key=lambda r: (r["seed"], order.get(r["mode"], 9)))
    return runs


def reward_curve(run):
    return {s["step"]: s["reward"] for s in run.get("steps", []) if "reward" in s}


def curve_distance(a, b):
    """Mean absolute difference of two runs' rewards over the steps where both generated."""
    ca, cb = reward_curve(a), reward_curve(b)
    common = sorted(set(ca) & set(cb))
    return statistics.fmean(abs(ca[s] - cb[s]) for s in common) if common else float("nan")


def table(runs) -> str:
    """One row per run; ``peak`` is CUDA's max_memory_allocated on a GPU, the process's peak RSS on CPU."""
    lines = ["| mode | seed | reward, first 10 steps | reward, last 10 steps | first step >= 0.5 / 0.9 | "
             "step time (median) | peak memory | a step's peak over its start: median (max after step 1) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if "skipped" in r:
            lines.append(f"| {r['mode']} | {r['seed']} | skipped: {r['skipped']} | | | | | |")
            continue
        s = summarise(r["steps"])
        lines.append(f"| {r['mode']} | {r['seed']} | {s['first_reward']:.3f} | {s['final_reward']:.3f} | "
                     f"{s['step_to_0.5']} / {s['step_to_0.9']} | {s['median_step_s']:.3f} s | "
                     f"{s['peak_mib']:.1f} MiB | {s['rise_median_mib']:.1f} MiB ({s['rise_max_mib']:.1f} MiB) |")
    return "\n".join(lines)


def distances(runs) -> list[str]:
    """The trl / fused (and liger) distance against the trl seed-to-seed distance (the noise)."""
    done = [r for r in runs if "skipped" not in r]
    base = [r for r in done if r["mode"] == "trl"]
    if not base:
        return []
    ref = base[0]
    out = []
    for r in done:
        if r is ref:
            continue
        ca, cb = reward_curve(r), reward_curve(ref)
        apart = next((st for st in sorted(set(ca) & set(cb)) if ca[st] != cb[st]), None)
        out.append(f"{r['mode']} seed {r['seed']} vs trl seed {ref['seed']}: mean |reward difference| per generation "
                   f"{curve_distance(r, ref):.4f}, final rewards {summarise(r['steps'])['final_reward']:.3f} vs "
                   f"{summarise(ref['steps'])['final_reward']:.3f}, first generation whose reward differs: "
                   f"step {apart}")
    return out


def plot(runs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    # the same-seed curves coincide for many steps: wide pale trl, fused on top, liger dotted, so all show
    styles = {"trl": dict(color="tab:blue", linewidth=4, alpha=0.45), "fused": dict(color="tab:orange", linewidth=1.4),
              "liger": dict(color="tab:green", linewidth=1.4, linestyle=":")}
    for r in runs:
        if "skipped" in r:
            continue
        c = reward_curve(r)
        style = dict(styles.get(r["mode"], {}))
        if r["mode"] == "trl" and r["seed"] != runs[0]["seed"]:
            style.update(color="tab:gray", linestyle="--", linewidth=1.1, alpha=1.0)
        label = {"trl": "TRL's loss", "fused": "logitless fused_loss=True", "liger": "Liger's GRPO loss"}[r["mode"]]
        ax.plot(list(c), list(c.values()), label=f"{label} (seed {r['seed']})", **style)
    done = [r for r in runs if "skipped" not in r]
    s = done[0]["settings"] if done else {}
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the generation batch")
    where = done[0]["machine"].split(",")[0].split(":")[0] if done else ""
    ax.set_title(f"TRL GRPOTrainer, loss_type {s.get('loss_type')}, beta {s.get('beta')}, V={s.get('vocab')}, "
                 f"{s.get('dtype')}, {where}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
        plot(runs, args.png or os.path.join(args.out, "reward_curves.png"))
        print(table(runs))
        for line in distances(runs):
            print(line)


if __name__ == "__main__":
    main()
