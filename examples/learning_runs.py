"""What the two TRL learning scripts (trl_grpo_learning.py, trl_distillation_learning.py) share: the word-level
tokenizer (trl_grpo.py's), the per-step meter, each run's record (OUT/<mode>-seed<seed>.json), the modes run in
fresh processes, and the table and the plot of the runs. Not a script of its own: each learning script imports it."""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings

import torch
from trl_grpo import build_tokenizer  # noqa: F401 - the word-level tokenizer of the GRPO example, the scripts' too

# the arguments a run's record leaves out of its settings: where it writes and which runs it makes, not what it runs
NOT_SETTINGS = ("out", "mode", "modes", "plot", "plot_only", "png", "noise_seeds", "seed")
# the curves of one seed coincide for many steps: a wide pale trl, fused on top, liger dotted, so all show
STYLES = {"trl": dict(color="tab:blue", linewidth=4, alpha=0.45), "fused": dict(color="tab:orange", linewidth=1.4),
          "liger": dict(color="tab:green", linewidth=1.4, linestyle=":")}
MIB = 2.0 ** 20


# ---------------------------------------------------------------- the command line

def argument_parser(doc: str, modes, sizes, *, out: str, noise_seeds: str, weights: str, png_name: str):
    """The arguments both scripts take (a script adds its own): where runs go (``out``: what that folder holds),
    which runs, the seeds (``noise_seeds``: the default extra trl seeds; ``weights``: what ``--model-seed``
    seeds), the size (each of ``sizes["cpu"]``'s settings a flag of its own, overriding the size's), the plot."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", required=True, help=f"folder for {out}")
    p.add_argument("--mode", choices=modes, help="run only this mode, in this process")
    p.add_argument("--modes", default=",".join(modes), help="modes to run, each in a fresh process")
    p.add_argument("--seed", type=int, default=0, help="the trainer's seed (sampling, data order)")
    p.add_argument("--noise-seeds", default=noise_seeds, help="extra trl seeds for the run-to-run noise ('' for none)")
    p.add_argument("--model-seed", type=int, default=0, help=f"the seed of {weights}")
    p.add_argument("--size", choices=sorted(sizes), default="cpu")
    for name in sizes["cpu"]:
        p.add_argument("--" + name.replace("_", "-"), type=type(sizes["cpu"][name]), default=None)
    p.add_argument("--plot", action="store_true", help="after the runs, draw the curves and print the table")
    p.add_argument("--plot-only", action="store_true", help="only plot the runs already in --out")
    p.add_argument("--png", default=None, help=f"where the plot goes (default OUT/{png_name})")
    return p


def parse_sized(p, argv, sizes):
    """``argv`` parsed, each size setting not given taken from ``--size``; ``--dtype`` float32 or bfloat16."""
    args = p.parse_args(argv)
    for name, value in sizes[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.dtype not in ("float32", "bfloat16"):
        p.error(f"--dtype must be float32 or bfloat16, got {args.dtype!r}")
    return args


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


def step_rows(meter: StepMeter, trainer, logged) -> list[dict]:
    """Each metered step with the trainer's logged values of the names in ``logged`` at that step."""
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    rows = []
    for row in meter.rows:
        h = logs.get(row["step"], {})
        rows.append({**row, **{k: h[k] for k in logged if h.get(k) is not None}})
    return rows


def step_summary(steps) -> dict:
    """The median step time, the largest peak over the run, a step's peak rise over its start (median over the
    steps, and the largest after step 1, whose first calls allocate workspaces that later steps reuse)."""
    rises = [s["peak_over_start_bytes"] for s in steps]
    return {"median_step_s": statistics.median(s["step_time_s"] for s in steps) if steps else float("nan"),
            "peak_mib": max((s["peak_bytes"] for s in steps), default=0) / MIB,
            "rise_median_mib": statistics.median(rises) / MIB if rises else float("nan"),
            "rise_max_mib": max(rises[1:] or rises or [0]) / MIB}


# ---------------------------------------------------------------- one run's record

def quiet_trainer() -> None:
    """What a run sets before importing the trainer, so that it prints no warning that is not the run's."""
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing\w*` is deprecated",
                            category=FutureWarning)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        # DeepSpeed, where it is installed, is imported by accelerate and logs a WARNING when it finds no GPU;
        # naming the device it should use (its own DS_ACCELERATOR setting) is all it needs
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


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


def new_record(args, mode: str, seed: int, **more) -> dict:
    """A run's record before it runs: what ran, where, with which versions and settings (and ``more``)."""
    return {"mode": mode, "seed": seed, "model_seed": args.model_seed, "machine": machine(),
            "versions": versions(), **more,
            "settings": {k: v for k, v in vars(args).items() if k not in NOT_SETTINGS}}


def close_record(path, record, steps, summarise) -> dict:
    """The run's ``steps`` and their ``summarise(steps)`` put in its record (and, for the fused mode, the backend
    logitless ran), the record written to ``path``; the summary returned."""
    if record["mode"] == "fused":
        import logitless
        record["logitless_backend"] = logitless.last_backend()
    record["steps"] = steps
    record["summary"] = summarise(steps)
    write_record(path, record)
    return record["summary"]


def write_record(path, record):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


# ---------------------------------------------------------------- several runs

def main(argv, script: str, modes, parse_args, run_one, report, png_name: str, prepare=None) -> None:
    """A learning script's command line: ``--mode`` runs that mode in this process (``run_one(args, mode, seed)``);
    otherwise ``prepare(args)`` (where given) and every requested mode in a fresh process running ``script``;
    then, with ``--plot`` / ``--plot-only``, on the runs in ``--out``: ``report`` is the script's (plot, table,
    distances): the plot drawn into OUT/``png_name`` (or ``--png``), the table and the distances printed."""
    args = parse_args(argv)
    if args.mode:
        run_one(args, args.mode, args.seed)
    elif not args.plot_only:
        run_all(script, args, argv, modes, prepare)
    if args.plot or args.plot_only:
        runs = load_runs(args.out, modes)
        if not runs:
            raise SystemExit(f"no runs in {args.out}")
        plot, table, distances = report
        try:
            import matplotlib  # noqa: F401
        except ImportError:  # a bare GPU machine: the runs are saved; --plot-only draws them where matplotlib is
            print(f"plot skipped: matplotlib is not installed (draw it elsewhere: --plot-only --out {args.out})")
        else:
            plot(runs, args.png or os.path.join(args.out, png_name))
        print(table(runs))
        for line in distances(runs):
            print(line)


def run_all(script: str, args, argv, modes, prepare=None) -> None:
    """Every requested mode (and the noise seeds of trl), each in a fresh process running ``script``, after
    ``prepare(args)`` (what the runs share, made once)."""
    runs = [(m, args.seed) for m in args.modes.split(",") if m]
    runs += [("trl", int(s)) for s in args.noise_seeds.split(",") if s.strip()]
    bad = [m for m, _ in runs if m not in modes]
    if bad:
        raise SystemExit(f"--modes: unknown mode(s) {bad}; known: {', '.join(modes)}")
    if prepare is not None:
        prepare(args)
    passed = _strip(argv, ("--modes", "--noise-seeds", "--seed", "--png"), ("--plot", "--plot-only"))
    for mode, seed in runs:
        cmd = [sys.executable, os.path.abspath(script), *passed, "--mode", mode, "--seed", str(seed)]
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


def load_runs(out_dir, modes) -> list[dict]:
    """The records in ``out_dir`` of the runs of ``modes``, by seed, then in the order of ``modes``."""
    runs = []
    for path in sorted(glob.glob(os.path.join(out_dir, "*-seed*.json"))):
        with open(path) as f:
            run = json.load(f)
        if run.get("mode") in modes:
            runs.append(run)
    runs.sort(key=lambda r: (r["seed"], modes.index(r["mode"])))
    return runs


def against_first_trl(runs) -> list[tuple[dict, dict]]:
    """(run, the first trl run) for every run that ran but that one: what each is judged against (trl at other
    seeds: the run-to-run noise)."""
    done = [r for r in runs if "skipped" not in r]
    ref = next((r for r in done if r["mode"] == "trl"), None)
    return [(r, ref) for r in done if ref is not None and r is not ref]


def curve(run, key) -> dict:
    """{step: value} of ``key`` over the steps of ``run`` that have it."""
    return {s["step"]: s[key] for s in run.get("steps", []) if key in s}


def distance(a, b, key) -> float:
    """Mean absolute difference of two runs' ``key`` over the steps where both have it."""
    ca, cb = curve(a, key), curve(b, key)
    both = sorted(set(ca) & set(cb))
    return statistics.fmean(abs(ca[s] - cb[s]) for s in both) if both else float("nan")


# ---------------------------------------------------------------- the table and the plot

def table(runs, columns, cells) -> str:
    """A markdown table, one row per run: mode, seed, the script's ``columns`` (``cells(run)`` their values, or a
    string for a run that has none: a skipped run), then the step time and the memory (``peak``: CUDA's
    max_memory_allocated on a GPU, the process's peak RSS on CPU)."""
    names = ["mode", "seed", *columns, "step time (median)", "peak memory",
             "a step's peak over its start: median (max after step 1)"]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in runs:
        values = cells(r)
        if isinstance(values, str):
            lines.append(f"| {r['mode']} | {r['seed']} | {values} |" + " |" * (len(names) - 3))
            continue
        s = step_summary(r["steps"])
        lines.append(f"| {r['mode']} | {r['seed']} | " + " | ".join(values) + f" | {s['median_step_s']:.3f} s | "
                     f"{s['peak_mib']:.1f} MiB | {s['rise_median_mib']:.1f} MiB ({s['rise_max_mib']:.1f} MiB) |")
    return "\n".join(lines)


def plot(runs, png, panels, labels, title, size) -> None:
    """Every run's curves, one panel per (y label, {step: value} of a run) in ``panels``, side by side in a
    figure of ``size`` inches; trl at other seeds than the first run's in grey dashes; the legend (``labels``: a
    mode's name in it) on the last panel; ``title`` above. Skipped runs are left out."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(panels), figsize=size, dpi=100, squeeze=False)
    axes = list(axes[0])
    for r in runs:
        if "skipped" in r:
            continue
        style = dict(STYLES.get(r["mode"], {}))
        if r["mode"] == "trl" and r["seed"] != runs[0]["seed"]:
            style.update(color="tab:gray", linestyle="--", linewidth=1.1, alpha=1.0)
        for ax, (_, values) in zip(axes, panels, strict=True):
            c = values(r)
            ax.plot(list(c), list(c.values()), label=f"{labels[r['mode']]} (seed {r['seed']})", **style)
    for ax, (ylabel, _) in zip(axes, panels, strict=True):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    if len(axes) == 1:
        axes[0].set_title(title, fontsize=9)
    else:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png)
    print(f"plot: {png}")


def where(runs) -> str:
    """The machine of the first run that ran, for a plot's title ("CPU", or the GPU's name)."""
    done = [r for r in runs if "skipped" not in r]
    return done[0]["machine"].split(",")[0].split(":")[0] if done else ""
