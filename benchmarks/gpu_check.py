"""Every GPU claim of logitless re-checked in one call: the GPU-only tests, then a short timing of each headline
figure against the cuBLAS floor (and the installed peers) in this process, one table with each target beside its
figure, compared with a committed baseline of the same shapes.

    make gpu-check                                    # on a machine with one CUDA GPU, torch and triton
    PYTHONPATH=src python3 benchmarks/gpu_check.py [--out DIR] [--only tests,timings] [--rounds 3]
        [--baseline benchmarks/results/gpu-check-baseline.json] [--write-baseline PATH] [--commit REV] [--dry-run]

1. Tests: the suite's GPU-only files (compiled kernels, CUDA graphs, batch invariance, TF32 / split precisions,
   Gluon, streams, the distillation and top-k kernels), one pytest process per file (``--test-workers`` at once),
   within ``--tests-budget``
   seconds; a file the budget did not reach is reported as not run, never as passed.
2. Timings (docs/performance.md's shapes, bf16 unless named): each figure is the ratio of logitless' time to its
   floor, both timed in ``--rounds`` alternating rounds (floor, logitless, peers; median of ``--reps`` CUDA-event
   timed calls each), reported as the median ratio and its spread (min-max) over the rounds; errors against
   float64 on a slice of the tokens; peak memory over the gradient buffers.
3. Each figure against its target (pass / miss) and against the baseline (same card name): a move beyond the larger
   of the two runs' spreads and 2% of the baseline is flagged "moved", with the commit range to bisect.
Writes OUT/gpu-check.json and OUT/gpu-check.md and prints the table last (one H100: about 6 minutes).
--dry-run: every step on tiny shapes on the CPU (triton's interpreter, wall clock; the tests step only collects):
a check of the script, run in CI, not a measurement.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

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
    markdown_table,
    peak_extra_bytes,
    random_head,
    sample_labels,
    time_calls,
)
from logitless.tools.machine import machine, versions  # noqa: E402

# The suite's files whose subject needs a GPU (each also runs on the CPU, where their GPU cases skip), in the
# order the budget reaches them: what only a GPU can test first (CUDA graphs, torch.compile of the kernels, Gluon,
# batch invariance of the compiled kernels, streams), then the compiled kernels against float64.
GPU_TESTS = ("tests/test_compile_and_graphs.py", "tests/losses/test_distillation_unchecked.py",
             "tests/ops/test_policy_stats_gluon.py", "tests/ops/test_batch_invariance.py",
             "tests/ops/test_topk_select.py", "tests/test_truncation.py", "tests/ops/test_distill_chunk_kernels.py",
             "tests/test_contexts.py",
             "tests/ops/test_triton_backend.py", "tests/test_precision.py", "tests/ops/test_tail_gradient.py",
             "tests/ops/test_tail_dlogits.py", "tests/ops/test_label_sets.py", "tests/losses/test_distill_topk.py",
             "tests/losses/test_distill_topk_degenerate.py", "tests/ops/test_stages.py",
             "tests/ops/test_chunked_columns.py", "tests/ops/test_token_chunks.py",
             "tests/ops/test_triton_policy_kernels.py", "tests/losses/test_policy_loss.py",
             "tests/losses/test_policy_losses.py")
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
            return "-"
        if self.target is None:
            return "info"
        return "pass" if self.median <= self.target else "miss"


FIGURES: dict[str, Figure] = {}


def figure(name, shape, target, unit="x") -> Figure:
    FIGURES[name] = f = Figure(name, shape, target, unit)
    return f


def median_ms(fn, dev, reps) -> float:
    times = sorted(time_calls(fn, dev, reps=reps, warmup=1))
    return times[len(times) // 2]


def alternate(dev, rounds, reps, floor: Callable, entries: list[tuple[Figure, Callable]]) -> None:
    """``rounds`` rounds of (floor, each entry): each entry's figure gets one ratio a round (its median over the
    round's floor median). The first call of each is a warm-up (triton compiles, cuBLAS picks its kernels)."""
    for fig, fn in entries:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a failing entry is a row with its error; the others still run
            fig.error = f"{type(exc).__name__}: {str(exc)[:300]}"
            log(traceback.format_exc()[-1500:])
    live = [(f, fn) for f, fn in entries if not f.error]
    for _ in range(rounds):
        base = median_ms(floor, dev, reps)
        for fig, fn in live:
            fig.rounds.append(median_ms(fn, dev, reps) / base)


def guarded(fig_names: list[str]):
    """Run a section; an exception marks its figures failed (with the error) and the next section still runs."""
    def wrap(section):
        def run(*a, **kw):
            try:
                section(*a, **kw)
            except Exception as exc:  # noqa: BLE001
                for n in fig_names:
                    f = FIGURES.get(n)
                    if f is not None and not f.rounds:
                        f.error = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(traceback.format_exc()[-2000:])
            finally:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        return run
    return wrap


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


def peer(name, dev):
    """A peer's callable, or None (with the reason logged) where it cannot run here."""
    try:
        return peers.get(name).build(dev)
    except peers.Unavailable as exc:
        log(f"peer {name}: {exc}")
        return None


# ---------------------------------------------------------------- the sections

def head(tag, shape, dev, rounds, reps, with_peers, checks):
    """fused_logprobs forward and forward+backward against 1 and 4 cuBLAS GEMMs; TRL's head beside it."""
    n, h, v = shape
    s = f"{n}x{h}x{v} bf16"
    fwd = figure(f"head {tag}: forward", s, 1.05)
    fb = figure(f"head {tag}: forward+backward", s, 1.05)

    @guarded([fwd.name, fb.name])
    def run():
        hidden, weight, labels, a, b = head_inputs(n, h, v, torch.bfloat16, dev)
        floor = GemmFloor(hidden, weight)

        def forward():
            with torch.no_grad():
                return fused_logprobs(hidden, weight, labels)
        alternate(dev, rounds, reps, floor.forward, [(fwd, forward)])
        fwd.note = f"backend {last_backend()}"
        entries = [(fb, fwd_bwd(ours, hidden, weight, labels, a, b))]
        if with_peers:
            trl = peer("trl-head", dev)
            if trl is not None:
                entries.append((figure(f"head {tag}: TRL ChunkedLogProbFunction fwd+bwd", s, None),
                                fwd_bwd(trl, hidden, weight, labels, a, b)))
        alternate(dev, rounds, reps, floor.forward_backward, entries)
        floor.close()
        if checks:
            lp_err, ent_err = lp_errors(hidden, weight, labels, fused_logprobs(hidden, weight, labels))
            figure(f"head {tag}: log-prob error vs float64", s, 1e-4, "err").rounds = [lp_err]
            figure(f"head {tag}: entropy error vs float64", s, 1e-4, "err").rounds = [ent_err]
    run()


def policy(shape, dev, rounds, reps):
    """fused_policy_loss (PPO clip 0.2 / 0.28, k3 KL 0.01, entropy bonus 0.01, token-mean, 12% prompt tokens)
    forward+backward against the 4-GEMM floor."""
    b, s_len, h, v = shape
    s = f"{b}x{s_len} tokens, H {h}, V {v} bf16"
    fig = figure("policy loss: forward+backward", s, 0.75)

    @guarded([fig.name])
    def run():
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
        alternate(dev, rounds, reps, floor.forward_backward, [(fig, step)])
        fig.note = f"backend {last_backend()}"
        floor.close()
    run()


def fp32_head(shape, dev, rounds, reps):
    """float32 operands (the CUDA default precision): forward against the bf16 GEMM, forward+backward against the
    bf16 4-GEMM floor, errors against float64 of the float32 operands; cuBLAS TF32 / IEEE beside them."""
    n, h, v = shape
    s = f"{n}x{h}x{v} float32"
    fwd = figure("float32 head: forward (x bf16 GEMM)", s, 3.2)
    fb = figure("float32 head: forward+backward (x bf16 4-GEMM)", s, 2.2)
    tf32 = figure("float32 head: cuBLAS TF32 GEMM (x bf16 GEMM)", s, None)

    @guarded([fwd.name, fb.name, "float32 head, bf16-exact hidden: forward (x bf16 GEMM)",
              "float32 head, bf16-exact hidden: fwd+bwd (x bf16 4-GEMM)"])
    def run():
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
        alternate(dev, rounds, reps, floor.forward, [(fwd, forward)] + ([(tf32, tf32_mm)] if dev == "cuda" else []))
        z.resize_(0)
        fwd.note = f"precision {last_precision().statistics}"
        alternate(dev, rounds, reps, floor.forward_backward, [(fb, fwd_bwd(ours, hidden, weight, labels, a, b))])
        lp_err, ent_err = lp_errors(hidden, weight, labels, fused_logprobs(hidden, weight, labels))
        figure("float32 head: log-prob error vs float64", s, 1e-4, "err").rounds = [lp_err]
        figure("float32 head: entropy error vs float64", s, 1e-4, "err").rounds = [ent_err]
        # hidden states of a bf16 backbone made float32 (TRL's cast_lm_head_to_fp32): two products suffice
        hidden.copy_(hidden.bfloat16().float())
        two = figure("float32 head, bf16-exact hidden: forward (x bf16 GEMM)", s, 2.3)
        alternate(dev, rounds, reps, floor.forward, [(two, forward)])
        two.note = f"precision {last_precision().statistics}"
        two_fb = figure("float32 head, bf16-exact hidden: fwd+bwd (x bf16 4-GEMM)", s, 1.8)
        alternate(dev, rounds, reps, floor.forward_backward, [(two_fb, fwd_bwd(ours, hidden, weight, labels, a, b))])
        floor.close()
    run()


def distillation(shape, dev, rounds, reps, with_peers):
    """fused_distillation_loss ("jsd", beta 0.5) forward+backward against the dense 4-GEMM floor (teacher forward,
    student forward, d_hidden, d_weight), TRL's and Liger's beside it; memory over the gradients; the loss error
    against float64 on one sequence, logitless' against TRL's float32."""
    import gpu_distillation as gd
    b, s_len, h, v = shape
    s = f"{b}x{s_len} tokens, H {h}, V {v} bf16"
    fig = figure("distillation jsd: forward+backward (x dense 4-GEMM)", s, 1.0)
    mem = figure("distillation jsd: GiB over the gradients", s, 1.5, "GiB")

    @guarded([fig.name, mem.name])
    def run():
        data = gd.inputs(dict(b=b, s=s_len, h=h, ht=h, v=v, prompt=s_len // 8), dev, torch.bfloat16)
        floor = gd.Floor(*data[:4])
        methods = gd.methods("jsd", extra=False)
        trl_name = "TRL ChunkedDivergenceFunction (beta 0.5)"
        entries = [(fig, gd.step_of(methods["logitless (triton)"], data)[0])]
        if with_peers:
            for name in (trl_name, "Liger LigerFusedLinearJSD"):
                if callable(methods.get(name)):
                    entries.append((figure(f"distillation jsd: {name} (x dense 4-GEMM)", s, None),
                                    gd.step_of(methods[name], data)[0]))
                else:
                    log(f"peer {name}: {methods.get(name)}")
        alternate(dev, rounds, reps, floor, entries)
        fig.note = f"backend {last_backend()}"
        del floor
        if dev == "cuda":
            torch.cuda.empty_cache()
            step, (hh, ww) = gd.step_of(methods["logitless (triton)"], data)
            grads = (hh.numel() * hh.element_size() + ww.numel() * ww.element_size())
            peak, _ = peak_extra_bytes(step, dev)
            mem.rounds = [(peak - grads) / GIB]
        small = (data[0][:s_len], data[1], data[2][:s_len], data[3], data[4][:1])
        truth = gd.truth64(*small, 0.5)
        err = gd.accuracy("ours", methods["logitless (triton)"], small, 0.5, truth)["loss_rel_err"]
        figure("distillation jsd: loss rel error vs float64", s, None, "err").rounds = [err]
        if callable(methods.get(trl_name)):
            theirs = gd.accuracy("trl", methods[trl_name], small, 0.5, truth)["loss_rel_err"]
            FIGURES["distillation jsd: loss rel error vs float64"].target = max(theirs, 1e-7)
            FIGURES["distillation jsd: loss rel error vs float64"].note = f"target: TRL float32's {theirs:.1e}"
    run()


def topk(shape, dev, rounds, reps, k_values=(32, 128)):
    """fused_topk against the forward GEMM; forward_kl_topk (overlap diagnostics on) and its tail variant against
    the student's 4-GEMM floor; the tail variant's memory over the gradients."""
    from logitless.losses.distill_topk import topk_divergence
    n, h, v = shape
    s = f"{n}x{h}x{v} bf16"
    figs = [figure(f"fused_topk k={k}: forward (x GEMM)", s, 1.10) for k in k_values]
    kl = figure("forward_kl_topk k=32, overlap on: fwd+bwd (x 4-GEMM)", s, 0.80)
    tail = figure("forward_kl_topk_tail k=32: fwd+bwd (x 4-GEMM)", s, 0.85)
    tail_mem = figure("forward_kl_topk_tail k=32: GiB over the gradients", s, 1.5, "GiB")

    @guarded([f.name for f in figs] + [kl.name, tail.name, tail_mem.name])
    def run():
        k_small = min(32, v // 4)
        g = torch.Generator(device=dev).manual_seed(0)
        hidden, weight = random_head(n, h, v, torch.bfloat16, dev, g)
        scored = torch.rand(n, device=dev, generator=g) > 0.12
        floor = GemmFloor(hidden, weight)
        entries = []
        for fig, k in zip(figs, k_values, strict=True):
            kk = min(k, v // 2)
            entries.append((fig, lambda kk=kk: fused_topk(hidden, weight, kk, mask=scored)))
        alternate(dev, rounds, reps, floor.forward, entries)
        for fig in figs:
            fig.note = f"backend {last_backend()}"
        t_weight = (weight.float() + 0.5 * weight.float().std() * torch.randn(weight.shape, device=dev, generator=g))
        with torch.no_grad():
            teacher = fused_topk(hidden, t_weight.to(torch.bfloat16), k_small, mask=scored)
        del t_weight
        labels = torch.where(scored, 0, -100)
        t_ids = torch.where(scored[:, None], teacher.ids, torch.arange(k_small, device=dev))
        t_lp = teacher.logprobs.detach()
        hd, wd = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

        def step(name):
            def run_step():
                hd.grad = wd.grad = None
                d = topk_divergence(hd, wd, labels, t_ids, t_lp, divergence=name, log_prob_min_clamp=-10.0)
                (d.divergence.sum() / scored.sum()).backward()
            return run_step
        alternate(dev, rounds, reps, floor.forward_backward,
                  [(kl, step("forward_kl_topk")), (tail, step("forward_kl_topk_tail"))])
        floor.close()
        if dev == "cuda":
            torch.cuda.empty_cache()
            grads = hd.numel() * hd.element_size() + wd.numel() * wd.element_size()
            peak, _ = peak_extra_bytes(step("forward_kl_topk_tail"), dev)
            tail_mem.rounds = [(peak - grads) / GIB]
    run()


def truncation(shape, dev, rounds, reps):
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

    @guarded([f.name for f in list(fwd.values()) + list(fb.values())])
    def run():
        hidden, weight, labels, a, _ = head_inputs(n, h, v, torch.bfloat16, dev)

        def forward(t=None):
            def call():
                with torch.no_grad():
                    return fused_logprobs(hidden, weight, labels, with_entropy=False, truncation=t)
            return call
        alternate(dev, rounds, reps, forward(), [(fwd[k], forward(t)) for k, t in settings.items()])
        for k, t in settings.items():
            out = forward(t)()
            fwd[k].note = (f"kept median {int(out.kept_count.float().median())}, label inside "
                           f"{float(out.inside.float().mean()):.3f}")

        def step(t=None):
            hd, wd = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

            def call():
                hd.grad = wd.grad = None
                out = fused_logprobs(hd, wd, labels, with_entropy=False, truncation=t)
                (out.logprobs * a).sum().backward()
            return call
        alternate(dev, rounds, reps, step(), [(fb[k], step(t)) for k, t in settings.items()])
    run()


# ---------------------------------------------------------------- the tests

def run_tests(budget_s: float, dry: bool, workers: int) -> list[dict]:
    """One pytest process per GPU test file, ``workers`` at a time (triton's compiles are CPU work; the files share
    the GPU), until ``budget_s`` is spent: a file started too late is "not run (budget)", one cut short "timed out
    (budget)", never passed. The dry run only collects each file."""
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), os.path.join(ROOT, "tests"),
                                                       os.environ.get("PYTHONPATH", "")]))

    def one(path: str) -> dict:
        left = budget_s - (time.monotonic() - t0)
        row = {"file": path}
        if left < 10:
            row["result"] = "not run (budget)"
            return row
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path] + (["--collect-only"] if dry
                                                                                          else [])
        t = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            text = p.stdout + p.stderr
            summary = [ln for ln in text.strip().splitlines() if re.search(r"\b(passed|failed|error|collected|"
                                                                             r"no tests ran|skipped)\b", ln)]
            row["result"] = summary[-1].strip("= ") if summary else f"exit {p.returncode}"
            row["rc"] = p.returncode
            if p.returncode not in (0, 5):
                row["tail"] = text[-3000:]
                log(text[-3000:])
        except subprocess.TimeoutExpired:
            row["result"], row["rc"] = "timed out (budget)", None
        row["seconds"] = round(time.monotonic() - t, 1)
        log(f"tests {path}: {row['result']} ({row['seconds']} s)")
        return row

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(one, GPU_TESTS))


# ---------------------------------------------------------------- baseline, table

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


def fmt(x: Optional[float], unit: str) -> str:
    if x is None:
        return "-"
    return f"{x:.1e}" if unit == "err" else f"{x:.3f}" if unit == "x" else f"{x:.2f}"


def table(base, card, commit) -> str:
    rows = []
    for f in FIGURES.values():
        lo, hi = f.spread
        target = "-" if f.target is None else f"<= {fmt(f.target, f.unit)}"
        b = (base or {}).get("figures", {}).get(f.name)
        rows.append([f.name, f.shape, target, fmt(f.median, f.unit),
                     "-" if lo is None else f"{fmt(lo, f.unit)}-{fmt(hi, f.unit)}",
                     "-" if not b else fmt(b["median"], f.unit), f.verdict(), drift(f, base, card, commit),
                     (f.error or f.note)[:90]])
    return markdown_table(["figure", "shape", "target", "median", "spread", "baseline", "verdict", "drift", "note"],
                          rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out")
    p.add_argument("--only", default="tests,timings", help="tests, timings or both (comma-separated)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--tests-budget", type=float, default=240.0, help="seconds for the tests step")
    p.add_argument("--test-workers", type=int, default=4, help="test files run at once (each its own process)")
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
    res = {"date": datetime.date.today().isoformat(), "commit": commit, "card": card, "machine": machine(),
           "versions": versions(), "argv": sys.argv if argv is None else argv, "dry_run": dry}
    log(f"gpu-check: {card}, commit {commit}, {res['versions']}")
    t0 = time.monotonic()
    if "tests" in steps:
        res["tests"] = run_tests(args.tests_budget, dry, args.test_workers)
    if "timings" in steps:
        if dev == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
        with_peers = not args.no_peers
        head("A", shapes["head_a"], dev, rounds, reps, with_peers, checks=True)
        head("B", shapes["head_b"], dev, rounds, reps, False, checks=False)
        policy(shapes["policy"], dev, rounds, reps)
        fp32_head(shapes["fp32"], dev, rounds, reps)
        distillation(shapes["distill"], dev, rounds, reps, with_peers)
        topk(shapes["topk"], dev, rounds, reps)
        truncation(shapes["truncation"], dev, rounds, reps)
    res["seconds"] = round(time.monotonic() - t0, 1)
    base = None
    if os.path.exists(args.baseline):
        with open(args.baseline) as fh:
            base = json.load(fh)
    res["figures"] = {f.name: {"shape": f.shape, "target": f.target, "unit": f.unit, "rounds": f.rounds,
                               "median": f.median, "verdict": f.verdict(), "drift": drift(f, base, card, commit),
                               "note": f.note, "error": f.error} for f in FIGURES.values()}
    text = table(base, card, commit)
    tests = "".join(f"| {r['file']} | {r['result']} | {r.get('seconds', '-')} |\n" for r in res.get("tests", []))
    head_line = (f"gpu-check {res['date']}, {card}, commit {commit}, torch {res['versions']['torch']}, triton "
                 f"{res['versions']['triton']}; {rounds} rounds x {reps} calls; {res['seconds']} s"
                 f"{'; DRY RUN on the CPU: not a measurement' if dry else ''}\n")
    md = head_line + ("\n| test file | result | s |\n|---|---|---|\n" + tests if tests else "") + "\n" + text
    with open(os.path.join(args.out, "gpu-check.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    with open(os.path.join(args.out, "gpu-check.md"), "w") as fh:
        fh.write(md)
    if args.write_baseline:
        with open(args.write_baseline, "w") as fh:
            json.dump({"card": card, "commit": commit, "date": res["date"], "versions": res["versions"],
                       "figures": {f.name: {"median": f.median, "min": f.spread[0], "max": f.spread[1]}
                                   for f in FIGURES.values() if f.median is not None}}, fh, indent=1)
    log(md)
    failed = [r for r in res.get("tests", []) if r.get("rc") not in (0, 5, None) or "timed out" in r["result"]]
    # a peer that cannot run is its row's note; a figure of logitless' own that fails fails the check
    return 1 if failed or any(f.error and f.target is not None for f in FIGURES.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
