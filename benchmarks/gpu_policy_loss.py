"""Check and time the fused policy loss on one CUDA GPU, in one process.

    PYTHONPATH=src python3 benchmarks/gpu_policy_loss.py [--shapes A,B] [--variants A] [--rounds 6] [--out DIR]

1. Correctness against float64 (tests/policy64.py, verl's definitions written out) on small odd
   shapes (fp32, bf16; per-token temperature, ignored rows holding NaN, several token chunks), and at
   H=4096, V=151936 on 640 tokens cut into 5 chunks (the number of d_weight accumulations of shape A),
   with d_weight accumulated in the bf16 gradient buffer (default) and in float32 (LOGITLESS_POLICY_DW_FP32).
2. For each shape (bf16, logit std about 4, labels sampled from the softmax, per-token advantages,
   old / ref log-probs = true log-probs + N(0, 0.3^2), PPO clip 0.2 / 0.28, dual clip 3, k3 KL 0.01,
   entropy bonus 0.01, token-mean): the cuBLAS floor (1 and 4 GEMMs) in the same process, before and after;
   fused_policy_loss forward and forward+backward (triton); the fused step alternated with the 4-GEMM floor
   (--rounds pairs, ABBA); policy_loss_reference on triton (fused_logprobs + autograd); peak memory beyond
   the gradient buffers and its split; the fused loss against the reference path (loss, log-probs,
   gradients) and its log-probs / entropies of 256 tokens against float64; one chunk's stages timed alone.
3. --variants: whole steps alternating with the default: the sweep's fastest dlogits block and
   statistics-kernel form. --sweep: the statistics kernel's forms (the default, Gluon on Hopper, and the Triton
   kernel: LOGITLESS_POLICY_STATS_KERNEL; outputs checked against the default's) and dlogits blocks on one
   chunk, and a profile of one step.
Writes DIR/gpu_policy_loss.json and prints a short table last. --dry-run runs every step on tiny shapes on
the CPU (triton's interpreter, wall-clock timing, no memory figures): a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import time  # noqa: E402

from logitless import fused_logprobs, last_backend  # noqa: E402
from logitless.losses import fused_policy_loss, policy_loss_reference  # noqa: E402
from logitless.ops.triton import stages  # noqa: E402
from logitless.tools.common import GemmFloor, env_set, peak_extra_bytes, random_head, run_each, sample_labels  # noqa: E402
from logitless.tools.common import time_cuda as _time_cuda  # noqa: E402
from logitless.tools.machine import machine, versions  # noqa: E402

SHAPES = {"A": (16384, 4096, 151936), "B": (8192, 4096, 131072)}
LOSS = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.01, kl_type="k3", entropy_coef=0.01,
            loss_agg="token-mean")
GIB = 1 << 30
RESULTS: dict = {"checks": [], "shapes": {}}
DEV = "cuda"
FULL_WIDTH = (4096, 151936)


def time_cuda(fn, warmup=2, reps=7):
    """(median, min, max) ms: CUDA events on the GPU, the wall clock in a dry run (two calls)."""
    return _time_cuda(fn, warmup if DEV == "cuda" else 1, reps if DEV == "cuda" else min(reps, 2), device=DEV)


KNOBS = ("LOGITLESS_POLICY_WORKSPACE_BYTES", "LOGITLESS_POLICY_DW_FP32", "LOGITLESS_TRITON_POLICY")


def log(*a):
    print(*a, flush=True)


def empty_cache():
    if DEV == "cuda":
        torch.cuda.empty_cache()


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ---------------------------------------------------------------- float64 checks
def check_case(name, lead, h, v, dtype, **kw):
    """One fused call against float64; ``runs``: [(name suffix, knob values)] (float64 computed once)."""
    from policy64 import loss64, policy_inputs
    hidden, weight, labels, adv, old, ref = policy_inputs(lead, h, v, dtype, device=DEV, old_noise=0.5)
    temperature = kw.pop("temperature", 1.0)
    if temperature == "per-token":
        temperature = torch.rand(lead, device=DEV) + 0.5
    runs = kw.pop("runs", [("", {})])
    spec = dict(LOSS, **kw)
    loss_agg = spec.pop("loss_agg")
    truth = loss64(hidden, weight, labels, adv, old, temperature=temperature, loss_agg=loss_agg, ref=ref,
                   with_scale=True, **spec)
    for suffix, values in runs:
        with env_set(**values):
            hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = fused_policy_loss(hh, ww, labels, adv, old, ref_logprobs=ref, temperature=temperature,
                                    loss_agg=loss_agg, backend="triton", **spec)
            assert last_backend() == "triton"
            out.loss.backward()
        record_check(name + suffix, dtype, lead, h, v, labels, out, hh.grad, ww.grad, truth)
        del out, hh, ww


def record_check(name, dtype, lead, h, v, labels, out, gh, gw, truth):
    loss, lp, ent, clip_fraction, kl, dh, dw, scale = truth
    valid = labels != -100
    # loss_rel: against the loss itself; loss_err_scaled: against its float scale, the same aggregation of
    # |term| (a loss whose terms nearly cancel is small against their rounding; the target applies to this)
    err = abs(out.loss.item() - loss.item())
    r = {"case": name, "dtype": str(dtype), "lead": list(lead), "H": h, "V": v,
         "loss": out.loss.item(), "loss64": loss.item(), "loss_scale64": scale.item(),
         "loss_rel": err / abs(loss.item()), "loss_err_scaled": err / scale.item(),
         "lp_err": (out.logprobs - lp).abs().max().item(), "ent_err": (out.entropy - ent).abs().max().item(),
         "clip_fraction": out.clip_fraction.item(), "clip_fraction64": clip_fraction.item(),
         "kl_err": abs(out.kl.item() - kl.item()),
         "dh_rel": rel(gh[valid], dh[valid]), "dw_rel": rel(gw, dw),
         "ignored_rows_zero": bool((gh[~valid] == 0).all()),
         "finite": bool(torch.isfinite(gh).all() and torch.isfinite(gw).all())}
    tol = (1e-4, 2e-5, 2e-5, 1e-4) if dtype == torch.float32 else (1e-4, 1e-3, 2e-3, 1e-2)
    r["ok"] = (r["loss_err_scaled"] <= tol[0] and r["lp_err"] <= tol[1] and r["ent_err"] <= tol[2]
               and r["dh_rel"] <= tol[3] and r["dw_rel"] <= tol[3] and r["ignored_rows_zero"] and r["finite"]
               and abs(r["clip_fraction"] - r["clip_fraction64"]) <= 1e-6)
    RESULTS["checks"].append(r)
    log("check", r)


def small_checks():
    cases = [("fp32 odd", (333,), 200, 5003, torch.float32, {"temperature": "per-token"}),
             ("bf16 odd, per-token T", (9, 37), 200, 5003, torch.bfloat16,
              {"temperature": "per-token", "loss_agg": "seq-mean-token-mean"}),
             ("bf16 odd, chunks of 128 tokens", (3, 111), 200, 5003, torch.bfloat16,
              {"loss_agg": "seq-mean-token-sum-norm", "kl_type": "k2", "kl_coef": 0.3, "entropy_coef": 0.5})]
    if DEV == "cpu":
        cases = [(n, tuple(max(1, x // 8) for x in lead), 40, 503, dt, kw) for n, lead, _, _, dt, kw in cases]
    for name, lead, h, v, dtype, kw in cases:
        try:
            # "chunks of 128": one token tile per chunk (128 rows on the H200, 16 in the interpreter)
            budget = 1 if "chunks of" in name else 1 << 30
            with env_set(LOGITLESS_POLICY_WORKSPACE_BYTES=budget):
                check_case(name, lead, h, v, dtype, **kw)
        except Exception as exc:  # noqa: BLE001 - record it, go on to the timings
            RESULTS["checks"].append({"case": name, "ok": False, "error": traceback.format_exc()[-1500:]})
            log("check FAILED", name, repr(exc)[:500])


def full_width_checks():
    """640 tokens at H=4096, V=151936 in 5 chunks of one token tile (128 rows): shape A's number of d_weight
    accumulations; d_weight accumulated in the bf16 buffer and in float32 (float64 computed once)."""
    h, v = FULL_WIDTH
    name = f"bf16 H{h} V{v}, 5 chunks"
    runs = [(", dW in bf16 buffer", {"LOGITLESS_POLICY_WORKSPACE_BYTES": 1}),
            (", dW fp32 accumulator", {"LOGITLESS_POLICY_WORKSPACE_BYTES": 1, "LOGITLESS_POLICY_DW_FP32": 1}),
            (", one chunk", {})]
    tile = 128 if DEV == "cuda" else 16
    try:
        check_case(name, (5, tile), h, v, torch.bfloat16, loss_agg="seq-mean-token-mean", runs=runs)
    except Exception as exc:  # noqa: BLE001
        RESULTS["checks"].append({"case": name, "ok": False, "error": traceback.format_exc()[-1500:]})
        log("check FAILED", name, repr(exc)[:500])
    empty_cache()


# ---------------------------------------------------------------- benchmark shapes
def make_inputs(n, h, v, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden, weight = random_head(n, h, v, torch.bfloat16, DEV, g)
    labels = sample_labels(hidden, weight, 1.0, g)
    with torch.no_grad():
        lp = fused_logprobs(hidden, weight, labels, with_entropy=False, backend="triton").logprobs
    adv = torch.randn(n, device=DEV, generator=g)
    old = lp + 0.3 * torch.randn(n, device=DEV, generator=g)
    ref = lp + 0.3 * torch.randn(n, device=DEV, generator=g)
    return hidden, weight, labels, adv, old, ref


def floors(hidden, weight):
    gemms = GemmFloor(hidden, weight)
    res = {"gemm1_ms": time_cuda(gemms.forward, reps=15)[0], "gemm4_ms": time_cuda(gemms.forward_backward, reps=7)[0]}
    gemms.close()
    del gemms
    empty_cache()
    return res


class Step:
    """One forward (+ backward) of a loss on fresh leaf tensors sharing the inputs' storage."""

    def __init__(self, fn, inputs, backward=True, **kw):
        self.fn, self.kw, self.backward = fn, kw, backward
        hidden, weight, self.labels, self.adv, self.old, self.ref = inputs
        self.h = hidden.detach().requires_grad_(backward)
        self.w = weight.detach().requires_grad_(backward)

    def __call__(self):
        self.h.grad = self.w.grad = None
        out = self.fn(self.h, self.w, self.labels, self.adv, self.old, ref_logprobs=self.ref, **dict(LOSS, **self.kw))
        if self.backward:
            out.loss.backward()
        return out


def peak_extra(step, grad_bytes):
    """(peak GiB above the memory before the call, that minus the gradient buffers' GiB)."""
    step.h.grad = step.w.grad = None
    peak, _ = peak_extra_bytes(step, DEV)
    step.h.grad = step.w.grad = None
    if peak is None:
        return float("nan"), float("nan")
    return peak / GIB, (peak - grad_bytes) / GIB


def planned_split(n, v, h):
    """The fused pass's own buffers at this shape, from its chunk plan (what the peak should hold)."""
    plan = stages.policy_plan(n, v, torch.bfloat16, DEV)
    dw_fp32 = os.environ.get("LOGITLESS_POLICY_DW_FP32", "") == "1"
    return {"chunk_rows": plan.rows, "chunks": plan.chunks, "workspace_gib": plan.workspace_bytes(torch.bfloat16) / GIB,
            "stats_gib": plan.stats_bytes() / GIB, "dw_accumulator_gib": v * h * 4 / GIB if dw_fp32 else 0.0}


def stage_times(inputs, res):
    """One chunk's stages alone: statistics GEMM with and without the e store, e -> dlogits, the two cuBLAS
    products. Their sum times the chunk count is what the pass costs besides the small combine."""
    hidden, weight, labels = inputs[:3]
    n, k = hidden.shape
    v = weight.shape[0]
    c = min(n, stages.policy_plan(n, v, hidden.dtype, DEV).rows)
    h, lab = hidden[:c], labels[:c]
    it = torch.ones(c, device=DEV)
    bufs = stages.policy_buffers(c, v, hidden.dtype, DEV)
    bufs.label_logit.zero_()
    dl = bufs.dlogits
    stages.policy_stats(h, weight, lab, it, bufs)
    lse, ent = stages.combine(bufs)
    g = torch.randn(c, device=DEV) * 1e-4
    dh = torch.empty(c, k, dtype=hidden.dtype, device=DEV)
    dw = torch.empty_like(weight)
    out = {"rows": c}
    out["stats_store_ms"] = time_cuda(lambda: stages.policy_stats(h, weight, lab, it, bufs), reps=5)[0]
    out["stats_nostore_ms"] = time_cuda(lambda: stages.policy_stats(h, weight, lab, it, bufs, store_e=False),
                                        reps=5)[0]
    stages.policy_stats(h, weight, lab, it, bufs)
    # in place over e: the pass's own setting (e is read before its dlogits are written, element by element)
    out["dlogits_ms"] = time_cuda(lambda: stages.policy_dlogits(bufs, lse, ent, g, g, it, lab, out=bufs.e),
                                  reps=5)[0]
    out["dlogits_noent_ms"] = time_cuda(lambda: stages.policy_dlogits(bufs, lse, ent, g, None, it, lab,
                                                                      out=bufs.e), reps=5)[0]
    dl.copy_(torch.randn(c, v, device=DEV).to(torch.bfloat16) * 1e-3)
    out["dx_mm_ms"] = time_cuda(lambda: torch.mm(dl, weight, out=dh), reps=5)[0]
    out["dw_mm_ms"] = time_cuda(lambda: torch.mm(dl.t(), h, out=dw), reps=5)[0]
    out["dw_addmm_ms"] = time_cuda(lambda: dw.addmm_(dl.t(), h), reps=5)[0]
    # host time: the scored-token preparation of a call (its syncs included) and the per-chunk term
    # gradients (launches only): a pass whose host work outlasts its GPU work leaves the GPU idle
    from logitless.losses import PolicyLoss
    from logitless.losses.tokens import score_tokens
    from logitless.ops.policy_terms import TermTotals, chunk_gradients
    adv, old, ref = inputs[3:6]

    def prep():
        policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, **{k: LOSS[k] for k in LOSS})
        inv_temp = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)     # temperature 1
        return policy, score_tokens(labels, policy, inv_temp=inv_temp, ignore_index=-100, vocab=v)
    for _ in range(2):
        policy, tokens = prep()
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        prep()
    out["host_prep_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    totals = TermTotals.zeros(DEV, True)
    lp_c, ent_c = -torch.rand(c, device=DEV), torch.rand(c, device=DEV)
    chunk_gradients(lp_c, ent_c, tokens.inputs.rows(0, c), policy.term_spec(), totals)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        chunk_gradients(lp_c, ent_c, tokens.inputs.rows(0, c), policy.term_spec(), totals)
    out["host_chunk_gradients_ms"] = (time.perf_counter() - t0) / 5 * 1e3
    sync()
    # GPU time of stage 2 per chunk: the tile combine, the terms by autograd (CPU backends) and by the kernel
    spec = policy.term_spec()
    settings = stages.term_settings(spec, DEV)
    ti = tokens.inputs.rows(0, c)
    out["combine_ms"] = time_cuda(lambda: stages.combine(bufs), reps=5)[0]
    out["terms_autograd_ms"] = time_cuda(lambda: chunk_gradients(lp_c, ent_c, ti, spec, totals), reps=5)[0]
    out["terms_kernel_ms"] = time_cuda(lambda: stages.policy_terms_kernel(lp_c, ent_c, ti, settings, totals.sums),
                                       reps=5)[0]
    gemm_chunk = res["gemm1_ms"] * c / n
    out["gemm1_chunk_ms"] = gemm_chunk
    out["bytes_per_dlogits_gbps"] = c * v * 4 / (out["dlogits_ms"] * 1e-3) / 1e9
    res["stages"] = out
    log("stages", out)


# statistics kernel: name -> environment (policy_stats.chunk_stats: the Gluon kernel on Hopper by default)
STATS_FORMS = [("default", {}), ("triton", {"LOGITLESS_POLICY_STATS_KERNEL": "triton"}),
               ("default", {})]     # the default again at the end: the card's clock drifts within a sweep
# rows per program, warps, statistics tiles per program (run 7 swept ten; these are its best and the former default)
DLOGITS_BLOCKS = [(4, 4, 4), (8, 4, 1), (4, 2, 2), (4, 4, 4)]    # the default again: the card's clock drifts


def dlogits_attrs(block):
    return dict(ROWS_PER_PROGRAM=block[0], WARPS=block[1], TILES_PER_PROGRAM=block[2])


def sweep(inputs, res):
    """Stage variants on one chunk (statistics-kernel tiles, e -> dlogits block), and a profile of one
    fused forward+backward (GPU kernel time by kernel, against the wall clock)."""
    hidden, weight, labels = inputs[:3]
    v = weight.shape[0]
    c = res.get("stages", {}).get("rows", 3328)
    h, lab = hidden[:c], labels[:c]
    it = torch.ones(c, device=DEV)
    rows = []
    want = None
    for form, env in STATS_FORMS:
        row = {"stage": "stats", "form": form}
        try:
            with env_set(**env):
                bufs = stages.policy_buffers(c, v, hidden.dtype, DEV, fill=float("nan"))
                stages.policy_stats(h, weight, lab, it, bufs)
                got = (bufs.tile_max, bufs.tile_sum, bufs.tile_ent, bufs.label_logit, bufs.e.float())
                if want is None:
                    want = tuple(x.clone() for x in got) + (stages.combine(bufs)[0],)
                elif bufs.tile_max.shape == want[0].shape:
                    row["max_diff"] = max((a - b).abs().max().item() for a, b in zip(got, want[:5], strict=True))
                else:
                    row["max_diff_lse"] = (stages.combine(bufs)[0] - want[5]).abs().max().item()
                row["nan"] = any(x.isnan().any().item() for x in got)
                row["ms"] = time_cuda(lambda bufs=bufs: stages.policy_stats(h, weight, lab, it, bufs), reps=7)[0]
                row["x_gemm_share"] = row["ms"] / (res["gemm1_ms"] * c / hidden.shape[0])
                del bufs, got
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:400]
        rows.append(row)
        log("sweep", row)
    want = None
    bufs = stages.policy_buffers(c, v, hidden.dtype, DEV)
    stages.policy_stats(h, weight, lab, it, bufs)
    lse, ent = stages.combine(bufs)
    g = torch.randn(c, device=DEV) * 1e-4
    for block in DLOGITS_BLOCKS:
        row = {"stage": "dlogits", "block": block}
        try:
            stages.policy_stats(h, weight, lab, it, bufs)
            with stages.launch("dlogits", **dlogits_attrs(block)):
                row["ms"] = time_cuda(lambda: stages.policy_dlogits(bufs, lse, ent, g, g, it, lab, out=bufs.e),
                                      reps=7)[0]
            row["gbps"] = c * v * 4 / (row["ms"] * 1e-3) / 1e9
        except Exception as exc:  # noqa: BLE001
            row["error"] = repr(exc)[:300]
        rows.append(row)
        log("sweep", row)
    res["sweep"] = rows
    bufs = None
    empty_cache()
    step = Step(fused_policy_loss, inputs, backend="triton")
    step()
    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    sync()
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        step()
        sync()
        wall = (time.perf_counter() - t0) * 1e3
    kernels = {}
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us and ev.key and not ev.key.startswith(("aten::", "cuda", "autograd", "Fused", "ProfilerStep")):
            kernels[ev.key[:90]] = (dev_us / 1e3, ev.count)
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]
    res["profile"] = {"wall_ms": wall, "kernel_ms_total": sum(ms for ms, _ in kernels.values()),
                      "top": [[k, ms, n] for k, (ms, n) in top]}
    log("profile", json.dumps(res["profile"], indent=0))


def floor_alternated(inputs, fused, rounds, reps=3) -> dict:
    """The fused step against the 4-GEMM floor, alternating in this process: ``rounds`` pairs of
    ``reps``-step medians, the floor first in even rounds and the fused step first in odd ones (the card's
    clock drifts 1-4% through a run; the floor timed only before and after the fused steps can sit on
    either side of that drift). {floor_ms, fused_ms (lists), ratio (of the sums), fused_under_0.80_in}."""
    gemms = GemmFloor(inputs[0], inputs[1])
    floor_ms, fused_ms = abba(lambda: time_cuda(gemms.forward_backward, reps=reps)[0],
                              lambda: time_cuda(fused, reps=reps)[0], rounds)
    gemms.close()     # frees its buffers
    under = sum(f / g <= 0.80 for f, g in zip(fused_ms, floor_ms, strict=True))
    return {"floor_ms": floor_ms, "fused_ms": fused_ms, "ratio": sum(fused_ms) / sum(floor_ms),
            "fused_under_0.80_in": f"{under}/{rounds}"}


def shape_run(tag, variants):
    n, h, v = SHAPES[tag]
    log(f"== shape {tag}: N={n} H={h} V={v}")
    res = {"N": n, "H": h, "V": v}
    RESULTS["shapes"][tag] = res
    inputs = make_inputs(n, h, v)
    res.update(floors(inputs[0], inputs[1]))
    log(tag, "floor", res)
    grad_bytes = (n * h + v * h) * 2
    res["grad_buffers_gib"] = grad_bytes / GIB

    def timed(name, step, reps=5):
        try:
            ms = time_cuda(step, reps=reps)
            res[name], res[name + "_spread"] = ms[0], [ms[1], ms[2]]
            log(tag, name, "%.2f ms" % ms[0], "(min %.2f max %.2f)" % (ms[1], ms[2]))
        except Exception as exc:  # noqa: BLE001 - record and go on
            res[name], res[name + "_error"] = None, traceback.format_exc()[-1500:]
            log(tag, name, "FAILED", repr(exc)[:300])
        empty_cache()

    fused = Step(fused_policy_loss, inputs, backend="triton")
    reference = Step(policy_loss_reference, inputs, backend="triton")
    timed("fused_fwd_ms", Step(fused_policy_loss, inputs, backward=False, backend="triton"), reps=7)
    timed("fused_fwdbwd_ms", fused, reps=7)
    timed("reference_fwdbwd_ms", reference, reps=5)
    timed("fused_fwdbwd_ms_2", fused, reps=7)       # again: the spread between two timings of one thing
    res["alternated"] = floor_alternated(inputs, fused, ARGS.rounds)
    log(tag, "alternated with the floor", res["alternated"])
    empty_cache()
    res["fused_peak_gib"], res["fused_extra_gib"] = peak_extra(fused, grad_bytes)
    res["reference_peak_gib"], res["reference_extra_gib"] = peak_extra(reference, grad_bytes)
    res["planned"] = planned_split(n, v, h)
    log(tag, "memory", res["fused_peak_gib"], res["fused_extra_gib"], res["planned"], "reference",
        res["reference_extra_gib"])

    # fused against the reference path, and 256 tokens' log-probs / entropies against float64
    a = fused()
    ga = (fused.h.grad.clone(), fused.w.grad.clone())
    b = reference()
    res["vs_reference"] = {"loss": a.loss.item(), "loss_ref": b.loss.item(),
                           "loss_rel": abs(a.loss.item() - b.loss.item()) / abs(b.loss.item()),
                           "lp_max_diff": (a.logprobs - b.logprobs).abs().max().item(),
                           "ent_max_diff": (a.entropy - b.entropy).abs().max().item(),
                           "dh_rel": rel(ga[0], reference.h.grad), "dw_rel": rel(ga[1], reference.w.grad),
                           "clip_fraction": a.clip_fraction.item(), "clip_fraction_ref": b.clip_fraction.item(),
                           "kl": a.kl.item(), "kl_ref": b.kl.item()}
    from reference64 import logprobs_entropy64
    with torch.no_grad():
        lp64, ent64 = logprobs_entropy64(inputs[0][:256], inputs[1], inputs[2][:256])
    res["vs_float64_256"] = {"lp_err": (a.logprobs[:256] - lp64).abs().max().item(),
                             "ent_err": (a.entropy[:256] - ent64).abs().max().item(),
                             "ref_path_lp_err": (b.logprobs[:256] - lp64).abs().max().item()}
    del a, b, ga, lp64, ent64
    fused.h.grad = fused.w.grad = reference.h.grad = reference.w.grad = None
    empty_cache()
    log(tag, "vs reference", res["vs_reference"], res["vs_float64_256"])
    write()
    try:
        stage_times(inputs, res)
    except Exception:  # noqa: BLE001
        res["stages_error"] = traceback.format_exc()[-1500:]
        log(res["stages_error"])
    empty_cache()
    if tag in ARGS.sweep.split(","):
        try:
            sweep(inputs, res)
        except Exception:  # noqa: BLE001
            res["sweep_error"] = traceback.format_exc()[-1500:]
            log(res["sweep_error"])
        write()
    if variants:
        now = stages.launch_settings("dlogits")
        default = (now["ROWS_PER_PROGRAM"], now["WARPS"], now["TILES_PER_PROGRAM"])
        blocks = {best_dlogits(res)} - {default}     # the sweep's best
        settings = [("dlogits_" + "x".join(map(str, block)),
                     lambda block=block: stages.launch("dlogits", **dlogits_attrs(block))) for block in blocks]
        form = best_stats_form(res)
        if form is not None:
            settings.append((f"stats_{form}", lambda form=form: env_set(**dict(STATS_FORMS)[form])))
        for name, setting in settings:
            try:
                alternate(res, name, fused, setting)
            except Exception:  # noqa: BLE001
                res[f"variant_{name}_error"] = traceback.format_exc()[-1500:]
                log(res[f"variant_{name}_error"])
            empty_cache()
        write()
    again = floors(inputs[0], inputs[1])
    res["gemm1_ms_before"], res["gemm4_ms_before"] = res["gemm1_ms"], res["gemm4_ms"]
    res["gemm1_ms_after"], res["gemm4_ms_after"] = again["gemm1_ms"], again["gemm4_ms"]
    res["gemm1_ms"] = (res["gemm1_ms_before"] + again["gemm1_ms"]) / 2
    res["gemm4_ms"] = (res["gemm4_ms_before"] + again["gemm4_ms"]) / 2
    log(tag, "floor after", again)
    write()


def best_dlogits(res):
    """The fastest dlogits block of the sweep (rows, warps, tiles per program); the former default
    without one."""
    timed = [r for r in res.get("sweep", []) if r.get("stage") == "dlogits" and r.get("ms")]
    return tuple(min(timed, key=lambda r: r["ms"])["block"]) if timed else (8, 4, 1)


def best_stats_form(res):
    """The fastest statistics-kernel form of the sweep other than the default (the first, timed again last)
    that agrees with it, or None."""
    ok = [r for r in res.get("sweep", []) if r.get("stage") == "stats" and r.get("ms") and not r.get("nan")
          and r["form"] != STATS_FORMS[0][0] and ("max_diff" in r or "max_diff_lse" in r)
          and max(r.get("max_diff", 0), r.get("max_diff_lse", 0)) < 1e-3]
    return None if not ok else min(ok, key=lambda r: r["ms"])["form"]


def abba(first, second, rounds) -> tuple[list, list]:
    """``rounds`` pairs of the milliseconds ``first()`` and ``second()`` return, ``first`` leading in even
    rounds and ``second`` in odd ones (a clock that drifts through a run then favours neither)."""
    times = ([], [])
    for i in range(rounds):
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            times[side].append((first, second)[side]())
    return times


def alternate_pairs(step, setting, rounds=3, reps=3) -> dict:
    """Whole steps with a variant against the default, alternating in this process (the card's clock moves
    1-4% within a run): ``rounds`` pairs of ``reps``-step medians, the default first in even rounds and the
    variant first in odd ones (a clock that drifts through a run then favours neither); setting(): the context
    manager that sets the variant. {default_ms, variant_ms (lists), ratio (of the sums), variant_faster_in}."""
    def variant():
        with setting():
            return time_cuda(step, reps=reps)[0]

    default_ms, variant_ms = abba(lambda: time_cuda(step, reps=reps)[0], variant, rounds)
    pair = {"default_ms": default_ms, "variant_ms": variant_ms}
    pair["ratio"] = sum(pair["variant_ms"]) / sum(pair["default_ms"])
    wins = sum(v < d for v, d in zip(pair["variant_ms"], pair["default_ms"], strict=True))
    pair["variant_faster_in"] = f"{wins}/{rounds}"
    return pair


def alternate(res, name, step, setting, rounds=3, reps=3):
    """``alternate_pairs`` into ``res``: the mean of each side and their ratio."""
    pair = alternate_pairs(step, setting, rounds, reps)
    var, base = sum(pair["variant_ms"]) / rounds, sum(pair["default_ms"]) / rounds
    res[f"variant_{name}_ms"], res[f"variant_{name}_default_ms"] = var, base
    res[f"variant_{name}_ratio"] = pair["ratio"]
    log(name, "%.2f ms vs default %.2f: ratio %.4f" % (var, base, pair["ratio"]))


def write():
    with open(os.path.join(ARGS.out, "gpu_policy_loss.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def table():
    lines = ["| shape | 4-GEMM ms | fused fwd+bwd ms | x 4-GEMM | x 4-GEMM alternated (pairs <= 0.80) "
             "| x reference (triton) | fwd x 1-GEMM "
             "| extra GiB over grads (planned ws + stats) | vs ref: loss rel, dh, dw | lp / ent err (256 tok, fp64) |",
             "|---" * 10 + "|"]
    for tag, r in RESULTS["shapes"].items():
        if "fused_fwdbwd_ms" not in r or r.get("fused_fwdbwd_ms") is None:
            lines.append(f"| {tag} | {r.get('error', 'failed')[:200]} |")
            continue
        p, vr, vf = r.get("planned", {}), r.get("vs_reference", {}), r.get("vs_float64_256", {})
        alt = r.get("alternated", {"ratio": float("nan"), "fused_under_0.80_in": "-"})
        lines.append(
            f"| {tag} | {r['gemm4_ms']:.2f} | {r['fused_fwdbwd_ms']:.2f} | {r['fused_fwdbwd_ms'] / r['gemm4_ms']:.3f} "
            f"| {alt['ratio']:.3f} ({alt['fused_under_0.80_in']}) "
            f"| {r['fused_fwdbwd_ms'] / r['reference_fwdbwd_ms']:.3f} | {r['fused_fwd_ms'] / r['gemm1_ms']:.3f} "
            f"| {r['fused_extra_gib']:.3f} ({p.get('workspace_gib', 0):.3f} + {p.get('stats_gib', 0):.3f}) "
            f"| {vr.get('loss_rel', float('nan')):.1e}, {vr.get('dh_rel', float('nan')):.1e}, "
            f"{vr.get('dw_rel', float('nan')):.1e} | {vf.get('lp_err', float('nan')):.1e} / "
            f"{vf.get('ent_err', float('nan')):.1e} |")
    lines.append("")
    lines.append("| check | loss rel (to loss; to sum of abs terms) | lp err | ent err | dh rel | dw rel | ok |")
    lines.append("|---" * 7 + "|")
    for c in RESULTS["checks"]:
        if "error" in c:
            lines.append(f"| {c['case']} | error | | | | | False |")
            continue
        lines.append(f"| {c['case']} ({c['dtype']}) | {c['loss_rel']:.1e}; {c['loss_err_scaled']:.1e} "
                     f"| {c['lp_err']:.1e} | {c['ent_err']:.1e} | {c['dh_rel']:.1e} | {c['dw_rel']:.1e} | {c['ok']} |")
    return "\n".join(lines)


def main():
    global ARGS
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="A,B")
    p.add_argument("--variants", default="A", help="shapes to time variants on")
    p.add_argument("--sweep", default="", help="shapes to sweep stage variants and profile on, e.g. A")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--rounds", type=int, default=6, help="(floor, fused) pairs alternated per shape")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script only")
    ARGS = p.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)
    if ARGS.dry_run:
        global DEV, FULL_WIDTH
        DEV, FULL_WIDTH = "cpu", (64, 1031)
        SHAPES.update(A=(300, 64, 1031), B=(200, 32, 517))
    torch.backends.cuda.matmul.allow_tf32 = False
    RESULTS["env"] = {"versions": versions(), "machine": machine(), "argv": sys.argv,
                      "knobs": {k: v for k, v in os.environ.items() if k.startswith("LOGITLESS_")}}
    log(RESULTS["env"])
    if not ARGS.no_checks:
        small_checks()
        write()
    def after():
        empty_cache()
        write()
    run_each([s for s in ARGS.shapes.split(",") if s], lambda tag: shape_run(tag, tag in ARGS.variants.split(",")),
             RESULTS["shapes"], after)
    if not ARGS.no_checks:
        full_width_checks()
    write()
    text = table()
    with open(os.path.join(ARGS.out, "table.md"), "w") as f:
        f.write(text + "\n")
    log("\nchecks ok:", all(c.get("ok") for c in RESULTS["checks"]), len(RESULTS["checks"]))
    log(text)


if __name__ == "__main__":
    main()
