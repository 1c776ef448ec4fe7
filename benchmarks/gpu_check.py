"""Every GPU claim of logitless re-checked in one call, within a time budget: a short timing of each headline
figure against the cuBLAS floor (and the installed peers) in this process, then the GPU-only tests, one table with
each target beside its figure, compared with a committed baseline of the same shapes.

    make gpu-check                                    # on a machine with one CUDA GPU, torch and triton
    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--only tests,timings] [--budget 450]
        [--tests-budget 150] [--rounds 3] [--reps 5] [--test-workers N]
        [--baseline benchmarks/results/gpu-check-baseline.json] [--write-baseline PATH] [--commit REV] [--dry-run]

The whole call keeps to ``--budget`` seconds (default 450: with the imports, under 8 minutes on one H100),
counted from the start of the process:
1. Timings first (docs/performance.md's shapes, bf16 unless named), so the claims are measured on a cool GPU and no
   slow test file can starve them; they end ``--tests-budget`` seconds before the budget does. Sections in order:
   head A, head B, the policy loss, the float32 head, distillation, top-k, truncation. Each section's share is the
   time left times its estimate (seconds on one H100, ``Section.estimate_s``) over the estimates of the sections
   not yet run: time a section does not use goes to the later ones. A section with less than a third of its
   estimate left is skipped, its figures "not run (budget)" in the table.
   Each figure is the ratio of logitless' time to its floor, both timed in alternating rounds (floor, logitless,
   peers; median of a round's CUDA-event-timed calls each), reported as the median ratio and its spread (min-max)
   over the rounds; errors against float64 on a slice of the tokens; peak memory over the gradient buffers. After
   one untimed warm-up call each (triton compiles, cuBLAS picks its kernels) one timed call of each prices a
   round; the rounds x calls run are ``--rounds`` x ``--reps`` (3 x 5; truncation at most 2 x 3, its selections
   cost seconds a call), cut to the first of 3 x 3, 2 x 3, 2 x 2, 2 x 1, 1 x 1 that fits the section's share where
   the asked plan would not (the figure's "rounds x calls" says what ran). Two rounds still give a spread to judge
   a ratio by; one is a figure without one. A call of 0.5 s or more gets no warm-up call before each round (it is
   its own).
2. The tests: the suite's GPU-only files (compiled kernels, CUDA graphs, batch invariance, TF32 / split
   precisions, Gluon, streams, the distillation and top-k kernels), one pytest process per file (``--test-workers``
   at once, default half the host's CPUs up to 8, their CPU threads split between them), GPU-only subjects first
   and the longest compiled-kernel files next, until the budget ends: a file started too late is "not run
   (budget)", one cut short "timed out (budget)" with the tests it got through, never passed.
3. Each figure against its target (pass / miss) and against the baseline (same card name): a move beyond the larger
   of the two runs' spreads and 2% of the baseline is flagged "moved", with the commit range to bisect.
Nothing measured is lost: each figure is logged the moment its rounds are done (median, spread, target, verdict,
note), each section's start and seconds too, and OUT/gpu-check.json and OUT/gpu-check.md are rewritten after
every figure, section and test file, so a call killed at any point leaves every finished figure on disk (a
SIGTERM, as `timeout` sends, is recorded as the call's status). The table is printed last.
--dry-run: every step on tiny shapes on the CPU (triton's interpreter, wall clock; the tests step only collects):
a check of the script, run in CI, not a measurement; its section times are logged like the GPU's.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

T_START = time.monotonic()        # the budget counts from here: the imports below are part of the call
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
from logitless import fused_logprobs, fused_topk, last_backend, last_precision  # noqa: E402
from logitless.losses import fused_policy_loss  # noqa: E402
from logitless.tools import peers  # noqa: E402
from logitless.tools.common import (  # noqa: E402
    GemmFloor,
    env_set,
    markdown_table,
    peak_extra_bytes,
    random_head,
    sample_labels,
    time_call,
    time_calls,
)
from logitless.tools.machine import machine, versions  # noqa: E402

# The suite's files whose subject needs a GPU (each also runs on the CPU, where their GPU cases skip), in the
# order the tests step starts them: the longest first (their seconds on one H100 with 8 files at once, 2026-12-07),
# so that the files that finish last are short ones and the budget's end cuts none of them short.
GPU_TESTS = ("tests/ops/test_topk_select.py",                  # > 143 s
             "tests/ops/test_triton_policy_kernels.py",         # > 48 s cut short, 121 tests
             "tests/ops/test_policy_stats_gluon.py",            # 125 s
             "tests/ops/test_triton_backend.py",                # 119 s
             "tests/test_contexts.py",                          # 116 s
             "tests/test_precision.py",                         # 111 s
             "tests/test_compile_and_graphs.py",                # 103 s
             "tests/ops/test_label_sets.py",                    # 95 s
             "tests/test_precision_adaptive.py",                # the adaptive split's kernels (with label sets: 56 s)
             "tests/losses/test_distill_topk_one_pass.py",      # > 52 s
             "tests/ops/test_tail_dlogits.py",                  # 55 s
             "tests/test_truncation.py",                        # 49 s
             "tests/ops/test_pair_products_triton.py",
             "tests/ops/test_above_select.py",
             "tests/ops/test_nucleus.py",                       # the wide round's nucleus kernel (new)
             "tests/ops/test_given_set.py",
             "tests/ops/test_batch_invariance.py",              # 42 s
             "tests/ops/test_token_chunks.py",                  # 24 s
             "tests/losses/test_distillation_unchecked.py",     # 21 s
             "tests/ops/test_tail_gradient.py",                 # 21 s
             "tests/ops/test_stages.py",                        # 17 s
             "tests/losses/test_distill_topk_degenerate.py",    # 16 s
             "tests/losses/test_policy_loss.py",                # 16 s
             "tests/ops/test_distill_chunk_kernels.py",         # 16 s
             "tests/ops/test_chunked_columns.py",               # 14 s
             "tests/losses/test_policy_losses.py",              # 9 s
             "tests/losses/test_distill_topk.py")               # 8 s
# GPU tests this check leaves out, and why (tests/tools/test_gpu_check.py holds every GPU-conditional file to one
# of the two lists)
NOT_IN_CHECK = {"tests/megatron/test_megatron_schedule_gpu.py": "needs megatron-core, not on a bare GPU machine",
                "tests/megatron/test_megatron_mamba_gpu.py": "needs megatron-core and mamba-ssm's source",
                "tests/tools/test_cli.py": "its CUDA condition skips a CPU-only message check on a GPU"}
GIB = float(1 << 30)
# Full shapes on the GPU; tiny ones for the dry run.
FULL = dict(head_a=(16384, 4096, 151936), head_b=(8192, 4096, 131072), policy=(16, 1024, 4096, 151936),
            fp32=(8192, 4096, 151936), distill=(16, 1024, 4096, 151936), topk=(16384, 4096, 151936),
            truncation=(16384, 4096, 151936))
TINY = dict(head_a=(24, 40, 1031), head_b=(20, 40, 1031), policy=(2, 12, 40, 1031), fp32=(20, 40, 1031),
            distill=(2, 12, 40, 1031), topk=(24, 40, 1031), truncation=(24, 40, 1031))
CHECK_ROWS = 256      # tokens of the float64 error checks
NOT_RUN = "not run (budget)"
SKIP_BELOW = 1 / 3    # a section starts only with at least this share of its estimate left
SLOW_CALL_S = 0.5     # a call this slow is its own warm-up: no extra call before each round


def log(*a):
    print(*a, flush=True)


@dataclass
class Figure:
    """One row of the table: a claim, its target and what this run measured."""
    name: str
    shape: str
    target: Optional[float]               # the figure must be <= target (None: reported, no target)
    unit: str = "x"                       # "x" a ratio to the floor, "err" an error, "GiB" memory
    rounds: list = field(default_factory=list)
    note: str = ""
    error: str = ""
    plan: str = ""                        # the rounds x calls that ran
    status: str = ""                      # why it has no value: NOT_RUN, or a killed call's

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.rounds) if self.rounds else None

    @property
    def spread(self) -> tuple[Optional[float], Optional[float]]:
        return (min(self.rounds), max(self.rounds)) if self.rounds else (None, None)

    def verdict(self) -> str:
        if self.error:
            return "error"
        if self.median is None:
            return self.status or "-"
        if self.target is None:
            return "info"
        return "pass" if self.median <= self.target else "miss"


FIGURES: dict[str, Figure] = {}


def figure(name, shape, target, unit="x") -> Figure:
    FIGURES[name] = f = Figure(name, shape, target, unit)
    return f


def fmt(x: Optional[float], unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.1e}" if unit == "err" else f"{x:.3f}" if unit == "x" else f"{x:.2f}"


def settle(fig: Figure) -> None:
    """A figure is done (its rounds, or its error): its line in the log now, and the results files rewritten."""
    lo, hi = fig.spread
    target = "none" if fig.target is None else f"<= {fmt(fig.target, fig.unit)}"
    spread = "" if lo is None or len(fig.rounds) < 2 else f", spread {fmt(lo, fig.unit)}-{fmt(hi, fig.unit)}"
    plan = f", {fig.plan}" if fig.plan else ""
    note = fig.error or fig.note
    log(f"figure {fig.name}: {fmt(fig.median, fig.unit)}{spread}, target {target}: {fig.verdict()}{plan}"
        + (f" ({note[:200]})" if note else ""))
    save()


def put(fig: Figure, value: float) -> None:
    fig.rounds = [value]
    settle(fig)


# ---------------------------------------------------------------- timing within the budget

@dataclass
class Plan:
    """How the timed rounds run: the rounds x calls asked (the section's cap applied) and when the running
    section's share of the budget ends."""
    rounds: int = 3
    reps: int = 5
    section_end: float = math.inf


PLAN = Plan()


def choose_plan(costs: list[float], rounds: int, reps: int, seconds: float) -> tuple[int, int]:
    """The first of (rounds, reps) and the cheaper plans (3 x 3, 2 x 3, 2 x 2, 2 x 1, 1 x 1, none above the asked)
    whose rounds fit ``seconds``, given the seconds of one call of each callable of a round (a round of reps calls
    each, plus a warm-up call before each callable under SLOW_CALL_S); 1 x 1 where none fits."""
    options = [(rounds, reps), (min(rounds, 3), min(reps, 3)), (min(rounds, 2), min(reps, 3)),
               (min(rounds, 2), min(reps, 2)), (min(rounds, 2), 1), (1, 1)]
    for r, p in options:
        if r * sum((p + (c < SLOW_CALL_S)) * c for c in costs) <= seconds:
            return r, p
    return 1, 1


def median_ms(fn, dev, reps, warmup) -> float:
    times = sorted(time_calls(fn, dev, reps=reps, warmup=warmup))
    return times[len(times) // 2]


def alternate(dev, floor: Callable, entries: list[tuple], part: float = 1.0) -> None:
    """Rounds of (floor, each entry): each entry's figure gets one ratio a round (its median over the round's
    floor median). An entry is (figure, callable) or (figure, callable, note): note(first result) is the figure's
    note. The first call of each is an untimed warm-up (triton compiles, cuBLAS picks its kernels), a second one
    prices a round: the rounds x calls are PLAN's, or a cheaper plan (``choose_plan``) where those would not end
    within ``part`` of the section's time left. Each figure is settled (logged, saved) when its rounds are done."""
    live = []
    for fig, fn, *note in entries:
        try:
            out = fn()
            if note:
                fig.note = note[0](out)
            del out
            live.append((fig, fn))
        except Exception as exc:  # noqa: BLE001 - a failing entry is a row with its error; the others still run
            fig.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(traceback.format_exc()[-1500:])
            settle(fig)
    if not live:
        return
    device = torch.device(dev)
    floor()
    costs = [time_call(floor, device)] + [time_call(fn, device) for _, fn in live]
    seconds = (PLAN.section_end - time.monotonic()) * part
    rounds, reps = choose_plan(costs, PLAN.rounds, PLAN.reps, seconds)
    warm = [int(c < SLOW_CALL_S) for c in costs]
    for _ in range(rounds):
        base = median_ms(floor, dev, reps, warm[0])
        for (fig, fn), w in zip(live, warm[1:], strict=True):
            fig.rounds.append(median_ms(fn, dev, reps, w) / base)
    cut = (rounds, reps) != (PLAN.rounds, PLAN.reps)
    for fig, _ in live:
        fig.plan = f"{rounds} x {reps}" + (" (cut to the share)" if cut else "")
        settle(fig)


@dataclass
class Section:
    """A timed section: ``build()`` declares its figures (so a section not run still has its rows) and returns
    the callable that measures them."""
    name: str
    estimate_s: float                     # seconds on one H100 at its plan: inputs, compiles, peers, the rounds
    build: Callable[[], Callable[[], None]]
    plan: Optional[tuple[int, int]] = None  # at most these rounds x calls (the slow sections)


def run_sections(sections: list[Section], end: float, rounds: int, reps: int, clock=time.monotonic) -> list[dict]:
    """Each section in order until ``end`` (a ``clock`` time): its share is the time left times its estimate over
    the estimates of the sections not yet run; with less than SKIP_BELOW of its estimate left it is skipped, its
    figures NOT_RUN. A section that raises marks its figures without a value with the error; the next one runs.
    Returns one row per section (estimate, share, seconds, status), also kept in the results files."""
    rows = []
    if REPORT is not None:
        REPORT.res["sections"] = rows
    built = []
    for sec in sections:
        before = set(FIGURES)
        measure = sec.build()
        built.append((sec, measure, [n for n in FIGURES if n not in before]))
        rows.append({"section": sec.name, "estimate_s": sec.estimate_s, "share_s": None, "seconds": None,
                     "status": "not started"})
    save()
    for i, ((sec, measure, names), row) in enumerate(zip(built, rows, strict=True)):
        now = clock()
        left = end - now
        if left < SKIP_BELOW * sec.estimate_s:
            for n in names:
                FIGURES[n].status = NOT_RUN
            row["status"] = NOT_RUN
            log(f"section {sec.name}: {NOT_RUN}, {max(left, 0):.0f} s left of the timings' budget "
                f"(estimate {sec.estimate_s:.0f} s)")
            save()
            continue
        share = left * sec.estimate_s / sum(s.estimate_s for s, _, _ in built[i:])
        PLAN.section_end = time.monotonic() + share
        PLAN.rounds, PLAN.reps = (min(rounds, sec.plan[0]), min(reps, sec.plan[1])) if sec.plan else (rounds, reps)
        row.update(share_s=round(share, 1), status="running")
        log(f"section {sec.name}: start at {now - T_START:.0f} s, share {share:.0f} s of {left:.0f} s left "
            f"(estimate {sec.estimate_s:.0f} s), {PLAN.rounds} x {PLAN.reps} asked")
        save()
        try:
            measure()
            row["status"] = "done"
        except Exception as exc:  # noqa: BLE001 - the section's figures get the error; the next section runs
            msg = f"{type(exc).__name__}: {str(exc)[:300]}"
            for n in names:
                f = FIGURES[n]
                if not f.rounds and not f.error:
                    f.error = msg
            row["status"] = f"error: {msg}"
            log(traceback.format_exc()[-2000:])
        except BaseException:
            row["status"] = "interrupted"
            raise
        finally:
            row["seconds"] = round(clock() - now, 1)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            log(f"section {sec.name}: {row['status']}, {row['seconds']} s")
            save()
    return rows


# ---------------------------------------------------------------- helpers of the sections

def lp_errors(hidden, weight, labels, out, rows=CHECK_ROWS) -> tuple[float, float]:
    """max |log-prob| and |entropy| error of ``out`` on the first ``rows`` tokens against float64."""
    n = min(rows, hidden.shape[0])
    logp = torch.log_softmax(hidden[:n].double() @ weight.double().t(), -1)
    lp = logp.gather(1, labels[:n, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return (float((out.logprobs[:n].double() - lp).abs().max()), float((out.entropy[:n].double() - ent).abs().max()))


def head_inputs(n, h, v, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    hidden, weight = random_head(n, h, v, dtype, dev, g)
    labels = sample_labels(hidden, weight, 1.0, g)
    a, b = torch.randn(n, device=dev, generator=g), torch.randn(n, device=dev, generator=g)
    return hidden, weight, labels, a, b


def fwd_bwd(fn, hidden, weight, labels, a, b):
    """A step of sum(a * logprob) + sum(b * entropy) through ``fn`` (peers' convention), gradients to both."""
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def step():
        h.grad = w.grad = None
        lp, ent = fn(h, w, labels, 1.0)
        loss = (lp * a).sum() + ((ent * b).sum() if ent is not None else 0.0)
        loss.backward()
    return step


def ours(h, w, y, t, **kw):
    out = fused_logprobs(h, w, y, temperature=t, **kw)
    return out.logprobs, out.entropy


def peer(name, dev, fig: Figure):
    """A peer's callable, or None where it cannot run here (the reason in the log and in its figure's note)."""
    try:
        return peers.get(name).build(dev)
    except peers.Unavailable as exc:
        log(f"peer {name}: {exc}")
        fig.note = f"not run here: {exc}"
        settle(fig)
        return None


def backend_note(_out) -> str:
    return f"backend {last_backend()}"


def precision_note(_out) -> str:
    return f"precision {last_precision().statistics}"


CUDA_ONLY = "CUDA's allocator statistics only"
# ---------------------------------------------------------------- the sections (each declares its figures and
# returns the callable that measures them)

def head(tag, shape, dev, with_peers, checks):
    """fused_logprobs forward and forward+backward against 1 and 4 cuBLAS GEMMs; TRL's head beside it."""
    n, h, v = shape
    s = f"{n}x{h}x{v} bf16"
    fwd = figure(f"head {tag}: forward", s, 1.05)
    fb = figure(f"head {tag}: forward+backward", s, 1.05)
    trl = figure(f"head {tag}: TRL ChunkedLogProbFunction fwd+bwd", s, None) if with_peers else None
    errs = (figure(f"head {tag}: log-prob error vs float64", s, 1e-4, "err"),
            figure(f"head {tag}: entropy error vs float64", s, 1e-4, "err")) if checks else None

    def measure():
        hidden, weight, labels, a, b = head_inputs(n, h, v, torch.bfloat16, dev)
        floor = GemmFloor(hidden, weight)

        def forward():
            with torch.no_grad():
                return fused_logprobs(hidden, weight, labels)
        alternate(dev, floor.forward, [(fwd, forward, backend_note)], part=0.2)
        entries = [(fb, fwd_bwd(ours, hidden, weight, labels, a, b))]
        if trl is not None:
            fn = peer("trl-head", dev, trl)
            if fn is not None:
                entries.append((trl, fwd_bwd(fn, hidden, weight, labels, a, b)))
        alternate(dev, floor.forward_backward, entries, part=0.9)
        floor.close()
        if errs:
            lp_err, ent_err = lp_errors(hidden, weight, labels, fused_logprobs(hidden, weight, labels))
            put(errs[0], lp_err)
            put(errs[1], ent_err)
    return measure


def policy(shape, dev):
    """fused_policy_loss (PPO clip 0.2 / 0.28, k3 KL 0.01, entropy bonus 0.01, token-mean, 12% prompt tokens)
    forward+backward against the 4-GEMM floor."""
    b, s_len, h, v = shape
    s = f"{b}x{s_len} tokens, H {h}, V {v} bf16"
    fig = figure("policy loss: forward+backward", s, 0.75)

    def measure():
        hidden, weight, labels, _, _ = head_inputs(b * s_len, h, v, torch.bfloat16, dev)
        g = torch.Generator(device=dev).manual_seed(1)
        labels = labels.view(b, s_len).clone()
        labels[:, : s_len // 8] = -100
        with torch.no_grad():
            base = fused_logprobs(hidden.view(b, s_len, h), weight, labels, with_entropy=False).logprobs
        # log-probabilities near the policy's own (ratios near 1, some clipped), kept <= 0
        old = (base + 0.05 * torch.randn(base.shape, device=dev, generator=g)).clamp(max=-1e-6)
        ref = (base + 0.05 * torch.randn(base.shape, device=dev, generator=g)).clamp(max=-1e-6)
        adv = torch.randn(b, 1, device=dev, generator=g)
        hd, wd = hidden.view(b, s_len, h).detach().requires_grad_(), weight.detach().requires_grad_()

        def step():
            hd.grad = wd.grad = None
            fused_policy_loss(hd, wd, labels, adv, old, ref_logprobs=ref, kl_coef=0.01,
                              entropy_coef=0.01).loss.backward()
        floor = GemmFloor(hidden, weight)
        alternate(dev, floor.forward_backward, [(fig, step, backend_note)])
        floor.close()
    return measure


def fp32_head(shape, dev):
    """float32 operands (the CUDA default precision): forward against the bf16 GEMM, forward+backward against the
    bf16 4-GEMM floor, errors against float64 of the float32 operands; cuBLAS TF32 / IEEE beside them."""
    n, h, v = shape
    s = f"{n}x{h}x{v} float32"
    fwd = figure("float32 head: forward (x bf16 GEMM)", s, 3.2)
    fb = figure("float32 head: forward+backward (x bf16 4-GEMM)", s, 2.2)
    tf32 = figure("float32 head: cuBLAS TF32 GEMM (x bf16 GEMM)", s, None)
    errs = (figure("float32 head: log-prob error vs float64", s, 1e-4, "err"),
            figure("float32 head: entropy error vs float64", s, 1e-4, "err"))
    # hidden states of a bf16 backbone made float32 (TRL's cast_lm_head_to_fp32): two products suffice
    two = figure("float32 head, bf16-exact hidden: forward (x bf16 GEMM)", s, 2.3)
    two_fb = figure("float32 head, bf16-exact hidden: fwd+bwd (x bf16 4-GEMM)", s, 1.8)
    # the same products from the concatenated bfloat16 copies (LOGITLESS_SPLIT_IN_KERNEL=0) in the same rounds:
    # which of the two ways is faster on this machine, and by how much
    copies = figure("float32 head, split copies: forward (x bf16 GEMM)", s, None)
    copies_fb = figure("float32 head, split copies: fwd+bwd (x bf16 4-GEMM)", s, None)

    def from_copies(fn):
        def run():
            with env_set(LOGITLESS_SPLIT_IN_KERNEL="0"):
                return fn()
        return run

    def measure():
        hidden, weight, labels, a, b = head_inputs(n, h, v, torch.float32, dev)
        hb, wb = hidden.bfloat16(), weight.bfloat16()
        floor = GemmFloor(hb, wb)

        def forward():
            with torch.no_grad():
                return fused_logprobs(hidden, weight, labels)
        z = torch.empty(n, v, device=dev, dtype=torch.float32)

        def tf32_mm():
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                torch.mm(hidden, weight.t(), out=z)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False
        if dev != "cuda":
            tf32.note = "CUDA only"
        alternate(dev, floor.forward, [(fwd, forward, precision_note), (copies, from_copies(forward), precision_note)]
                  + ([(tf32, tf32_mm)] if dev == "cuda" else []), part=0.25)
        z.resize_(0)
        step = fwd_bwd(ours, hidden, weight, labels, a, b)
        alternate(dev, floor.forward_backward, [(fb, step), (copies_fb, from_copies(step))], part=0.4)
        lp_err, ent_err = lp_errors(hidden, weight, labels, fused_logprobs(hidden, weight, labels))
        put(errs[0], lp_err)
        put(errs[1], ent_err)
        hidden.copy_(hidden.bfloat16().float())
        alternate(dev, floor.forward, [(two, forward, precision_note)], part=0.3)
        alternate(dev, floor.forward_backward, [(two_fb, fwd_bwd(ours, hidden, weight, labels, a, b))])
        floor.close()
    return measure


def distillation(shape, dev, with_peers):
    """fused_distillation_loss ("jsd", beta 0.5) forward+backward against the dense 4-GEMM floor (teacher forward,
    student forward, d_hidden, d_weight), TRL's and Liger's beside it; memory over the gradients; the loss error
    against float64 on one sequence, logitless' against TRL's float32."""
    b, s_len, h, v = shape
    s = f"{b}x{s_len} tokens, H {h}, V {v} bf16"
    fig = figure("distillation jsd: forward+backward (x dense 4-GEMM)", s, 1.0)
    mem = figure("distillation jsd: GiB over the gradients", s, 1.5, "GiB")
    trl_name = "TRL ChunkedDivergenceFunction (beta 0.5)"
    peer_figs = {name: figure(f"distillation jsd: {name} (x dense 4-GEMM)", s, None)
                 for name in (trl_name, "Liger LigerFusedLinearJSD")} if with_peers else {}
    err = figure("distillation jsd: loss rel error vs float64", s, None, "err")

    def measure():
        import gpu_distillation as gd
        data = gd.inputs(dict(b=b, s=s_len, h=h, ht=h, v=v, prompt=s_len // 8), dev, torch.bfloat16)
        floor = gd.Floor(*data[:4])
        methods = gd.methods("jsd", extra=False)
        entries = [(fig, gd.step_of(methods["logitless (triton)"], data)[0], backend_note)]
        for name, f in peer_figs.items():
            if callable(methods.get(name)):
                entries.append((f, gd.step_of(methods[name], data)[0]))
            else:
                log(f"peer {name}: {methods.get(name)}")
                f.note = f"not run here: {methods.get(name)}"
                settle(f)
        alternate(dev, floor, entries, part=0.85)
        del floor
        if dev == "cuda":
            torch.cuda.empty_cache()
            step, (hh, ww) = gd.step_of(methods["logitless (triton)"], data)
            grads = (hh.numel() * hh.element_size() + ww.numel() * ww.element_size())
            peak, _ = peak_extra_bytes(step, dev)
            put(mem, (peak - grads) / GIB)
        else:
            mem.note = CUDA_ONLY
        small = (data[0][:s_len], data[1], data[2][:s_len], data[3], data[4][:1])
        truth = gd.truth64(*small, 0.5)
        if callable(methods.get(trl_name)):
            theirs = gd.accuracy("trl", methods[trl_name], small, 0.5, truth)["loss_rel_err"]
            err.target = max(theirs, 1e-7)
            err.note = f"target: TRL float32's {theirs:.1e}"
        put(err, gd.accuracy("ours", methods["logitless (triton)"], small, 0.5, truth)["loss_rel_err"])
    return measure


def topk(shape, dev, k_values=(32, 128)):
    """fused_topk against the forward GEMM; forward_kl_topk (overlap diagnostics on) and its tail variant against
    the student's 4-GEMM floor; the tail variant's memory over the gradients."""
    n, h, v = shape
    s = f"{n}x{h}x{v} bf16"
    figs = [figure(f"fused_topk k={k}: forward (x GEMM)", s, 1.10) for k in k_values]
    kl = figure("forward_kl_topk k=32, overlap on: fwd+bwd (x 4-GEMM)", s, 0.80)
    tail = figure("forward_kl_topk_tail k=32: fwd+bwd (x 4-GEMM)", s, 0.85)
    tail_mem = figure("forward_kl_topk_tail k=32: GiB over the gradients", s, 1.5, "GiB")

    def measure():
        from logitless.losses import fused_distillation_loss
        k_small = min(32, v // 4)
        g = torch.Generator(device=dev).manual_seed(0)
        hidden, weight = random_head(n, h, v, torch.bfloat16, dev, g)
        scored = torch.rand(n, device=dev, generator=g) > 0.12
        floor = GemmFloor(hidden, weight)
        entries = []
        for fig, k in zip(figs, k_values, strict=True):
            kk = min(k, v // 2)
            entries.append((fig, lambda kk=kk: fused_topk(hidden, weight, kk, mask=scored), backend_note))
        alternate(dev, floor.forward, entries, part=0.15)
        t_weight = (weight.float() + 0.5 * weight.float().std() * torch.randn(weight.shape, device=dev, generator=g))
        with torch.no_grad():
            teacher = fused_topk(hidden, t_weight.to(torch.bfloat16), k_small, mask=scored)
        del t_weight
        labels = torch.where(scored, 0, -100)
        t_ids = torch.where(scored[:, None], teacher.ids, torch.arange(k_small, device=dev))
        t_lp = teacher.logprobs.detach()
        hd, wd = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

        def step(name):
            # fused_distillation_loss (token-mean): forward_kl_topk's one-pass route; the tail variant runs
            # topk_divergence's route inside it
            def run_step():
                hd.grad = wd.grad = None
                fused_distillation_loss(hd, wd, labels, divergence=name, teacher_topk_ids=t_ids,
                                        teacher_topk_logprobs=t_lp, log_prob_min_clamp=-10.0).loss.backward()
            return run_step
        alternate(dev, floor.forward_backward, [(kl, step("forward_kl_topk")), (tail, step("forward_kl_topk_tail"))],
                  part=0.9)
        floor.close()
        if dev == "cuda":
            torch.cuda.empty_cache()
            grads = hd.numel() * hd.element_size() + wd.numel() * wd.element_size()
            # the timed calls' gradients freed first: the peak is then counted above the inputs alone (with them
            # still held, the step's freeing them offset its own gradient buffers, and the figure came out < 0)
            hd.grad = wd.grad = None
            peak, _ = peak_extra_bytes(step("forward_kl_topk_tail"), dev)
            put(tail_mem, (peak - grads) / GIB)
        else:
            tail_mem.note = CUDA_ONLY
    return measure


def truncation(shape, dev):
    """fused_logprobs under a sampler's truncation (top_k 50, top_p 0.95, min_p 0.05) against the plain head's own
    forward and forward+backward (labels sampled from the head's distribution, so most fall inside the kept set);
    the kept sets' median size in the note."""
    from logitless import Truncation
    n, h, v = shape
    s = f"{n}x{h}x{v} bf16"
    settings = {"top_k=50": Truncation(top_k=50), "top_p=0.95": Truncation(top_p=0.95),
                "min_p=0.05": Truncation(min_p=0.05)}
    targets = {"top_k=50": 1.15, "top_p=0.95": 1.5, "min_p=0.05": 1.15}
    fwd = {k: figure(f"truncation {k}: forward (x plain head forward)", s, targets[k]) for k in settings}
    fb = {k: figure(f"truncation {k}: fwd+bwd (x plain head fwd+bwd)", s, 1.15) for k in settings}

    def kept_note(out) -> str:
        return (f"kept median {int(out.kept_count.float().median())}, label inside "
                f"{float(out.inside.float().mean()):.3f}")

    def measure():
        hidden, weight, labels, a, _ = head_inputs(n, h, v, torch.bfloat16, dev)

        def forward(t=None):
            def call():
                with torch.no_grad():
                    return fused_logprobs(hidden, weight, labels, with_entropy=False, truncation=t)
            return call
        alternate(dev, forward(), [(fwd[k], forward(t), kept_note) for k, t in settings.items()], part=0.3)

        def step(t=None):
            hd, wd = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

            def call():
                hd.grad = wd.grad = None
                out = fused_logprobs(hd, wd, labels, with_entropy=False, truncation=t)
                (out.logprobs * a).sum().backward()
            return call
        alternate(dev, step(), [(fb[k], step(t)) for k, t in settings.items()])
    return measure


def sections(shapes, dev, with_peers) -> list[Section]:
    """The timed sections in the order they run. Estimates: seconds on one H100 at 3 rounds x 5 calls (truncation
    2 x 3), setup, compiles and peers' imports included (the timings of six of them took 87-102 s there on
    2026-12-06; top-k's tail variant and truncation's selections cost about a second a call). They set the
    shares only: a section that ends early leaves its time to the later ones."""
    return [Section("head A", 30, lambda: head("A", shapes["head_a"], dev, with_peers, checks=True)),
            Section("head B", 12, lambda: head("B", shapes["head_b"], dev, False, checks=False)),
            Section("policy loss", 12, lambda: policy(shapes["policy"], dev)),
            Section("float32 head", 25, lambda: fp32_head(shapes["fp32"], dev)),
            Section("distillation", 35, lambda: distillation(shapes["distill"], dev, with_peers)),
            Section("top-k", 40, lambda: topk(shapes["topk"], dev)),
            Section("truncation", 110, lambda: truncation(shapes["truncation"], dev), plan=(2, 3))]


# ---------------------------------------------------------------- the tests

def default_workers() -> int:
    """Test files at once: half the host's CPUs (triton's compiles are CPU work; the float64 references too), at
    most 8 (the files share one GPU, each process its own CUDA context)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


LIVE: set = set()                 # the test processes running now (killed with the call)
LIVE_LOCK = threading.Lock()


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)      # pytest and whatever it started (its own session)
    except (ProcessLookupError, PermissionError):
        pass


def progress(text: str) -> str:
    """The tests a cut-short pytest -q run got through, from its progress lines ('..F.s [ 40%]')."""
    marks = "".join(m.group(1) for m in re.finditer(r"^([.FEsxX]+)\s*(?:\[\s*\d+%\])?\s*$", text, re.M))
    counts = {name: marks.count(c) for c, name in ((".", "passed"), ("F", "failed"), ("E", "error"),
                                                    ("s", "skipped")) if marks.count(c)}
    return ", ".join(f"{v} {k}" for k, v in counts.items()) or "none finished"


def run_tests(end: float, dry: bool, workers: int, clock=time.monotonic) -> list[dict]:
    """One pytest process per GPU test file, ``workers`` at a time, in GPU_TESTS' order, until ``end`` (a
    ``clock`` time): a file started with under 10 s left is "not run (budget)", one cut short "timed out (budget)"
    (with the tests it got through), never passed. Rows in GPU_TESTS' order, saved as each file ends. The dry
    run only collects each file."""
    rows = [{"file": path, "result": "not started"} for path in GPU_TESTS]
    if REPORT is not None:
        REPORT.res["tests"] = rows
    save()
    threads = str(max(1, (os.cpu_count() or 2) // max(1, workers)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, threads)

    def one(row: dict) -> None:
        left = end - clock()
        if left < 10:
            row["result"] = NOT_RUN
            save()
            return
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", row["file"]] + (["--collect-only"]
                                                                                                if dry else [])
        t = time.monotonic()
        row["result"] = "running"
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        with LIVE_LOCK:
            LIVE.add(proc)
        try:
            text, _ = proc.communicate(timeout=left)
            summary = [ln for ln in text.strip().splitlines() if re.search(r"\b(passed|failed|error|collected|"
                                                                             r"no tests ran|skipped)\b", ln)]
            row["result"] = summary[-1].strip("= ") if summary else f"exit {proc.returncode}"
            row["rc"] = proc.returncode
            if proc.returncode not in (0, 5):
                row["tail"] = text[-3000:]
                log(text[-3000:])
        except subprocess.TimeoutExpired:
            _kill(proc)
            text, _ = proc.communicate()
            row["result"], row["rc"] = f"timed out (budget): {progress(text or '')}", None
            row["tail"] = (text or "")[-3000:]
        finally:
            with LIVE_LOCK:
                LIVE.discard(proc)
        row["seconds"] = round(time.monotonic() - t, 1)
        log(f"tests {row['file']}: {row['result']} ({row['seconds']} s)")
        save()

    pool = concurrent.futures.ThreadPoolExecutor(max(1, workers))
    try:
        for fut in [pool.submit(one, row) for row in rows]:
            fut.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        with LIVE_LOCK:
            for proc in list(LIVE):
                _kill(proc)
        raise
    pool.shutdown()
    return rows


# ---------------------------------------------------------------- baseline, table, the results files

def commit_of(given: Optional[str]) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy of the tree without its history
        return os.environ.get("LOGITLESS_COMMIT", "unknown")


def drift(fig: Figure, base: Optional[dict], card: str, commit: str) -> str:
    """'' where no baseline applies, 'steady' within tolerance, else 'moved ... bisect BASE..HEAD'."""
    if not base or fig.median is None or fig.name not in base.get("figures", {}):
        return ""
    if base.get("card") != card:
        return f"baseline card {base.get('card')}: not compared"
    b = base["figures"][fig.name]
    lo, hi = fig.spread
    tol = max(hi - lo, b["max"] - b["min"], 0.02 * abs(b["median"]))
    if fig.unit == "err":          # errors: a move of an order of magnitude, not a spread
        moved = fig.median > 10 * b["median"] or fig.median < b["median"] / 10
    else:
        moved = abs(fig.median - b["median"]) > tol
    if not moved:
        return "steady"
    return f"moved {b['median']:.3g} -> {fig.median:.3g}: bisect {base['commit']}..{commit}"


def table(base, card, commit) -> str:
    rows = []
    for f in FIGURES.values():
        lo, hi = f.spread
        target = "-" if f.target is None else f"<= {fmt(f.target, f.unit)}"
        b = (base or {}).get("figures", {}).get(f.name)
        rows.append([f.name, f.shape, target, fmt(f.median, f.unit),
                     "-" if lo is None else f"{fmt(lo, f.unit)}-{fmt(hi, f.unit)}", f.plan or "-",
                     "-" if not b else fmt(b["median"], f.unit), f.verdict(), drift(f, base, card, commit),
                     (f.error or f.note)[:90]])
    return markdown_table(["figure", "shape", "target", "median", "spread", "rounds x calls", "baseline", "verdict",
                           "drift", "note"], rows)


class Report:
    """The results files OUT/gpu-check.json and .md, rewritten whole (a temporary file renamed over the old) after
    every figure, section and test file: a call killed at any point leaves every finished figure on disk."""

    def __init__(self, out: str, res: dict, base: Optional[dict]):
        self.out, self.res, self.base = out, res, base
        self.lock = threading.Lock()          # the tests step saves from its worker threads

    def figures(self) -> dict:
        card, commit = self.res["card"], self.res["commit"]
        return {f.name: {"shape": f.shape, "target": f.target, "unit": f.unit, "rounds": f.rounds,
                         "median": f.median, "plan": f.plan, "verdict": f.verdict(),
                         "drift": drift(f, self.base, card, commit), "note": f.note, "error": f.error}
                for f in FIGURES.values()}

    def markdown(self) -> str:
        res = self.res
        head = (f"gpu-check {res['date']}, {res['card']}, commit {res['commit']}, torch {res['versions']['torch']}, "
                f"triton {res['versions']['triton']}; {res['rounds']} rounds x {res['reps']} calls asked; budget "
                f"{res['budget_s']:.0f} s; {res['seconds']} s; {res['status']}"
                f"{'; DRY RUN on the CPU: not a measurement' if res['dry_run'] else ''}\n")
        parts = [head]
        if res.get("sections"):
            parts.append("\n" + markdown_table(["section", "estimate s", "share s", "s", "status"],
                                               [[r["section"], f"{r['estimate_s']:.0f}",
                                                 "-" if r["share_s"] is None else f"{r['share_s']:.0f}",
                                                 "-" if r["seconds"] is None else str(r["seconds"]), r["status"]]
                                                for r in res["sections"]]))
        if res.get("tests"):
            parts.append("\n" + markdown_table(["test file", "result", "s"],
                                               [[r["file"], r["result"], str(r.get("seconds", "-"))]
                                                for r in res["tests"]]))
        parts.append("\n" + table(self.base, res["card"], res["commit"]))
        return "".join(parts)

    def save(self) -> None:
        with self.lock:
            self.res["seconds"] = round(time.monotonic() - T_START, 1)
            self.res["figures"] = self.figures()
            for name, text in (("gpu-check.json", json.dumps(self.res, indent=1, default=str)),
                               ("gpu-check.md", self.markdown())):
                path = os.path.join(self.out, name)
                with open(path + ".tmp", "w") as fh:
                    fh.write(text)
                os.replace(path + ".tmp", path)


REPORT: Optional[Report] = None


def save() -> None:
    if REPORT is not None:
        REPORT.save()


def _terminated(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv=None):
    global REPORT
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    p.add_argument("--only", default="tests,timings", help="tests, timings or both (comma-separated)")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for the whole call from the process' start (imports, timings and tests)")
    p.add_argument("--tests-budget", type=float, default=150.0,
                   help="seconds of --budget kept for the tests step (after the timings, which end this much "
                        "before the budget; the tests also get what the timings leave)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--test-workers", type=int, default=default_workers(),
                   help="test files run at once (each its own process)")
    p.add_argument("--baseline", default=os.path.join(HERE, "results", "gpu-check-baseline.json"))
    p.add_argument("--write-baseline", default=None, help="write this run's figures as a baseline to this path")
    p.add_argument("--commit", default=None, help="the code's commit (default: git rev-parse, else unknown)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (--dry-run checks the script on a CPU)")
    dev = "cpu" if dry else "cuda"
    shapes = TINY if dry else FULL
    rounds, reps = (2, 1) if dry else (args.rounds, args.reps)
    steps = set(args.only.split(","))
    commit = commit_of(args.commit)
    card = torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)"
    os.makedirs(args.out, exist_ok=True)
    base = None
    if os.path.exists(args.baseline):
        with open(args.baseline) as fh:
            base = json.load(fh)
    end = T_START + args.budget
    timings_end = end - (args.tests_budget if "tests" in steps else 0.0)
    FIGURES.clear()
    res = {"date": datetime.date.today().isoformat(), "commit": commit, "card": card, "machine": machine(),
           "versions": versions(), "argv": sys.argv if argv is None else argv, "dry_run": dry, "rounds": rounds,
           "reps": reps, "budget_s": args.budget, "tests_budget_s": args.tests_budget,
           "test_workers": args.test_workers, "status": "running"}
    REPORT = Report(args.out, res, base)
    log(f"gpu-check: {card}, commit {commit}, {res['versions']}")
    log(f"budget {args.budget:.0f} s from the start ({time.monotonic() - T_START:.0f} s spent on imports): "
        + (f"timings until {timings_end - T_START:.0f} s, " if "timings" in steps else "")
        + (f"then tests until {args.budget:.0f} s, {args.test_workers} files at once" if "tests" in steps else ""))
    old_term = signal.signal(signal.SIGTERM, _terminated)
    try:
        save()
        if "timings" in steps:
            if dev == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = False
            run_sections(sections(shapes, dev, not args.no_peers), timings_end, rounds, reps)
        if "tests" in steps:
            run_tests(end, dry, args.test_workers)
        res["status"] = "done"
    except BaseException as exc:
        res["status"] = f"killed ({type(exc).__name__} {exc}) at {time.monotonic() - T_START:.0f} s"
        for f in FIGURES.values():
            if not f.rounds and not f.error and not f.status:
                f.status = "not run (killed)"
        for row in res.get("tests", []):
            if row["result"] in ("not started", "running"):
                row["result"] = "not run (killed)" if row["result"] == "not started" else "killed"
        raise
    finally:
        signal.signal(signal.SIGTERM, old_term)
        save()
        REPORT = None
    if args.write_baseline:
        with open(args.write_baseline, "w") as fh:
            json.dump({"card": card, "commit": commit, "date": res["date"], "versions": res["versions"],
                       "figures": {f.name: {"median": f.median, "min": f.spread[0], "max": f.spread[1]}
                                   for f in FIGURES.values() if f.median is not None}}, fh, indent=1)
    log(Report(args.out, res, base).markdown())
    skipped = [f.name for f in FIGURES.values() if f.status == NOT_RUN]
    if skipped:
        log(f"{len(skipped)} figures not run (budget): {', '.join(skipped)}")
    failed = [r for r in res.get("tests", []) if r.get("rc") not in (0, 5, None) or "timed out" in r["result"]]
    # a peer that cannot run is its row's note; a figure of logitless' own that fails fails the check
    return 1 if failed or any(f.error and f.target is not None for f in FIGURES.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
