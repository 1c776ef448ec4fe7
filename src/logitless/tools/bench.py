"""`logitless bench`: time logitless's backends, the naive torch path and the installed peers on the
same inputs, against the GEMMs of the same shape measured in the same process (the floor).

Work per token: log-prob of the label and entropy of softmax(h @ W^T / T). Inputs: hidden
[N, H] and weight [V, H] in the chosen dtype, weights scaled so the logits have std ~4, labels
sampled from that softmax (as in RL rollouts). Backward loss: sum(a * logprob) + sum(b * entropy)
with random signed a, b per token (what PPO/GRPO send back); rows without entropy use the
log-prob term only.

Per row: one checked warm-up (errors vs the reference backend on the first tokens), a warm-up of the
forward, and its peak extra memory measured in one more call of each kind, not timed. Then ``repeats``
rounds: in each, every row that ran and the floor time one forward (inputs not requiring grad: the
rollout / reference-model use) and one forward+backward, in turn, the order reversed every other round;
a row's time is the median of its calls (every call is in the JSON). Taking turns spreads other work on a
shared machine over every row alike, so their ordering holds from run to run; the inputs come from a fixed
seed (0 by default), printed with the table. Floor: forward = 1 GEMM [N,H]x[H,V], forward+backward = 4
(forward, recompute, dH = dZ W, dW = dZ^T h), in the input dtype, timed in every round like a row.
Peak extra memory: on CUDA torch's allocator peak minus what was allocated before; on CPU the kernel's
peak-RSS counter (VmHWM, reset through /proc/self/clear_refs) minus the RSS before. Both include the
gradient buffers.
"""
from __future__ import annotations

import ctypes
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable, Optional

import torch
from torch import Tensor

from . import peers
from .common import (
    DTYPES,
    LOGIT_STD,
    GemmFloor,
    cell,
    gemm_tflops,
    markdown_table,
    random_head,
    rel_err,
    sample_labels,
    sync,
    time_call,
)
from .machine import machine, versions

GPU_SHAPE = (16384, 4096, 151936)
# `make bench` on a CPU (every row, compiles included): 7 min 41 s on 2 shared cores under load 4-5 (2026-12-06,
# with the distillation and top-k rows; 2 min 16 s before them), as README.md says.
CPU_SHAPE = (1024, 512, 32000)


@dataclass
class BenchConfig:
    device: str = "cpu"
    shape: tuple[int, int, int] = CPU_SHAPE      # N tokens, H hidden, V vocabulary
    dtype: str = "float32"
    temperature: float = 1.0
    backends: tuple[str, ...] = peers.NAMES
    repeats: int = 5                   # rounds of timed calls (every row takes its turn in each)
    check_tokens: int = 256
    seed: int = 0


@dataclass
class Row:
    name: str
    label: str
    kind: str
    entropy: bool = True               # False: the implementation computes log-probs only
    status: str = "ok"                 # ok | unavailable | failed
    reason: Optional[str] = None
    fwd_s: Optional[float] = None
    fwd_bwd_s: Optional[float] = None
    fwd_x_floor: Optional[float] = None
    fwd_bwd_x_floor: Optional[float] = None
    fwd_extra_bytes: Optional[int] = None
    fwd_bwd_extra_bytes: Optional[int] = None
    err_logprob: Optional[float] = None
    err_entropy: Optional[float] = None
    err_dh: Optional[float] = None
    err_dw: Optional[float] = None
    warmup_s: Optional[float] = None
    times_fwd: list = field(default_factory=list)
    times_fwd_bwd: list = field(default_factory=list)


# --- measurement -----------------------------------------------------------------------------

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


def _release_free_heap() -> None:
    """Hand the memory glibc keeps after frees back to the kernel, so that what the next call
    reuses shows up as RSS growth. (Not done before timed calls: re-faulting pages costs time.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory allocated during one call above the level before it, in bytes.

    CUDA: torch.cuda.max_memory_allocated minus memory_allocated before. CPU: peak RSS (VmHWM,
    reset through /proc/self/clear_refs) minus RSS before, after returning freed heap to the
    kernel. ``method`` says which; ``measure`` returns None when neither works here."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated minus memory allocated before the call"
            return
        try:
            self._reset_hwm()
            _status_kib("VmHWM")
            self.method = "peak RSS (VmHWM reset via /proc/self/clear_refs) minus RSS before the call"
        except OSError as exc:
            self.method = f"unavailable: {exc}"

    @staticmethod
    def _reset_hwm() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def measure(self, fn: Callable[[], object]) -> Optional[int]:
        """Call fn once (its result dropped) and return the peak extra bytes, or None."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            out = fn()
            torch.cuda.synchronize(self.device)
            del out
            return max(0, torch.cuda.max_memory_allocated(self.device) - base)
        if self.method.startswith("unavailable"):
            return None
        _release_free_heap()
        base = _status_kib("VmRSS") * 1024
        self._reset_hwm()
        out = fn()
        peak = _status_kib("VmHWM") * 1024
        del out
        return max(0, peak - base)


# --- inputs ----------------------------------------------------------------------------------

@dataclass
class Inputs:
    hidden: Tensor       # [N, H] dtype
    weight: Tensor       # [V, H] dtype
    labels: Tensor       # [N] int64, sampled from the tempered softmax
    a: Tensor            # [N] float32 coefficient of logprob in the backward loss
    b: Tensor            # [N] float32 coefficient of entropy
    policy: Optional[object] = None   # bench_policy.PolicyInputs, made for the first policy-loss row
    distill: Optional[object] = None  # bench_distill.DistillInputs, made for the first distillation row


def make_inputs(cfg: BenchConfig) -> Inputs:
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    n, h, v = cfg.shape
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    hidden, weight = random_head(n, h, v, dtype, device, gen)
    labels = sample_labels(hidden, weight, cfg.temperature, gen)
    a = torch.randn(n, device=device, generator=gen)
    b = torch.randn(n, device=device, generator=gen)
    return Inputs(hidden, weight, labels, a, b)


# --- one row ---------------------------------------------------------------------------------

def _forward(fn: peers.Fn, x: Inputs, t: float) -> Callable[[], object]:
    return lambda: fn(x.hidden, x.weight, x.labels, t)


def _forward_backward(fn: peers.Fn, x: Inputs, t: float, a: Tensor, b: Tensor):
    def step():
        h = x.hidden.detach().requires_grad_()
        w = x.weight.detach().requires_grad_()
        lp, ent = fn(h, w, x.labels, t)
        loss = (a * lp).sum()
        if ent is not None:
            loss = loss + (b * ent).sum()
        loss.backward()
        return lp.detach(), None if ent is None else ent.detach(), h.grad, w.grad
    return step


class Checker:
    """Reference-backend results on the first ``s`` tokens, to compare every row against.

    Rows are checked on a full-size call whose loss coefficients are zero beyond those tokens, so
    d_weight there comes from the same tokens as the reference's (and compiled rows see one shape)."""

    def __init__(self, x: Inputs, t: float, s: int):
        self.s, self.x, self.t = s, x, t
        self.a = torch.zeros_like(x.a)
        self.a[:s] = x.a[:s]
        self.b = torch.zeros_like(x.b)
        self.b[:s] = x.b[:s]
        self._ref: dict[bool, tuple] = {}

    def reference(self, with_entropy: bool):
        if with_entropy not in self._ref:
            from logitless import fused_logprobs
            s, x = self.s, self.x
            h = x.hidden[:s].detach().requires_grad_()
            w = x.weight.detach().requires_grad_()
            out = fused_logprobs(h, w, x.labels[:s], temperature=self.t, backend="reference")
            loss = (x.a[:s] * out.logprobs).sum()
            if with_entropy:
                loss = loss + (x.b[:s] * out.entropy).sum()
            loss.backward()
            self._ref[with_entropy] = (out.logprobs.detach(), out.entropy.detach(), h.grad, w.grad)
        return self._ref[with_entropy]

    def compare(self, row: Row, lp: Tensor, ent: Optional[Tensor], dh: Optional[Tensor],
                dw: Optional[Tensor]) -> None:
        for name, grad in (("hidden", dh), ("weight", dw)):
            if grad is None:    # e.g. an autograd Function that lost requires_grad on the way
                raise RuntimeError(f"no gradient reached {name}")
        for name, out in (("logprobs", lp), ("entropy", ent), ("d_hidden", dh), ("d_weight", dw)):
            if out is not None and not bool(torch.isfinite(out).all()):
                raise FloatingPointError(f"{name} has non-finite values")
        s = self.s
        r_lp, r_ent, r_dh, r_dw = self.reference(ent is not None)
        row.err_logprob = float((lp[:s].float() - r_lp).abs().max())
        if ent is not None:
            row.err_entropy = float((ent[:s].float() - r_ent).abs().max())
        row.err_dh = rel_err(dh[:s], r_dh)
        row.err_dw = rel_err(dw, r_dw)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:240]


# A row ready to be timed: (the forward without grad, the forward+backward), each a call of no arguments.
Calls = tuple[Callable[[], object], Callable[[], object]]


def _no_grad(fn: Callable[[], object]) -> Callable[[], object]:
    def call():
        with torch.no_grad():
            return fn()
    return call


def prepare_row(impl: peers.Impl, x: Inputs, cfg: BenchConfig, checker: Checker,
                meter: PeakMemory) -> tuple[Row, Optional[Calls]]:
    """The row's checked warm-up and peak memory; its calls for the timing rounds (None: it did not run,
    the row says why)."""
    row = Row(impl.name, impl.label, impl.kind, impl.entropy)
    if impl.kind == "policy":
        return _policy_row(impl, row, x, cfg, meter)
    if impl.kind == "distill":
        return _distill_row(impl, row, x, cfg, meter)
    if impl.kind == "truncation":
        return _truncation_row(impl, row, x, cfg, meter)
    gc.collect()                    # the previous row's leftovers must not count against this one
    device = torch.device(cfg.device)
    try:
        fn = impl.build(device)
    except peers.Unavailable as exc:
        row.status, row.reason = "unavailable", str(exc)
        return row, None
    except Exception as exc:  # noqa: BLE001 - a broken peer keeps its row with the reason
        row.status, row.reason = "unavailable", _short(exc)
        return row, None
    t = cfg.temperature
    try:
        t0 = time.perf_counter()
        lp, ent, dh, dw = _forward_backward(fn, x, t, checker.a, checker.b)()
        sync(device)
        row.warmup_s = time.perf_counter() - t0
        checker.compare(row, lp, ent, dh, dw)
        del lp, ent, dh, dw
        fwd = _no_grad(_forward(fn, x, t))
        fwd()                               # warm-up of the inference path (compiles its own graph)
        row.fwd_extra_bytes = meter.measure(fwd)
        step = _forward_backward(fn, x, t, x.a, x.b)
        row.fwd_bwd_extra_bytes = meter.measure(step)
    except Exception as exc:  # noqa: BLE001
        _failed(row, exc, device, impl.triton_kernel)
        return row, None
    return row, (fwd, step)


def _failed(row: Row, exc: BaseException, device: torch.device, triton_kernel: bool = False) -> None:
    row.status, row.reason = "failed", _short(exc)
    if triton_kernel and device.type != "cuda":
        row.reason = f"triton GPU kernel, no GPU here: {row.reason}"
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _module_row(impl: peers.Impl, row: Row, cfg: BenchConfig,
                prepare: Callable[[object], Calls]) -> tuple[Row, Optional[Calls]]:
    """A row whose work lives in another module (the policy loss, distillation): ``prepare(run)`` fills it from
    ``impl.build``'s result and returns its calls; the same failure handling as the other rows."""
    device = torch.device(cfg.device)
    try:
        run = impl.build(device)
        calls = prepare(run)
        row.label = f"{row.label} [{run.backend}]"
        return row, calls
    except peers.Unavailable as exc:
        row.status, row.reason = "unavailable", str(exc)
    except Exception as exc:  # noqa: BLE001
        _failed(row, exc, device, impl.triton_kernel)
    return row, None


def _policy_row(impl: peers.Impl, row: Row, x: Inputs, cfg: BenchConfig,
                meter: PeakMemory) -> tuple[Row, Optional[Calls]]:
    """A policy-loss row (tools/bench_policy.py)."""
    from . import bench_policy

    def prepare(run):
        if x.policy is None:
            x.policy = bench_policy.make_policy_inputs(x, cfg.temperature, cfg.seed)
        return bench_policy.prepare_policy_row(row, run.fused, run.backend, x, cfg, x.policy, meter, sync)
    return _module_row(impl, row, cfg, prepare)


def _distill_row(impl: peers.Impl, row: Row, x: Inputs, cfg: BenchConfig,
                 meter: PeakMemory) -> tuple[Row, Optional[Calls]]:
    """A distillation or top-k row (tools/bench_distill.py)."""
    from . import bench_distill

    def prepare(run):
        if x.distill is None:
            x.distill = bench_distill.make_distill_inputs(x, cfg.temperature, cfg.seed)
        return bench_distill.prepare_distill_row(row, run.name, run.backend, x, cfg, x.distill, meter, sync)
    return _module_row(impl, row, cfg, prepare)


def _truncation_row(impl: peers.Impl, row: Row, x: Inputs, cfg: BenchConfig,
                    meter: PeakMemory) -> tuple[Row, Optional[Calls]]:
    """A truncation row (tools/bench_truncation.py)."""
    from . import bench_truncation

    def prepare(run):
        return bench_truncation.prepare_truncation_row(row, run.name, run.backend, x, cfg, meter, sync)
    return _module_row(impl, row, cfg, prepare)


def time_rounds(entries: list[tuple[Row, Calls]], floor: "Floor", repeats: int, device: torch.device,
                progress: Callable[[str], None]) -> None:
    """``repeats`` rounds; in each, the floor and every row time one forward and one forward+backward in
    turn, in reversed order every other round (the floor first, then last). A row that raises here is
    marked failed and leaves the rounds."""
    for r in range(repeats):
        progress(f"      timing round {r + 1}/{repeats}")
        order = [None] + entries if r % 2 == 0 else entries[::-1] + [None]
        for entry in order:
            if entry is None:
                floor.sample()
                continue
            row, (fwd, step) = entry
            if row.status != "ok":
                continue
            try:
                row.times_fwd.append(time_call(fwd, device))
                row.times_fwd_bwd.append(time_call(step, device))
            except Exception as exc:  # noqa: BLE001 - a row that fails late keeps its row with the reason
                _failed(row, exc, device)
    for row, _ in entries:
        if row.status == "ok":
            row.fwd_s, row.fwd_bwd_s = statistics.median(row.times_fwd), statistics.median(row.times_fwd_bwd)


class Floor:
    """The GEMM floor (``common.GemmFloor``), sampled once in every timing round like a row; the floor is the
    median sample. Each sample allocates its buffers and frees them after, so the rows get the memory back."""

    def __init__(self, x: Inputs, cfg: BenchConfig):
        self.device = torch.device(cfg.device)
        self.shape = cfg.shape
        self.hid, self.w = x.hidden, x.weight
        self.row = Row("gemm", "GEMM floor (1 / 4 GEMMs)", "floor")
        self._warm = False

    def sample(self, count: int = 1) -> None:
        gemms = GemmFloor(self.hid, self.w)
        if not self._warm:
            gemms.forward_backward()
            self._warm = True
        for _ in range(count):
            self.row.times_fwd.append(time_call(gemms.forward, self.device))
            self.row.times_fwd_bwd.append(time_call(gemms.forward_backward, self.device))
        gemms.close()

    def median(self) -> dict:
        n, h, v = self.shape
        fwd, fwd_bwd = statistics.median(self.row.times_fwd), statistics.median(self.row.times_fwd_bwd)
        return {"fwd_s": fwd, "fwd_bwd_s": fwd_bwd, "fwd_tflops": gemm_tflops(n, h, v, fwd),
                "fwd_bwd_tflops": gemm_tflops(n, h, v, fwd_bwd, 4), "samples": len(self.row.times_fwd)}

    def close(self) -> tuple[dict, Row]:
        """The floor numbers and its table row."""
        floor = self.median()
        self.row.fwd_s, self.row.fwd_bwd_s = floor["fwd_s"], floor["fwd_bwd_s"]
        return floor, self.row


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = _progress,
              command: str = "logitless bench") -> dict:
    """Run every requested row; returns the full record (what --json writes). ``command`` is
    recorded as given."""
    started = time.perf_counter()
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    device = torch.device(cfg.device)
    n, h, v = cfg.shape
    progress(f"{cfg.device} N={n} H={h} V={v} {cfg.dtype} T={cfg.temperature} seed={cfg.seed}: making inputs")
    x = make_inputs(cfg)
    meter = PeakMemory(device)
    checker = Checker(x, cfg.temperature, min(cfg.check_tokens, n))
    impls = [peers.get(name) for name in cfg.backends]
    total = len(impls) + 1
    progress(f"[1/{total}] GEMM floor")
    gemms = Floor(x, cfg)
    gemms.sample()
    first = gemms.median()
    progress(f"      fwd {first['fwd_s'] * 1e3:.1f} ms ({first['fwd_tflops']:.2f} TFLOP/s), "
             f"4 GEMMs {first['fwd_bwd_s'] * 1e3:.1f} ms (one sample; timed again in every round)")
    gemms.row.times_fwd.clear()
    gemms.row.times_fwd_bwd.clear()
    rows, entries = [], []
    for i, impl in enumerate(impls, start=2):
        progress(f"[{i}/{total}] {impl.name}")
        t0 = time.perf_counter()
        row, calls = prepare_row(impl, x, cfg, checker, meter)
        rows.append(row)
        if calls is not None:
            entries.append((row, calls))
            progress(f"      checked and warm ({time.perf_counter() - t0:.1f} s)")
        else:
            progress(f"      {row.status}: {row.reason}")
    progress(f"timing: {cfg.repeats} rounds, the floor and {len(entries)} rows in turn")
    time_rounds(entries, gemms, cfg.repeats, device, progress)
    for row in rows:
        if row.status == "ok":
            progress(f"      {row.name}: fwd {row.fwd_s * 1e3:.1f} ms, fwd+bwd {row.fwd_bwd_s * 1e3:.1f} ms (medians)")
    floor, floor_row = gemms.close()
    rows.insert(0, floor_row)
    for row in rows:
        if row.status == "ok":
            row.fwd_x_floor = row.fwd_s / floor["fwd_s"]
            row.fwd_bwd_x_floor = row.fwd_bwd_s / floor["fwd_bwd_s"]
    return {
        "command": command,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "config": {**asdict(cfg), "shape": list(cfg.shape), "backends": list(cfg.backends),
                   "logit_std": LOGIT_STD},
        "memory_method": meter.method,
        "load_average_start": load_start,
        "floor": floor,
        "rows": [asdict(r) for r in rows],
        "elapsed_s": time.perf_counter() - started,
        # other work on the machine skews CPU timings: keep the load next to them
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# --- output ----------------------------------------------------------------------------------

def _mib(value: Optional[int]) -> str:
    return cell(value and value / 2**20, ".0f")


def format_table(result: dict) -> str:
    """The markdown table the bench prints, with a header line for the setup."""
    cfg, floor, m = result["config"], result["floor"], result["machine"]
    n, h, v = cfg["shape"]
    where = m["cuda"][0]["name"] if cfg["device"] == "cuda" and m["cuda"] else m["cpu"]
    head = (f"N={n} H={h} V={v} {cfg['dtype']} T={cfg['temperature']} on {cfg['device']} ({where}); "
            f"seed {cfg['seed']}; median of {cfg['repeats']} calls a row, rows timed in turn (order reversed "
            f"every other round); errors vs the reference backend on the first "
            f"{min(cfg['check_tokens'], n)} tokens; fwd = forward without grad (rollout / reference "
            f"model), fwd+bwd = training step; MiB = peak memory beyond the inputs\n"
            f"floor: 1 GEMM {floor['fwd_s'] * 1e3:.1f} ms ({floor['fwd_tflops']:.2f} TFLOP/s), "
            f"4 GEMMs {floor['fwd_bwd_s'] * 1e3:.1f} ms\n\n")
    cols = ["implementation", "fwd ms", "fwd x floor", "fwd+bwd ms", "fwd+bwd x floor",
            "fwd MiB", "fwd+bwd MiB", "lp err", "ent err", "dh rel", "dW rel", "note"]
    rows = []
    for r in result["rows"]:
        note = r["reason"] or ""
        if r["status"] == "ok" and not r["entropy"] and r["kind"] not in ("floor", "policy", "distill"):
            note = "log-prob only (no entropy)"
        rows.append([r["label"], cell(r["fwd_s"] and r["fwd_s"] * 1e3, ".1f"), cell(r["fwd_x_floor"], ".2f"),
                     cell(r["fwd_bwd_s"] and r["fwd_bwd_s"] * 1e3, ".1f"), cell(r["fwd_bwd_x_floor"], ".2f"),
                     _mib(r["fwd_extra_bytes"]), _mib(r["fwd_bwd_extra_bytes"]), cell(r["err_logprob"], ".1e"),
                     cell(r["err_entropy"], ".1e"), cell(r["err_dh"], ".1e"), cell(r["err_dw"], ".1e"), note])
    return head + markdown_table(cols, rows)


def write_plot(result: dict, path: str) -> None:
    """A PNG bar chart: time over the GEMM floor, forward and forward+backward, per row that ran."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r["status"] == "ok"]
    labels = [r["label"] for r in rows]
    ys = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 2.0))
    for offset, key, name in ((-0.2, "fwd_x_floor", "forward"), (0.2, "fwd_bwd_x_floor", "forward+backward")):
        values = [r[key] for r in rows]
        bars = ax.barh([y + offset for y in ys], values, height=0.4, label=name)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], padding=2, fontsize=8)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(list(ys), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time / GEMM floor (lower is better)")
    cfg = result["config"]
    n, h, v = cfg["shape"]
    ax.set_title(f"logitless bench: N={n} H={h} V={v} {cfg['dtype']} on {cfg['device']}")
    ax.margins(x=0.12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1 - 0.3 / len(rows)), ncol=2, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(result: dict) -> str:
    """A markdown report: the command, machine, versions and date, then the table (what
    benchmarks/results/*.md hold)."""
    m, cfg = result["machine"], result["config"]
    gpus = ", ".join(d["name"] for d in m["cuda"]) or "none"
    vers = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)
    load = result.get("load_average_start")
    lines = [f"# logitless bench, {cfg['device']}, {result['date'][:10]}", "",
             f"- command: `{result['command']}`",
             f"- date: {result['date']}",
             f"- machine: {m['cpu']}, {m['cpu_count']} cores (torch threads {m['torch_threads']}); GPUs: {gpus}",
             f"- versions: {vers}",
             f"- seed {cfg['seed']}, logit std {cfg['logit_std']}, labels sampled from the softmax; "
             f"backward loss sum(a*logprob) + sum(b*entropy), random signed a, b",
             f"- peak extra memory: {result['memory_method']}; includes the gradient buffers"]
    if load:
        lines.append(f"- load average (1 min) at start {load[0]:.1f}, at end {result['load_average_end'][0]:.1f}"
                     " (other work on the machine inflates CPU timings)")
    lines.append(f"- wall time of the whole bench: {result['elapsed_s']:.0f} s")
    return "\n".join(lines) + "\n\n" + format_table(result)
