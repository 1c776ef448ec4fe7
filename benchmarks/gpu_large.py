"""Large token counts on one CUDA GPU, in one process: bounded workspace, int64 addressing, speed.

    PYTHONPATH=src python3 benchmarks/gpu_large.py [--sections large,huge,hugebwd,readme] [--out DIR] [--small]

large:  N=131072, H=4096, V=151936 bf16 (N x V = 2.0e10 > 2^31) forward+backward with the triton backend,
        in backward token chunks of 16384 (the default: 8 chunks, d_weight accumulated in float32) and in one
        backward call (LOGITLESS_TRITON_BWD_TOKENS=131072: a float32 d_hidden of 2 GiB).
        The loss has non-zero coefficients on the first and last 1024 tokens only, so d_weight, d_hidden,
        log-probs and entropies of those tokens are compared with the chunked backend and with float64
        (torch autograd on float64 copies) on that 2048-token slice. Time / floor (the 4 GEMMs, measured
        in token chunks: one [N, V] bf16 product would be 40 GB) and peak memory.
huge:   N=1,048,576 (N x H = 4.3e9 > 2^31): forward only, time / 1-GEMM floor (the GEMM in token chunks),
        peak extra memory (target: workspace <= 64 MiB), log-prob / entropy of the first and last 1024
        tokens against the chunked backend; then one forward+backward, its time and peak memory, and the
        d_hidden rows of the last 1024 tokens against the chunked backend.
hugebwd: N=1,048,576 forward+backward alone (not in the default sections): its peak memory, the d_hidden
        rows of the last 1024 tokens against the chunked backend, one call timed against the 4 GEMMs.
readme: the published shapes A (16384, 4096, 151936) and B (8192, 4096, 131072): forward and forward+backward
        over the floor of ``tools.common.GemmFloor`` (one full GEMM), with the default forward workspace
        (64 MiB: A takes two token chunks, B one) and with LOGITLESS_TRITON_STATS_BYTES=2^40 (one chunk, the
        behaviour before token chunks), calls interleaved.
--small runs every section at tiny shapes (on the CPU through triton's interpreter when there is no GPU):
a dry run of the script itself, not a measurement. Every number goes to DIR/gpu_large.json as it comes;
a short table is printed last.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from logitless import fused_logprobs, last_backend  # noqa: E402
from logitless.tools.common import GemmFloor, env_set, peak_extra_bytes, random_head, sample_labels, time_calls  # noqa: E402

GIB = float(1 << 30)
MIB = float(1 << 20)
FULL = {"large": (131072, 4096, 151936), "huge": (1048576, 4096, 151936),
        "A": (16384, 4096, 151936), "B": (8192, 4096, 131072)}
SMALL = {"large": (700, 128, 2053), "huge": (300, 64, 1031), "A": (100, 64, 1031), "B": (64, 64, 520)}
SLICE = 1024
RESULTS: dict = {}
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def write():
    with open(os.path.join(ARGS.out, "gpu_large.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int, warmup: int = 1) -> list:
    """Milliseconds of ``reps`` calls of fn (CUDA events on a GPU), after ``warmup`` calls."""
    return time_calls(fn, DEV, reps, warmup)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def peak_extra(fn):
    """(peak bytes allocated during fn above what was allocated before, fn's result); None off CUDA."""
    return peak_extra_bytes(fn, DEV)


def run_op(hidden, weight, labels, a, b, backend="triton", backward=True):
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    out = fused_logprobs(h, w, labels, backend=backend)
    assert last_backend() == backend
    if backward:
        ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    return out.logprobs.detach(), out.entropy.detach(), h.grad, w.grad


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def inputs(n, h, v, seed, sampled=True):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden, weight = random_head(n, h, v, torch.bfloat16, DEV, g)
    if sampled:
        labels = sample_labels(hidden, weight, 1.0, g)
    else:   # 1M rows of sampling would take longer than the measurement; the values do not depend on it
        labels = torch.randint(0, v, (n,), device=DEV, generator=g)
    a = torch.randn(n, device=DEV, generator=g)
    b = torch.randn(n, device=DEV, generator=g)
    return hidden, weight, labels, a, b


def chunked_floor(hidden, weight, rows, backward):
    """The GEMMs of the op, in token chunks of ``rows``: forward = 1 product [T,H]x[H,V] per chunk, forward +
    backward = 4 (forward, recompute, dH = dZ W, dW += dZ^T h); same FLOPs as the full-size products,
    which do not fit at these N. Buffers allocated (and touched) once, outside the timed calls."""
    n = hidden.shape[0]
    z = torch.empty(rows, weight.shape[0], device=DEV, dtype=hidden.dtype)
    z.normal_()
    dh = torch.empty_like(hidden[:rows])
    dw = torch.zeros_like(weight)

    def fn():
        for s in range(0, n, rows):
            e = min(n, s + rows)
            torch.mm(hidden[s:e], weight.t(), out=z[:e - s])
            if backward:
                torch.mm(hidden[s:e], weight.t(), out=z[:e - s])
                torch.mm(z[:e - s], weight, out=dh[:e - s])
                dw.addmm_(z[:e - s].t(), hidden[s:e])
    return fn, (z, dh, dw)


def compare_slice(tag, res, hidden, weight, labels, a, b, idx, lp, ent, dh, dw):
    """Errors of (lp, ent, d_hidden rows) on ``idx`` and of d_weight (the loss lives on idx only) against
    the chunked backend and float64 on hidden[idx]."""
    from reference64 import logprobs_entropy64
    hs, ls, as_, bs = hidden[idx], labels[idx], a[idx], b[idx]
    c_lp, c_ent, c_dh, c_dw = run_op(hs, weight, ls, as_, bs, "chunked")
    h64 = hs.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    lp64, ent64 = logprobs_entropy64(h64, w64, ls)
    ((lp64 * as_.double()).sum() + (ent64 * bs.double()).sum()).backward()
    def err(x, y):
        return float((x.detach() - y.detach()).abs().max())
    r = {"vs_chunked": {"lp_err": err(lp[idx], c_lp), "ent_err": err(ent[idx], c_ent)},
         "vs_float64": {"lp_err": err(lp[idx], lp64), "ent_err": err(ent[idx], ent64),
                        "chunked_lp_err": err(c_lp, lp64)},
         "max_lp": float(lp.max()), "finite": bool(torch.isfinite(lp).all() and torch.isfinite(ent).all())}
    if dh is not None:
        r["vs_chunked"].update(dh_rel=rel(dh[idx], c_dh), dw_rel=rel(dw, c_dw))
        r["vs_float64"].update(dh_rel=rel(dh[idx], h64.grad), dw_rel=rel(dw, w64.grad),
                               chunked_dh_rel=rel(c_dh, h64.grad), chunked_dw_rel=rel(c_dw, w64.grad))
        r["finite"] = r["finite"] and bool(torch.isfinite(dh).all() and torch.isfinite(dw).all())
        # rows outside idx had zero loss coefficients: their d_hidden must be exactly 0 (written, not stale)
        outside = torch.ones(hidden.shape[0], dtype=torch.bool, device=DEV)
        outside[idx] = False
        r["dh_zero_outside_slice"] = bool((dh[outside] == 0).all())
    del h64, w64, lp64, ent64
    res[tag] = r
    log(tag, r)


# ------------------------------------------------------------------------------------------ sections

def section_large():
    n, h, v = SHAPES["large"]
    seed = random.randrange(1 << 30)
    res = RESULTS.setdefault("large", {"N": n, "H": h, "V": v, "seed": seed})
    log(f"large: N={n} H={h} V={v} seed={seed}")
    hidden, weight, labels, a, b = inputs(n, h, v, seed)
    s = min(SLICE, n // 4)
    idx = torch.cat([torch.arange(s, device=DEV), torch.arange(n - s, n, device=DEV)])
    a_s, b_s = torch.zeros_like(a), torch.zeros_like(b)
    a_s[idx], b_s[idx] = a[idx], b[idx]
    grad_bytes = (hidden.numel() + weight.numel()) * 2
    variants = {"default": {}, "bwd_one_call": {"LOGITLESS_TRITON_BWD_TOKENS": n}}
    for name, knobs in variants.items():
        with env_set(**knobs):
            lp, ent, dh, dw = run_op(hidden, weight, labels, a_s, b_s)
            compare_slice(f"errors_{name}", res, hidden, weight, labels, a_s, b_s, idx, lp, ent, dh, dw)
            del lp, ent, dh, dw
            res[f"fwd_ms_{name}"] = timed(lambda: run_op(hidden, weight, labels, a, b, backward=False), 3)
            res[f"fwdbwd_ms_{name}"] = timed(lambda: run_op(hidden, weight, labels, a, b), 3)
            peak, out = peak_extra(lambda: run_op(hidden, weight, labels, a, b, backward=False))
            res[f"fwd_peak_extra_mib_{name}"] = peak and peak / MIB
            del out
            peak, out = peak_extra(lambda: run_op(hidden, weight, labels, a, b))
            res[f"fwdbwd_peak_extra_gib_{name}"] = peak and peak / GIB
            res[f"fwdbwd_peak_extra_minus_grads_gib_{name}"] = peak and (peak - grad_bytes) / GIB
            del out
        log("large", name, {k: v for k, v in res.items() if k.endswith(name) and not k.startswith("errors")})
        write()
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    for backward in (False, True):
        fn, bufs = chunked_floor(hidden, weight, min(n, 16384), backward)
        res["floor_fwdbwd_ms" if backward else "floor_fwd_ms"] = timed(fn, 3)
        del fn, bufs
    for name in variants:
        res[f"fwd_x_floor_{name}"] = median(res[f"fwd_ms_{name}"]) / median(res["floor_fwd_ms"])
        res[f"fwdbwd_x_floor_{name}"] = median(res[f"fwdbwd_ms_{name}"]) / median(res["floor_fwdbwd_ms"])
    log("large floors", res["floor_fwd_ms"], res["floor_fwdbwd_ms"])
    write()


def section_huge():
    n, h, v = SHAPES["huge"]
    seed = random.randrange(1 << 30)
    res = RESULTS.setdefault("huge", {"N": n, "H": h, "V": v, "seed": seed, "labels": "uniform random"})
    log(f"huge: N={n} H={h} V={v} seed={seed}")
    hidden, weight, labels, a, b = inputs(n, h, v, seed, sampled=False)
    s = min(SLICE, n // 4)
    idx = torch.cat([torch.arange(s, device=DEV), torch.arange(n - s, n, device=DEV)])
    peak, out = peak_extra(lambda: run_op(hidden, weight, labels, a, b, backward=False))
    res["fwd_peak_extra_mib"] = peak and peak / MIB
    lp, ent = out[0], out[1]
    compare_slice("errors_fwd", res, hidden, weight, labels, a, b, idx, lp, ent, None, None)
    del out, lp, ent
    res["fwd_ms"] = timed(lambda: run_op(hidden, weight, labels, a, b, backward=False), 2)
    fn, bufs = chunked_floor(hidden, weight, min(n, 65536), False)
    res["floor_fwd_ms"] = timed(fn, 2)
    del fn, bufs
    res["fwd_x_floor"] = median(res["fwd_ms"]) / median(res["floor_fwd_ms"])
    log("huge forward", {k: res[k] for k in ("fwd_peak_extra_mib", "fwd_ms", "floor_fwd_ms", "fwd_x_floor")})
    write()
    if time.time() - T0 > ARGS.budget_s:
        res["fwdbwd"] = "skipped: out of time"
        return
    huge_backward(res, hidden, weight, labels, a, b, idx[s:], floor=False)


def section_hugebwd():
    """Forward+backward at N = 1M alone: peak memory, then one timed call against the 4 GEMMs in chunks."""
    n, h, v = SHAPES["huge"]
    seed = random.randrange(1 << 30)
    res = RESULTS.setdefault("hugebwd", {"N": n, "H": h, "V": v, "seed": seed, "labels": "uniform random"})
    log(f"hugebwd: N={n} H={h} V={v} seed={seed}")
    hidden, weight, labels, a, b = inputs(n, h, v, seed, sampled=False)
    huge_backward(res, hidden, weight, labels, a, b, torch.arange(n - min(SLICE, n // 4), n, device=DEV))


def huge_backward(res, hidden, weight, labels, a, b, last, floor=True):
    """One forward+backward with peak memory (the first call: it includes allocation and any kernel build),
    the d_hidden rows ``last`` against the chunked backend (a row's d_hidden depends only on its own
    coefficients), and with ``floor`` one more call timed with events against the 4 GEMMs in token chunks."""
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    t = time.perf_counter()
    peak, out = peak_extra(lambda: run_op(hidden, weight, labels, a, b))
    sync()
    res["fwdbwd_first_call_s_with_peak_tracking"] = time.perf_counter() - t
    grad_bytes = (hidden.numel() + weight.numel()) * 2
    res["fwdbwd_peak_extra_gib"] = peak and peak / GIB
    res["fwdbwd_peak_extra_minus_grads_gib"] = peak and (peak - grad_bytes) / GIB
    dh = out[2]
    c = run_op(hidden[last], weight, labels[last], a[last], b[last], "chunked")
    res["fwdbwd_last_rows_dh_rel_vs_chunked"] = rel(dh[last], c[2])
    res["fwdbwd_finite"] = bool(torch.isfinite(dh).all() and torch.isfinite(out[3]).all())
    del out, dh, c
    if floor:
        res["fwdbwd_ms"] = timed(lambda: run_op(hidden, weight, labels, a, b), 1, warmup=0)
        fn, bufs = chunked_floor(hidden, weight, min(hidden.shape[0], 16384), True)
        res["floor_fwdbwd_ms"] = timed(fn, 1, warmup=0)
        del fn, bufs
        res["fwdbwd_x_floor"] = median(res["fwdbwd_ms"]) / median(res["floor_fwdbwd_ms"])
    log("huge fwd+bwd", {k: v for k, v in res.items() if k.startswith("fwdbwd") or k.startswith("floor")})
    write()


def section_readme():
    for tag in ("A", "B"):
        readme_shape(tag)


def readme_shape(tag):
    n, h, v = SHAPES[tag]
    seed = random.randrange(1 << 30)
    res = RESULTS.setdefault(f"readme_{tag}", {"N": n, "H": h, "V": v, "seed": seed})
    hidden, weight, labels, a, b = inputs(n, h, v, seed)
    gemms = GemmFloor(hidden, weight)
    res["floor_fwd_ms"] = timed(gemms.forward, 5)
    res["floor_fwdbwd_ms"] = timed(gemms.forward_backward, 3)
    gemms.close()
    del gemms
    torch.cuda.empty_cache() if DEV.type == "cuda" else None
    modes = {"new": {}, "one_chunk": {"LOGITLESS_TRITON_STATS_BYTES": 1 << 40}}
    for mode in modes:
        res[f"fwd_ms_{mode}"], res[f"fwdbwd_ms_{mode}"] = [], []
    for _ in range(3):   # interleaved, so that drift hits both alike
        for mode, knobs in modes.items():
            with env_set(**knobs):
                res[f"fwd_ms_{mode}"] += timed(lambda: run_op(hidden, weight, labels, a, b, backward=False), 3)
                res[f"fwdbwd_ms_{mode}"] += timed(lambda: run_op(hidden, weight, labels, a, b), 1)
    for mode, knobs in modes.items():
        with env_set(**knobs):
            peak, out = peak_extra(lambda: run_op(hidden, weight, labels, a, b, backward=False))
            res[f"fwd_peak_extra_mib_{mode}"] = peak and peak / MIB
            del out
        res[f"fwd_x_floor_{mode}"] = median(res[f"fwd_ms_{mode}"]) / median(res["floor_fwd_ms"])
        res[f"fwdbwd_x_floor_{mode}"] = median(res[f"fwdbwd_ms_{mode}"]) / median(res["floor_fwdbwd_ms"])
        res[f"fwd_x_floor_range_{mode}"] = [min(res[f"fwd_ms_{mode}"]) / median(res["floor_fwd_ms"]),
                                            max(res[f"fwd_ms_{mode}"]) / median(res["floor_fwd_ms"])]
    log(tag, {k: v for k, v in res.items() if "x_floor" in k or "peak" in k})
    write()


def table() -> str:
    lines = ["| run | fwd x floor | fwd+bwd x floor | fwd peak extra | fwd+bwd peak extra - grads | lp err f64 "
             "| ent err f64 | dh rel f64 | dw rel f64 |", "|---" * 9 + "|"]
    large = RESULTS.get("large", {})
    for name in ("default", "bwd_one_call"):
        e = large.get(f"errors_{name}", {}).get("vs_float64", {})
        lines.append(f"| large {name} | {large.get(f'fwd_x_floor_{name}', float('nan')):.3f} "
                     f"| {large.get(f'fwdbwd_x_floor_{name}', float('nan')):.3f} "
                     f"| {large.get(f'fwd_peak_extra_mib_{name}') or float('nan'):.0f} MiB "
                     f"| {large.get(f'fwdbwd_peak_extra_minus_grads_gib_{name}') or float('nan'):.2f} GiB "
                     f"| {e.get('lp_err', float('nan')):.1e} | {e.get('ent_err', float('nan')):.1e} "
                     f"| {e.get('dh_rel', float('nan')):.1e} | {e.get('dw_rel', float('nan')):.1e} |")
    huge = RESULTS.get("huge", {})
    e = huge.get("errors_fwd", {}).get("vs_float64", {})
    lines.append(f"| huge | {huge.get('fwd_x_floor', float('nan')):.3f} | - "
                 f"| {huge.get('fwd_peak_extra_mib') or float('nan'):.0f} MiB "
                 f"| {huge.get('fwdbwd_peak_extra_minus_grads_gib') or float('nan'):.2f} GiB "
                 f"| {e.get('lp_err', float('nan')):.1e} | {e.get('ent_err', float('nan')):.1e} | - | - |")
    hb = RESULTS.get("hugebwd", {})
    if hb:
        lines.append(f"| huge fwd+bwd | - | {hb.get('fwdbwd_x_floor', float('nan')):.3f} | - "
                     f"| {hb.get('fwdbwd_peak_extra_minus_grads_gib') or float('nan'):.2f} GiB | - | - "
                     f"| dh rel vs chunked {hb.get('fwdbwd_last_rows_dh_rel_vs_chunked', float('nan')):.1e} | - |")
    for tag in ("A", "B"):
        r = RESULTS.get(f"readme_{tag}", {})
        for mode in ("new", "one_chunk"):
            lines.append(f"| {tag} {mode} | {r.get(f'fwd_x_floor_{mode}', float('nan')):.3f} "
                         f"| {r.get(f'fwdbwd_x_floor_{mode}', float('nan')):.3f} "
                         f"| {r.get(f'fwd_peak_extra_mib_{mode}') or float('nan'):.0f} MiB | - | - | - | - | - |")
    return "\n".join(lines)


def main():
    global ARGS, DEV, SHAPES
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="large,huge,readme")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--small", action="store_true", help="tiny shapes: a dry run of the script")
    p.add_argument("--budget-s", type=float, default=200.0, help="skip the optional 1M forward+backward after this")
    ARGS = p.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    SHAPES = SMALL if ARGS.small else FULL
    import triton
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
                      "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", "argv": sys.argv,
                      "small": ARGS.small, "git": os.environ.get("GIT_REV"),
                      "env": {k: v for k, v in os.environ.items() if k.startswith("LOGITLESS_")}}
    log(RESULTS["env"])
    for name in ARGS.sections.split(","):
        try:
            {"large": section_large, "huge": section_huge, "hugebwd": section_hugebwd,
             "readme": section_readme}[name]()
        except Exception:  # noqa: BLE001 - record it and go on to the next section
            RESULTS.setdefault(name, {})["error"] = traceback.format_exc()[-3000:]
            log(traceback.format_exc())
        if DEV.type == "cuda":
            torch.cuda.empty_cache()
        write()
    RESULTS["elapsed_s"] = time.time() - T0
    write()
    log("\n" + table())


if __name__ == "__main__":
    main()
