"""Where one fused policy-loss step spends its GPU time: the stages of an unprofiled step, the kernel
timeline and its idle gaps, and what the host was doing in each gap (a synchronisation, an allocation, a
slow launch).

    PYTHONPATH=src python3 benchmarks/gpu_policy_profile.py [--shape A,B] [--tiles 128,256,64,16,8,4;...]
        [--env "KEY=VALUE KEY=VALUE;..."] [--rounds 3] [--no-profile] [--out DIR]

Per shape:
1. Times the step (fused_policy_loss forward + backward, triton, the loss settings of gpu_policy_loss.py)
   with CUDA events, without a profiler.
2. Events around each stage of the pass (no profiler): the GPU time from the call to the first statistics
   kernel (lead) and the host's time to launch it, each stage's GPU time, the time between stages (the
   combine callback's kernels and idle) and after the last one (tail); for the default and each --env.
3. --host-profile K: cProfile of K steps (host time by function) into DIR/host_profile_<shape>.txt.
   Unless --no-profile: profiles two steps (torch.profiler, CPU + CUDA, Python stacks), writes the trace,
   and for every gap of more than 20 us between two GPU operations prints its length, the kernels on
   either side, how late the host launched the next one, the long CUDA runtime calls (syncs, allocations)
   the host made while the GPU waited, and the innermost logitless Python frames at the late launch.
4. --tiles: statistics-kernel tiles (LOGITLESS_TRITON_POLICY) timed on one chunk against cuBLAS's product
   of the same shape, with the chunk's lse, entropy and label logits compared to the default kernel's.
5. Each --tiles value and each --env variant: whole steps alternating with the default, --rounds pairs.
Writes DIR/gpu_policy_profile.json (and trace.json.gz); prints a short table last.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_policy_loss import SHAPES, Step, alternate_pairs, make_inputs  # noqa: E402

from logitless.losses import fused_policy_loss  # noqa: E402
from logitless.tools.common import env_set, time_cuda  # noqa: E402
from logitless.tools.machine import machine, versions  # noqa: E402

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
OUT: dict = {}


def log(*a):
    print(*a, flush=True)


def frames_at(py, t):
    """The logitless / benchmark Python frames enclosing host time ``t``, innermost first."""
    hits = [e for e in py if e["ts"] <= t <= e["ts"] + e["dur"]]
    hits.sort(key=lambda e: -e["ts"])
    names = [e["name"] for e in hits if "logitless" in e["name"] or "benchmarks" in e["name"]]
    return names[:6]


def analyse(trace_path, min_gap_us=20.0):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    xs = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted((e for e in xs if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
    runtime = [e for e in xs if e.get("cat") == "cuda_runtime"]
    by_corr = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    py = [e for e in xs if e.get("cat") == "python_function"]
    steps = sorted((e for e in xs if e.get("cat") == "user_annotation" and e["name"].startswith("step")),
                   key=lambda e: e["ts"])
    report = []
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        ks = [e for e in gpu if lo <= by_corr.get(e.get("args", {}).get("correlation"), {"ts": lo})["ts"] <= hi]
        if not ks:
            continue
        busy = sum(e["dur"] for e in ks)
        gaps = []
        for a, b in zip(ks, ks[1:], strict=False):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap < min_gap_us:
                continue
            launch = by_corr.get(b.get("args", {}).get("correlation"))
            start = a["ts"] + a["dur"]
            row = {"gap_us": round(gap, 1), "after": a["name"][:60], "before": b["name"][:60]}
            if launch is not None:
                row["launch_late_us"] = round(launch["ts"] + launch["dur"] - start, 1)
                row["launch_call"] = launch["name"]
                row["host_calls"] = [(r["name"], round(r["dur"], 1)) for r in runtime
                                     if r["dur"] > 50 and r["ts"] < launch["ts"] and r["ts"] + r["dur"] > start][:6]
                row["frames"] = frames_at(py, launch["ts"])
            gaps.append(row)
        first, last = ks[0]["ts"], ks[-1]["ts"] + ks[-1]["dur"]
        top = {}
        for e in ks:
            top.setdefault(e["name"][:70], [0.0, 0])
            top[e["name"][:70]][0] += e["dur"] / 1e3
            top[e["name"][:70]][1] += 1
        kernels = sorted(([k, round(ms, 3), n] for k, (ms, n) in top.items()), key=lambda r: -r[1])[:12]
        report.append({"host_step_ms": step["dur"] / 1e3, "gpu_span_ms": (last - first) / 1e3,
                       "gpu_busy_ms": busy / 1e3, "lead_ms": (first - lo) / 1e3,
                       "gap_ms": sum(g["gap_us"] for g in gaps) / 1e3, "n_kernels": len(ks),
                       "gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:25], "kernels": kernels})
    return report


def profile_steps(step, out_dir):
    from torch.profiler import ProfilerActivity, profile, record_function
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for i in range(2):
            with record_function(f"step{i}"):
                step()
            torch.cuda.synchronize()
    path = os.path.join("/tmp", "policy_trace.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(os.path.join(out_dir, "trace.json.gz"), "wb") as g:
        g.write(f.read())
    return analyse(path)


def stats_variant(cfg):
    """LOGITLESS_TRITON_POLICY = cfg for the block ("" = the default tiles)."""
    return env_set(LOGITLESS_TRITON_POLICY=cfg)


def chunk_tiles(inputs, configs, rows):
    """Each statistics-kernel variant on one chunk of ``rows`` tokens, against cuBLAS's [rows, V] product;
    its lse / entropy / label logits against the default kernel's (max abs difference)."""
    from logitless.ops.triton import stages
    hidden, weight, labels = inputs[:3]
    v = weight.shape[0]
    h, lab = hidden[:rows], labels[:rows]
    it = torch.ones(rows, device="cuda")
    logits = [torch.empty(rows, v, dtype=hidden.dtype, device="cuda")]
    out = [{"tiles": "cuBLAS mm", "ms": time_cuda(lambda: torch.mm(h, weight.t(), out=logits[0]), reps=9)[0]}]
    logits.clear()
    truth = None
    for cfg in [""] + configs:
        row = {"tiles": cfg or "default"}
        try:
            with stats_variant(cfg):
                bufs = stages.policy_buffers(rows, v, hidden.dtype, "cuda")
                stages.policy_stats(h, weight, lab, it, bufs)
                lse, ent = stages.combine(bufs)
                got = (lse, ent, bufs.label_logit.clone())
                truth = truth or got
                row["max_diff_lse_ent_zy"] = [float((a - b).abs().max()) for a, b in zip(got, truth, strict=True)]
                row["ms"] = time_cuda(lambda bufs=bufs: stages.policy_stats(h, weight, lab, it, bufs), reps=9)[0]
                del bufs
        except Exception as exc:  # noqa: BLE001 - a config that does not build is a result too
            row["error"] = repr(exc)[:300]
        row["x_cublas"] = row.get("ms", float("nan")) / out[0]["ms"]
        out.append(row)
        log("chunk", row)
    return out


class StageEvents:
    """CUDA events around each stage launch of the triton policy pass, and host clock marks on entering
    and leaving the call's preparation (``stages.instrument_policy_pass`` for the block): where the time of an
    unprofiled step goes."""
    from logitless.ops.triton.stages import POLICY_STAGES as STAGES

    def __init__(self):
        self.marks, self.host, self._ctx = [], {}, None

    def _wrap(self, name, fn):
        def inner(*a, **k):
            self.host.setdefault("first_stage", time.perf_counter())
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = fn(*a, **k)
            end.record()
            self.marks.append((name, begin, end))
            return out
        return inner

    def _clock(self, name, fn):
        def inner(*a, **k):
            self.host.setdefault(f"{name}_in", time.perf_counter())
            out = fn(*a, **k)
            self.host.setdefault(f"{name}_out", time.perf_counter())
            return out
        return inner

    def __enter__(self):
        from logitless.ops.triton import stages
        # the loss's preparation of the scored tokens, clocked on the host beside the pass
        host_steps = (("logitless.losses.function", "score_tokens"),)
        self._ctx = stages.instrument_policy_pass(self._wrap, self._clock, host_steps)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    def step(self, step):
        """One timed step: {total, lead (call -> first statistics kernel, GPU ms), host_* (host ms from the
        call to entering / leaving score_tokens and policy_pass, and to the first stage's launch), per-stage
        GPU ms, between (GPU ms between stages: the combine callback's kernels and idle), tail (last stage
        -> end of the call)}."""
        self.marks, self.host = [], {}
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        row = {"total": start.elapsed_time(end), "lead": start.elapsed_time(self.marks[0][1]),
               "tail": self.marks[-1][2].elapsed_time(end)}
        row.update({f"host_{k}": (t - t0) * 1e3 for k, t in self.host.items()})
        for name, b, e in self.marks:
            row[name] = row.get(name, 0.0) + b.elapsed_time(e)
        row["between"] = row["total"] - row["lead"] - row["tail"] - sum(row.get(n, 0.0) for n in self.STAGES)
        return row


def event_timeline(step, reps=5):
    """Median over ``reps`` steps of each StageEvents figure."""
    with StageEvents() as ev:
        step()
        rows = [ev.step(step) for _ in range(reps)]
    return {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in rows[0]}


def host_profile(step, steps, out_dir, tag):
    """cProfile of ``steps`` steps (each synchronised): where the host's time goes (the GPU is idle at each
    call's start, so the host time before the first statistics kernel is the step's lead)."""
    import cProfile
    import io
    import pstats
    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        step()
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    with open(os.path.join(out_dir, f"host_profile_{tag}.txt"), "w") as f:
        f.write(f"{steps} steps\n" + text.getvalue())


def env_variant(spec):
    """"KEY=VALUE KEY=VALUE" -> the environment set for the block."""
    return env_set(**dict(kv.split("=", 1) for kv in spec.split()))


def alternate(step, variant, rounds):
    """``gpu_policy_loss.alternate_pairs`` of 3-step medians, or the error of a variant that fails."""
    try:
        return alternate_pairs(step, variant, rounds)
    except Exception as exc:  # noqa: BLE001 - a variant that fails is a result too
        return {"error": repr(exc)[:200]}


def shape_report(tag, args):
    res = {}
    n, hdim, v = SHAPES[tag]
    inputs = make_inputs(n, hdim, v)
    step = Step(fused_policy_loss, inputs, backend="triton")
    res["step_ms"] = time_cuda(step, reps=7)
    log(tag, "step ms (median, min, max)", res["step_ms"])
    envs = [e.strip() for e in args.env.split(";") if e.strip()]
    res["events"] = {"default": event_timeline(step)}
    for spec in envs:
        with env_variant(spec):
            res["events"][spec] = event_timeline(step)
    for name, row in res["events"].items():
        log(tag, "events", name, json.dumps({k: round(x, 3) for k, x in row.items()}))
    if args.host_profile:
        host_profile(step, args.host_profile, args.out, tag)
    if args.profile:
        t0 = time.perf_counter()
        res["profile"] = profile_steps(step, args.out)
        log("profile took %.1f s" % (time.perf_counter() - t0))
        for r in res["profile"]:
            log(json.dumps({k: r[k] for k in ("host_step_ms", "gpu_span_ms", "gpu_busy_ms", "lead_ms", "gap_ms",
                                              "n_kernels")}))
            for g in r["gaps"][:12]:
                log("  gap", json.dumps(g))
            for k in r["kernels"]:
                log("  kernel", k)
    configs = [c for c in args.tiles.split(";") if c]
    if configs:
        res["chunk_tiles"] = chunk_tiles(inputs, configs, 4096)
    res["step_variants"] = []
    for name, variant in ([(f"LOGITLESS_TRITON_POLICY={c}", lambda c=c: stats_variant(c)) for c in configs]
                          + [(spec, lambda spec=spec: env_variant(spec)) for spec in envs]):
        pair = dict(variant=name, **alternate(step, variant, args.rounds))
        res["step_variants"].append(pair)
        log(tag, "step", json.dumps(pair))
    return res


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="A", help="shapes, comma-separated (A, B)")
    p.add_argument("--tiles", default="", help="';'-separated LOGITLESS_TRITON_POLICY values")
    p.add_argument("--env", default="", help="';'-separated variants, each 'KEY=VALUE KEY=VALUE' (knobs)")
    p.add_argument("--rounds", type=int, default=3, help="(default, variant) step pairs per variant")
    p.add_argument("--host-profile", type=int, default=0, help="cProfile this many steps per shape")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the torch.profiler steps")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    OUT["env"] = {"versions": versions(), "machine": machine(), "argv": sys.argv}
    OUT["shapes"] = {tag: shape_report(tag, args) for tag in args.shape.split(",")}
    with open(os.path.join(args.out, "gpu_policy_profile.json"), "w") as f:
        json.dump(OUT, f, indent=1, default=str)
    log("\n| shape | what | ms |\n|---|---|---|")
    for tag, res in OUT["shapes"].items():
        log(f"| {tag} | step (events, median) | {res['step_ms'][0]:.2f} |")
        for name, row in res["events"].items():
            stages = ", ".join(f"{k} {x:.2f}" for k, x in row.items() if k != "total")
            log(f"| {tag} | events {name}: {stages} | {row['total']:.2f} |")
        for r in res.get("profile", []):
            log(f"| {tag} | profiled step: host {r['host_step_ms']:.2f}, GPU span {r['gpu_span_ms']:.2f}, "
                f"busy {r['gpu_busy_ms']:.2f}, lead {r['lead_ms']:.2f}, gaps {r['gap_ms']:.2f} | |")
        for row in res.get("chunk_tiles", []):
            log(f"| {tag} | chunk {row['tiles']} | {row.get('ms', float('nan')):.3f} "
                f"({row.get('x_cublas', float('nan')):.3f}x) |")
        for row in res["step_variants"]:
            log(f"| {tag} | step {row['variant']} / default ({row.get('variant_faster_in')}) | "
                f"{row.get('ratio', row.get('error'))} |")


if __name__ == "__main__":
    main()
