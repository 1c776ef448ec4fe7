"""Check and time the Triton backend on one CUDA GPU, in one process: correctness first, then variants.

    PYTHONPATH=src python3 benchmarks/gpu_triton.py [--shapes A,B,C] [--sweep] [--out DIR]

1. Correctness on small odd shapes against float64 (fp32/bf16/fp16, per-token temperature, ignored rows,
   with_entropy False, H not a multiple of the K tile, padded last vocab tile), and of the softcap path
   (logits c * tanh(raw / c) / T, Gemma 2's final_logit_softcapping) in fp32 and bf16.
2. For each benchmark shape (bf16, logit std about 4, labels sampled from the softmax):
   the cuBLAS floor (1 GEMM forward, 4 GEMMs forward+backward) in the same process; logitless triton
   (forward, forward+backward, with and without entropy, and with a softcap of 30), its errors against a
   float32 reference from the same bf16 values, its peak extra memory; the chunked backend and the naive
   eager path.
3. With --sweep: tile / warp / stage variants of the forward and backward kernels and dlogits chunk sizes.
Writes every number to DIR/gpu_triton.json and a log; prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import triton  # noqa: E402

from logitless import fused_logprobs, last_backend  # noqa: E402
from logitless.ops.triton import stages  # noqa: E402
from logitless.tools.common import GemmFloor, peak_extra_bytes, random_head, run_each, sample_labels, time_cuda  # noqa: E402

SHAPES = {"A": (16384, 4096, 151936), "B": (8192, 4096, 131072), "C": (1024, 4096, 151936)}
GIB = 1 << 30
RESULTS: dict = {"checks": [], "shapes": {}, "sweep": []}


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------- correctness on small odd shapes
def small_checks():
    tol = {torch.float32: (2e-5, 2e-5, 1e-4), torch.bfloat16: (1e-3, 2e-3, 1e-2), torch.float16: (1e-3, 2e-3, 1e-2)}
    cases = [  # n, h, v, dtype, per-token temperature, with_entropy
        (333, 200, 5003, torch.float32, False, True),
        (333, 200, 5003, torch.bfloat16, True, True),
        (333, 200, 5003, torch.float16, True, False),
        (1000, 4096, 33001, torch.bfloat16, False, True),
        (7, 96, 1031, torch.bfloat16, True, True),
        (333, 100, 5003, torch.bfloat16, True, True),   # rows of 200 bytes: pointer loads, masked K tail
    ]
    # softcap 8 against raw logits of std 12: most logits bent by the tanh, the largest saturated
    softcap_cases = [
        (333, 200, 5003, torch.float32, True, True),
        (333, 200, 5003, torch.bfloat16, True, True),
        (1000, 4096, 33001, torch.bfloat16, False, False),
        (333, 100, 5003, torch.bfloat16, True, True),   # pointer loads, masked K tail
    ]
    runs = [(case, {}) for case in cases] + [(case, {"softcap": 8.0, "logit_std": 12.0}) for case in softcap_cases]
    for case, extra in runs:
        try:
            one_check(*case, tol[case[3]], **extra)
        except Exception as exc:  # noqa: BLE001 - record it, go on to the timings
            RESULTS["checks"].append({"case": str(case), **extra, "ok": False, "error": repr(exc)[:500]})
            log("check FAILED", case, extra, repr(exc)[:500])


def one_check(n, h, v, dt, per_tok, with_ent, t, softcap=None, logit_std=4.0):
    from reference64 import logprobs_entropy64, rel_err
    hidden = torch.randn(n, h, device="cuda")
    weight = torch.randn(v, h, device="cuda") * (logit_std / h ** 0.5)
    with torch.no_grad():
        labels = torch.multinomial(torch.softmax(hidden @ weight.t(), -1), 1).squeeze(1)
    labels[::5] = -100
    temp = (torch.rand(n, device="cuda") + 0.5) if per_tok else 0.7
    hd, wd = hidden.to(dt).requires_grad_(), weight.to(dt).requires_grad_()
    out = fused_logprobs(hd, wd, labels, temperature=temp, with_entropy=with_ent, backend="triton", softcap=softcap)
    assert last_backend() == "triton"
    h64, w64 = hd.detach().double().requires_grad_(), wd.detach().double().requires_grad_()
    lp64, ent64 = logprobs_entropy64(h64, w64, labels, temp, softcap=softcap)
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    loss = (out.logprobs * a).sum() + ((out.entropy * b).sum() if with_ent else 0)
    loss.backward()
    (((lp64 * a.double()).sum() + ((ent64 * b.double()).sum() if with_ent else 0))).backward()
    r = {"n": n, "h": h, "v": v, "dtype": str(dt), "per_token_temp": per_tok, "with_entropy": with_ent,
         "softcap": softcap,
         "lp_err": (out.logprobs - lp64).abs().max().item(),
         "ent_err": (out.entropy - ent64).abs().max().item() if with_ent else 0.0,
         "dh_rel": rel_err(hd.grad, h64.grad), "dw_rel": rel_err(wd.grad, w64.grad),
         "max_lp": out.logprobs.max().item()}
    r["ok"] = bool(r["lp_err"] <= t[0] and r["ent_err"] <= t[1] and r["dh_rel"] <= t[2]
                   and r["dw_rel"] <= t[2] and r["max_lp"] <= 0 and math.isfinite(r["lp_err"]))
    RESULTS["checks"].append(r)
    log("check", r)


# ---------------------------------------------------------------- benchmark shapes
def make_inputs(n, h, v, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden, weight = random_head(n, h, v, torch.bfloat16, "cuda", g)
    labels = sample_labels(hidden, weight, 1.0, g)
    a = torch.randn(n, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g)
    return hidden, weight, labels, a, b


def reference32(hidden, weight, labels, a, b):
    """float32 reference from the same bf16 values: chunked backend on float32 copies, full fp32 GEMMs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    h32 = hidden.float().requires_grad_()
    w32 = weight.float().requires_grad_()
    out = fused_logprobs(h32, w32, labels, backend="chunked")
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    res = (out.logprobs.detach(), out.entropy.detach(), h32.grad, w32.grad)
    del h32, w32
    return res


def run_op(hidden, weight, labels, a, b, backend, with_entropy=True, backward=True, softcap=None):
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    out = fused_logprobs(h, w, labels, with_entropy=with_entropy, backend=backend, softcap=softcap)
    if backward:
        loss = (out.logprobs * a).sum()
        if with_entropy:
            loss = loss + (out.entropy * b).sum()
        loss.backward()
    return out, h.grad, w.grad


def naive(hidden, weight, labels, a, b, backward=True):
    """The eager path people write: bf16 logits, float32 log-softmax, gather, entropy."""
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    logp = torch.log_softmax((h @ w.t()).float(), -1)
    lp = logp.gather(1, labels.unsqueeze(1)).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    if backward:
        ((lp * a).sum() + (ent * b).sum()).backward()
    return lp, ent, h.grad, w.grad


def floors(hidden, weight):
    gemms = GemmFloor(hidden, weight)
    res = {"gemm1_ms": time_cuda(gemms.forward, reps=15)[0],
           "gemm4_ms": time_cuda(gemms.forward_backward, reps=7)[0]}
    gemms.close()
    return res


def peak_extra(fn, grad_bytes):
    peak, _ = peak_extra_bytes(fn, "cuda")
    return peak / GIB, (peak - grad_bytes) / GIB


def errors(out, gh, gw, ref):
    from reference64 import rel_err
    lp, ent, dh, dw = ref
    r = {"lp_err": (out.logprobs - lp).abs().max().item(), "max_lp": out.logprobs.max().item()}
    if out.entropy is not None:
        r["ent_err"] = (out.entropy - ent).abs().max().item()
    if gh is not None:
        r["dh_rel"] = rel_err(gh, dh)
        r["dw_rel"] = rel_err(gw, dw)
    return r


def shape_run(tag, sweep):
    n, h, v = SHAPES[tag]
    log(f"== shape {tag}: N={n} H={h} V={v}")
    hidden, weight, labels, a, b = make_inputs(n, h, v)
    res = {"N": n, "H": h, "V": v}
    RESULTS["shapes"][tag] = res
    res.update(floors(hidden, weight))
    torch.cuda.empty_cache()
    log(tag, "floor", res)
    grad_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    if sweep:
        variant_sweep(tag, hidden, weight, labels, a, b, res)
        write()

    ref = reference32(hidden, weight, labels, a, b)
    torch.cuda.empty_cache()
    out, gh, gw = run_op(hidden, weight, labels, a, b, "triton")
    res["triton_err"] = errors(out, gh, gw, ref)
    out, gh, gw = run_op(hidden, weight, labels, a, b, "triton", with_entropy=False)
    res["triton_noent_err"] = errors(out, None, None, ref)   # its gradient lacks the entropy term
    del out, gh, gw
    log(tag, "errors", res["triton_err"], res["triton_noent_err"])

    def timed(name, fn, reps=7):
        try:
            ms = time_cuda(fn, reps=reps)
            res[name] = ms[0]
            res[name + "_spread"] = [ms[1], ms[2]]
            log(tag, name, "%.2f ms" % ms[0], "(min %.2f max %.2f)" % (ms[1], ms[2]))
        except Exception as exc:  # noqa: BLE001 - record and go on: one failing variant must not end the run
            res[name] = None
            res[name + "_error"] = repr(exc)[:300]
            log(tag, name, "FAILED", repr(exc)[:300])
        torch.cuda.empty_cache()

    timed("triton_fwd_ms", lambda: run_op(hidden, weight, labels, a, b, "triton", backward=False))
    timed("triton_fwd_noent_ms", lambda: run_op(hidden, weight, labels, a, b, "triton", False, False))
    timed("triton_fwdbwd_ms", lambda: run_op(hidden, weight, labels, a, b, "triton"), reps=5)
    timed("triton_fwdbwd_noent_ms", lambda: run_op(hidden, weight, labels, a, b, "triton", False), reps=5)
    # Gemma 2's cap of 30: the cost of the tanh in both kernels (its correctness: the small checks)
    timed("triton_softcap_fwd_ms", lambda: run_op(hidden, weight, labels, a, b, "triton", backward=False,
                                                  softcap=30.0))
    timed("triton_softcap_fwdbwd_ms", lambda: run_op(hidden, weight, labels, a, b, "triton", softcap=30.0), reps=5)
    res["triton_peak_gib"], res["triton_extra_gib"] = peak_extra(
        lambda: run_op(hidden, weight, labels, a, b, "triton"), grad_bytes)
    log(tag, "triton memory", res["triton_peak_gib"], res["triton_extra_gib"])

    # the comparisons: chunked backend and naive eager
    ck_ref = run_op(hidden, weight, labels, a, b, "chunked")
    res["chunked_err"] = errors(*ck_ref, ref)
    del ck_ref
    timed("chunked_fwd_ms", lambda: run_op(hidden, weight, labels, a, b, "chunked", backward=False), reps=3)
    timed("chunked_fwdbwd_ms", lambda: run_op(hidden, weight, labels, a, b, "chunked"), reps=3)
    res["chunked_peak_gib"], res["chunked_extra_gib"] = peak_extra(
        lambda: run_op(hidden, weight, labels, a, b, "chunked"), grad_bytes)
    try:
        lp, ent, nh, nw = naive(hidden, weight, labels, a, b)
        from reference64 import rel_err
        res["naive_err"] = {"lp_err": (lp - ref[0]).abs().max().item(), "ent_err": (ent - ref[1]).abs().max().item(),
                            "dh_rel": rel_err(nh, ref[2]), "dw_rel": rel_err(nw, ref[3])}
        del lp, ent, nh, nw
        timed("naive_fwd_ms", lambda: naive(hidden, weight, labels, a, b, backward=False), reps=3)
        timed("naive_fwdbwd_ms", lambda: naive(hidden, weight, labels, a, b), reps=3)
        res["naive_peak_gib"], res["naive_extra_gib"] = peak_extra(
            lambda: naive(hidden, weight, labels, a, b), grad_bytes)
    except torch.OutOfMemoryError as exc:
        res["naive_error"] = repr(exc)[:200]
    del ref
    torch.cuda.empty_cache()
    # the floor again, after everything: the ratios use the mean of the two, both are kept
    again = floors(hidden, weight)
    res["gemm1_ms_before"], res["gemm4_ms_before"] = res["gemm1_ms"], res["gemm4_ms"]
    res["gemm1_ms_after"], res["gemm4_ms_after"] = again["gemm1_ms"], again["gemm4_ms"]
    res["gemm1_ms"] = (res["gemm1_ms_before"] + again["gemm1_ms"]) / 2
    res["gemm4_ms"] = (res["gemm4_ms_before"] + again["gemm4_ms"]) / 2
    log(tag, "floor after", again)
    write()


FWD_VARIANTS = [  # (BM, BN, BK, GROUP_M, warps, stages), bulk-copy (TMA) loads
    ((128, 256, 64, 16, 8, 3), True), ((128, 256, 64, 16, 8, 4), True), ((128, 256, 64, 8, 8, 3), True),
    ((128, 256, 64, 16, 8, 3), False), ((256, 128, 64, 16, 8, 3), True),
]
BWD_VARIANTS = [  # (tiles, TMA loads, dlogits budget)
    ((128, 256, 64, 16, 8, 4), True, 1 << 26), ((128, 256, 64, 16, 8, 4), True, 1 << 27),
    ((128, 256, 64, 16, 8, 3), True, 1 << 26),
]
KNOBS = ("LOGITLESS_TRITON_FWD", "LOGITLESS_TRITON_BWD", "LOGITLESS_TRITON_DLOGITS_ELEMENTS", "LOGITLESS_TRITON_TMA")


def variant_sweep(tag, hidden, weight, labels, a, b, res):
    saved = {k: os.environ.get(k) for k in KNOBS}
    ones = torch.ones(hidden.shape[0], device="cuda")
    for cfg, tma in FWD_VARIANTS if not ARGS.bwd_only else []:
        os.environ["LOGITLESS_TRITON_FWD"] = ",".join(map(str, cfg))
        os.environ["LOGITLESS_TRITON_TMA"] = "1" if tma else "0"
        row = {"shape": tag, "stage": "fwd", "cfg": cfg, "tma": tma}
        try:
            fn = lambda: stages.logprob_stats(hidden, weight, labels, ones, True)
            t0 = time.time()
            fn()
            torch.cuda.synchronize()
            row["compile_s"] = time.time() - t0
            row["ms"] = time_cuda(fn, reps=7)[0]
            row["x_gemm1"] = row["ms"] / res["gemm1_ms"]
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
        RESULTS["sweep"].append(row)
        log("sweep", row)
    os.environ.pop("LOGITLESS_TRITON_FWD", None)
    # backward: the dlogits kernel alone (one chunk) and the whole grads() per tile config and budget
    n, v = hidden.shape[0], weight.shape[0]
    lse = torch.randn(n, device="cuda").abs() + 10
    ent = torch.rand(n, device="cuda") * 3
    for cfg, tma, budget in BWD_VARIANTS:
        os.environ["LOGITLESS_TRITON_BWD"] = ",".join(map(str, cfg))
        os.environ["LOGITLESS_TRITON_TMA"] = "1" if tma else "0"
        os.environ["LOGITLESS_TRITON_DLOGITS_ELEMENTS"] = str(budget)
        row = {"shape": tag, "stage": "bwd", "cfg": cfg, "tma": tma, "budget": budget}
        try:
            fn = lambda: stages.logprob_grads(hidden, weight, labels, ones, lse, ent, a, b, True, True)
            fn()
            row["ms"] = time_cuda(fn, reps=3)[0]
            row["x_gemm3"] = row["ms"] / (res["gemm4_ms"] * 0.75)
            step = stages.logprob_chunk_columns(n, v, cfg[1])
            buf = torch.empty(n, step, dtype=hidden.dtype, device="cuda")
            row["dlogits_chunk_ms"] = time_cuda(lambda step=step, buf=buf: stages.logprob_dlogits_chunk(
                hidden, weight[:step], 0, labels, ones, lse, ent, a, b, buf), reps=5)[0]
            row["chunk_cols"] = step
            row["chunk_x_gemm"] = row["dlogits_chunk_ms"] / (res["gemm1_ms"] * step / v)
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
        RESULTS["sweep"].append(row)
        log("sweep", row)
        torch.cuda.empty_cache()
    for k, val in saved.items():
        if val is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = val


def addmm_probe():
    a = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    acc = torch.randn(256, 128, device="cuda")
    want = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        RESULTS["addmm_out_dtype_inplace"] = (acc - want).abs().max().item()
    except Exception as exc:  # noqa: BLE001
        RESULTS["addmm_out_dtype_inplace"] = repr(exc)[:300]
    log("addmm probe", RESULTS["addmm_out_dtype_inplace"])


def write():
    path = os.path.join(ARGS.out, "gpu_triton.json")
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def table():
    lines = ["| shape | floor fwd ms | triton fwd x | fwd noent x | floor 4-GEMM ms | triton fwd+bwd x | noent x "
             "| extra GiB over grads | lp err | ent err | dh rel | dw rel | chunked fwd+bwd x | naive fwd+bwd x "
             "| softcap fwd x | softcap fwd+bwd x |",
             "|---" * 16 + "|"]
    for tag, r in RESULTS["shapes"].items():
        def x(key, floor, r=r):
            return "%.3f" % (r[key] / r[floor]) if r.get(key) else "-"
        e = r.get("triton_err", {})
        lines.append(
            f"| {tag} | {r['gemm1_ms']:.2f} | {x('triton_fwd_ms', 'gemm1_ms')} "
            f"| {x('triton_fwd_noent_ms', 'gemm1_ms')} "
            f"| {r['gemm4_ms']:.2f} | {x('triton_fwdbwd_ms', 'gemm4_ms')} | {x('triton_fwdbwd_noent_ms', 'gemm4_ms')} "
            f"| {r.get('triton_extra_gib', float('nan')):.3f} | {e.get('lp_err', float('nan')):.2e} "
            f"| {e.get('ent_err', float('nan')):.2e} | {e.get('dh_rel', float('nan')):.2e} "
            f"| {e.get('dw_rel', float('nan')):.2e} | {x('chunked_fwdbwd_ms', 'gemm4_ms')} "
            f"| {x('naive_fwdbwd_ms', 'gemm4_ms')} | {x('triton_softcap_fwd_ms', 'gemm1_ms')} "
            f"| {x('triton_softcap_fwdbwd_ms', 'gemm4_ms')} |")
    text = "\n".join(lines)
    with open(os.path.join(ARGS.out, "table.md"), "w") as f:
        f.write(text + "\n")
    return text


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="A,B,C")
    p.add_argument("--sweep", default="", help="shapes to sweep variants on, e.g. A")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--bwd-only", action="store_true", help="sweep only the backward variants")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    ARGS = p.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
                      "device": torch.cuda.get_device_name(), "argv": sys.argv,
                      "env": {k: v for k, v in os.environ.items() if k.startswith("LOGITLESS_")}}
    log(RESULTS["env"])
    addmm_probe()
    if not ARGS.no_checks:
        small_checks()
        write()
    run_each([s for s in ARGS.shapes.split(",") if s], lambda tag: shape_run(tag, tag in ARGS.sweep.split(",")),
             RESULTS["shapes"], write)
    write()
    log("\nchecks ok:", all(c["ok"] for c in RESULTS["checks"]), len(RESULTS["checks"]))
    for row in RESULTS["sweep"]:
        log("sweep", row.get("shape"), row.get("stage"), row.get("cfg"), "tma" if row.get("tma") else "ptr",
            row.get("budget", ""), "",
            "%.2f ms" % row["ms"] if "ms" in row else row.get("error"),
            "x%.3f" % row.get("x_gemm1", row.get("x_gemm3", float("nan"))))
    log(table())


if __name__ == "__main__":
    main()
