"""Time and check the fused full-vocabulary distillation losses on one CUDA GPU, in one process (about 3 minutes
on an H100 at --reps 3).

    PYTHONPATH=src python3 benchmarks/gpu_distillation.py [--reps 3] [--shapes A,B] [--divergences jsd,forward_kl,
        reverse_kl] [--extra] [--topk] [--out DIR] [--dry-run]

Shapes (bf16, V = 151936, the first 123 tokens of each 1024-token sequence unscored: a prompt, 12%):
  A: 16 x 1024 tokens, student H 4096, teacher H 4096 (the issue's shape);
  B: 8 x 1024 tokens, student H 2048, teacher H 4096.
The teacher is the student's head and hidden states plus noise, its extra hidden columns noise (logit std about
4 each, a divergence of order 0.1-1 a token).

Per shape:
1. The dense floor: four cuBLAS GEMMs of every token in bf16 (teacher forward, student forward, student
   d_hidden, student d_weight), over token chunks of 4096 (d_weight accumulated), timed before and after.
2. Per divergence (jsd with beta 0.5, forward_kl, reverse_kl): fused_distillation_loss forward+backward on its
   "triton" backend (the default on CUDA), TRL's ChunkedDivergenceFunction with beta 0.5 / 0 / 1 (TRL's
   trainer's call: scored rows compacted, sum / count), Liger's LigerFusedLinearJSD (jsd only); --extra adds
   logitless "chunked", the naive loss and torch.compile(naive). The ratio to the floor, the peak memory beyond
   the two gradient buffers. A peer that fails (out of memory, missing) is a row with its error.
3. Each one's error against float64 on the first --check-tokens tokens: the loss, the per-token divergence (where
   the peer gives it) and the student's d_hidden (relative norm).
--topk (shape A only): the top-k loss ("forward_kl_topk", k = 32) against the student's 4-GEMM floor and verl's
forward_kl_topk from the student's full bf16 logits beside it (benchmarks/gpu_topk.py measures the top-k path).

Writes DIR/gpu_distillation.json and .md and prints one table last. --dry-run runs every step on tiny shapes on
the CPU (wall-clock timing, no memory figures): a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from logitless import last_backend  # noqa: E402
from logitless.losses import fused_distillation_loss  # noqa: E402
from logitless.tools.common import markdown_table, peak_extra_bytes, random_head, time_cuda  # noqa: E402
from logitless.tools.machine import machine, versions  # noqa: E402

FULL = {"A": dict(b=16, s=1024, h=4096, ht=4096, v=151936, prompt=123),
        "B": dict(b=8, s=1024, h=2048, ht=4096, v=151936, prompt=123)}
TINY = {"A": dict(b=2, s=24, h=96, ht=96, v=4099, prompt=3),
        "B": dict(b=2, s=16, h=64, ht=96, v=4099, prompt=3)}
# logitless's divergence -> TRL's beta (the generalized JSD: 0 the forward KL, 1 the reverse KL)
BETAS = {"jsd": 0.5, "forward_kl": 0.0, "reverse_kl": 1.0}
GIB = 1 << 30
RESULTS: dict = {"rows": {}, "checks": {}}


def log(*a):
    print(*a, flush=True)


def inputs(shape, device, dtype):
    g = torch.Generator(device=device).manual_seed(0)
    n = shape["b"] * shape["s"]
    hs, ws = random_head(n, shape["h"], shape["v"], dtype, device, g)
    noise_h, noise_w = random_head(n, shape["h"], shape["v"], torch.float32, device, g)
    # a teacher near the student: its distribution differs by a divergence of order 0.1-1 a token; a wider
    # teacher's extra columns are noise of a small share of the logit
    ht = hs.float() * 0.8 + noise_h * 0.6
    wt = ws.float() * 0.8 + noise_w * 0.6
    extra = shape["ht"] - shape["h"]
    if extra:
        more_h, more_w = random_head(n, extra, shape["v"], torch.float32, device, g)
        ht, wt = torch.cat([ht, more_h], 1), torch.cat([wt, more_w * 0.2], 1)
    ht, wt = ht.to(dtype), wt.to(dtype)
    labels = torch.randint(0, shape["v"], (shape["b"], shape["s"]), device=device, generator=g)
    labels[:, :shape["prompt"]] = -100
    return hs, ws, ht, wt, labels


class Floor:
    """The four dense GEMMs of the distillation step in the inputs' dtype, over token chunks."""

    def __init__(self, hs, ws, ht, wt, rows=4096):
        self.hs, self.ws, self.ht, self.wt = hs, ws, ht, wt
        self.rows = min(rows, hs.shape[0])
        v = ws.shape[0]
        self.zs = torch.empty(self.rows, v, dtype=hs.dtype, device=hs.device)
        self.zt = torch.empty_like(self.zs)
        self.dz = torch.randn(self.rows, v, device=hs.device).to(hs.dtype)
        self.dh = torch.empty_like(hs)
        self.dw = torch.empty_like(ws)

    def __call__(self):
        n = self.hs.shape[0]
        for i, start in enumerate(range(0, n, self.rows)):
            stop = min(n, start + self.rows)
            c = stop - start
            torch.mm(self.ht[start:stop], self.wt.t(), out=self.zt[:c])
            torch.mm(self.hs[start:stop], self.ws.t(), out=self.zs[:c])
            torch.mm(self.dz[:c], self.ws, out=self.dh[start:stop])
            if i == 0:
                torch.mm(self.dz[:c].t(), self.hs[start:stop], out=self.dw)
            else:
                self.dw.addmm_(self.dz[:c].t(), self.hs[start:stop])


def jsd_terms(ls, lt, beta):
    """The naive per-token generalized JSD from float32 log-probs (TRL's definition; beta 0 / 1 the KLs)."""
    if beta == 0.0:
        return (lt.exp() * (lt - ls)).sum(-1)
    if beta == 1.0:
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def naive(hs, ws, ht, wt, valid, beta):
    """(loss, per-token divergence of the scored rows): the logits of both heads in the inputs' dtype."""
    zs = torch.nn.functional.linear(hs[valid], ws).float()
    with torch.no_grad():
        zt = torch.nn.functional.linear(ht[valid], wt).float()
    d = jsd_terms(zs.log_softmax(-1), zt.log_softmax(-1), beta)
    return d.sum() / valid.sum().clamp_min(1), d


def methods(divergence, extra):
    """name -> fn(hs, ws, ht, wt, labels) returning (loss, per-token divergence of the scored rows or None)."""
    out = {}
    beta = BETAS[divergence]

    def ours_with(backend):
        def ours(hs, ws, ht, wt, labels):
            flat = labels.view(-1)
            r = fused_distillation_loss(hs, ws, flat, teacher_hidden=ht, teacher_weight=wt, divergence=divergence,
                                        beta=beta if divergence == "jsd" else None, backend=backend)
            return r.loss, r.divergence[flat != -100]
        return ours
    out["logitless (triton)"] = ours_with("triton")
    if extra:
        out["logitless (chunked)"] = ours_with("chunked")
    try:
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    except Exception as exc:  # noqa: BLE001 - a missing peer is a row too
        out[f"TRL ChunkedDivergenceFunction (beta {beta})"] = f"not importable: {type(exc).__name__}: {exc}"
    else:
        def trl(hs, ws, ht, wt, labels):
            valid = (labels != -100).view(-1)
            d, _ = ChunkedDivergenceFunction.apply(hs[valid], ws, None, ht[valid], wt, None, beta, 1.0, 1.0, None,
                                                   1.0, None)
            return d.sum() / valid.sum().clamp_min(1), d
        out[f"TRL ChunkedDivergenceFunction (beta {beta})"] = trl
    if divergence != "jsd":
        return out
    try:
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD
    except Exception as exc:  # noqa: BLE001
        out["Liger LigerFusedLinearJSD"] = f"not importable: {type(exc).__name__}: {exc}"
    else:
        liger_loss = LigerFusedLinearJSD(jsd_beta=beta, temperature=1.0)

        def liger(hs, ws, ht, wt, labels):
            return liger_loss(hs, ws, ht, wt, labels.view(-1)), None
        out["Liger LigerFusedLinearJSD"] = liger
    if not extra:
        return out

    def plain(hs, ws, ht, wt, labels):
        return naive(hs, ws, ht, wt, (labels != -100).view(-1), beta)
    out["naive"] = plain
    compiled = torch.compile(naive)

    def compiled_naive(hs, ws, ht, wt, labels):
        return compiled(hs, ws, ht, wt, (labels != -100).view(-1), beta)
    out["torch.compile(naive)"] = compiled_naive
    return out


def truth64(hs, ws, ht, wt, labels, beta):
    """float64 loss (token-mean), per-token divergence of the scored rows, d_hidden [n, H]."""
    valid = (labels != -100).view(-1)
    h = hs.double().requires_grad_()
    zs = h[valid] @ ws.double().t()
    zt = ht[valid].double() @ wt.double().t()
    d = jsd_terms(zs.log_softmax(-1), zt.log_softmax(-1), beta)
    loss = d.sum() / valid.sum()
    (dh,) = torch.autograd.grad(loss, [h])
    return loss.item(), d.detach(), dh


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def accuracy(name, fn, data, beta, truth):
    hs, ws, ht, wt, labels = data
    h = hs.clone().requires_grad_()
    w = ws.clone().requires_grad_()
    loss, d = fn(h, w, ht, wt, labels)
    loss.backward()
    loss64, d64, dh64 = truth
    row = {"loss_rel_err": abs(loss.item() - loss64) / abs(loss64), "d_hidden_rel_err": rel(h.grad, dh64)}
    if d is not None:
        row["divergence_max_abs_err"] = float((d.detach().double() - d64).abs().max())
    return row


def step_of(fn, data):
    hs, ws, ht, wt, labels = data
    h = hs.detach().requires_grad_()
    w = ws.detach().requires_grad_()

    def step():
        h.grad = w.grad = None
        loss, _ = fn(h, w, ht, wt, labels)
        loss.backward()
    return step, (h, w)


def run_method(key, name, fn, data, beta, reps, device, truth, small):
    row = RESULTS["rows"].setdefault(key, {})
    if isinstance(fn, str):
        row["error"] = fn
        return
    try:
        row.update(accuracy(name, fn, small, beta, truth))
    except Exception as exc:  # noqa: BLE001
        row["accuracy_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        step, (h, w) = step_of(fn, data)
        step()
        if device.type == "cuda":
            h.grad = w.grad = None
            grads = h.numel() * h.element_size() + w.numel() * w.element_size()
            peak, _ = peak_extra_bytes(step, device)
            row["extra_memory_gib"] = (peak - grads) / GIB
        row["fwd_bwd_ms"] = time_cuda(step, warmup=1, reps=reps, device=device)[0]
    except Exception as exc:  # noqa: BLE001
        row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        log(traceback.format_exc()[-1500:])
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()
    log(key, row)


def topk_section(data, reps, device):
    """The top-k loss against the student's 4-GEMM floor (student forward twice, d_hidden, d_weight)."""
    try:
        from logitless import fused_topk
        from logitless.losses import distill_topk  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        RESULTS["rows"]["logitless forward_kl_topk (k=32)"] = {"error": f"not in this build: {exc}"}
        return
    hs, ws, ht, wt, labels = data
    with torch.no_grad():
        top = fused_topk(ht, wt, 32)
    floor = Floor(hs, ws, hs, ws)
    floor_ms = time_cuda(floor, warmup=1, reps=reps, device=device)[0]
    del floor

    for overlap in (True, False):
        def fn(h, w, _ht, _wt, lab, overlap=overlap):
            r = fused_distillation_loss(h, w, lab.view(-1), teacher_topk_ids=top.ids.view(-1, 32),
                                        teacher_topk_logprobs=top.logprobs.view(-1, 32), divergence="forward_kl_topk",
                                        with_overlap=overlap)
            return r.loss, None
        step, _ = step_of(fn, data)
        ms = time_cuda(step, warmup=1, reps=reps, device=device)[0]
        RESULTS["rows"][f"logitless forward_kl_topk (k=32, with_overlap={overlap})"] = {
            "fwd_bwd_ms": ms, "student_floor_ms": floor_ms, "x_student_floor": ms / floor_ms}
    verl_topk_row(data, top, floor_ms, reps, device)


def verl_topk_row(data, top, floor_ms, reps, device):
    """verl 0.9.1's forward_kl_topk as its FSDP logits processor computes it: the student's bf16 logits of every
    token (the model's head), then its loss on them against the same teacher top-k, token-mean over the scored
    tokens; forward + backward against the same student floor. A row with its error where verl is missing."""
    name = "verl forward_kl_topk from full logits (k=32)"
    try:
        from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk
        from verl.workers.config import DistillationConfig, DistillationLossConfig
    except Exception as exc:  # noqa: BLE001
        RESULTS["rows"][name] = {"error": f"verl not importable: {type(exc).__name__}: {str(exc)[:200]}"}
        return
    cfg = DistillationConfig(distillation_loss=DistillationLossConfig(loss_mode="forward_kl_topk", topk=32,
                                                                      use_policy_gradient=False))
    n = data[4].numel()

    def nested(t):
        return torch.nested.nested_tensor([t.reshape(n, 32)], layout=torch.jagged)
    t_lp, t_ids = nested(top.logprobs.float()), nested(top.ids)

    def fn(h, w, _ht, _wt, lab):
        logits = torch.nn.functional.linear(h.reshape(1, n, -1), w)
        out = compute_forward_kl_topk(logits, t_lp, t_ids, cfg, "thd")
        scored = (lab.reshape(-1) != -100).float()
        per_token = out["distillation_losses"][0].reshape(-1).clamp_min(0.0)    # verl's registered loss clamps
        return (per_token * scored).sum() / scored.sum(), None
    try:
        step, _ = step_of(fn, data)
        ms = time_cuda(step, warmup=1, reps=reps, device=device)[0]
        RESULTS["rows"][name] = {"fwd_bwd_ms": ms, "student_floor_ms": floor_ms, "x_student_floor": ms / floor_ms}
    except Exception as exc:  # noqa: BLE001
        RESULTS["rows"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        log(traceback.format_exc()[-1500:])
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--shapes", default="A,B", help="A: the issue's shape; B: student H 2048, teacher H 4096, 8192 "
                   "tokens")
    p.add_argument("--divergences", default="jsd,forward_kl,reverse_kl")
    p.add_argument("--check-tokens", type=int, default=512, help="tokens of the float64 checks")
    p.add_argument("--extra", action="store_true", help="also logitless 'chunked', the naive loss, torch.compile")
    p.add_argument("--topk", action="store_true", help="also the top-k rows (shape A)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dry = args.dry_run
    device = torch.device("cpu" if dry else "cuda")
    shapes = TINY if dry else FULL
    names = [x for x in args.shapes.split(",") if x]
    divergences = [x for x in args.divergences.split(",") if x]
    for bad in [x for x in names if x not in shapes] + [x for x in divergences if x not in BETAS]:
        raise SystemExit(f"unknown shape or divergence {bad!r}: shapes {list(shapes)}, divergences {list(BETAS)}")
    reps = 2 if dry else args.reps
    RESULTS["env"] = {"versions": versions(), "machine": machine(), "argv": sys.argv,
                      "shapes": {x: shapes[x] for x in names}, "divergences": divergences}
    RESULTS["floor_ms"] = {}
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    table_rows = []
    for shape_name in names:
        shape = shapes[shape_name]
        data = inputs(shape, device, torch.bfloat16)
        c = min(args.check_tokens, data[0].shape[0])
        small = (data[0][:c], data[1], data[2][:c], data[3], data[4].reshape(-1)[:c].reshape(1, c))
        floor = Floor(*data[:4])
        floor_ms = [time_cuda(floor, warmup=1, reps=reps, device=device)[0]]
        del floor
        keys = []
        for divergence in divergences:
            beta = BETAS[divergence]
            truth = truth64(*small, beta)
            for name, fn in methods(divergence, args.extra).items():
                key = f"{shape_name} {divergence}: {name}"
                keys.append(key)
                run_method(key, name, fn, data, beta, reps, device, truth, small)
                RESULTS["rows"][key].update(shape=shape_name, divergence=divergence, method=name)
                if name.startswith("logitless"):
                    RESULTS["checks"][f"last_backend {key}"] = last_backend()
            del truth
            if device.type == "cuda":
                torch.cuda.empty_cache()
        floor = Floor(*data[:4])
        floor_ms.append(time_cuda(floor, warmup=1, reps=reps, device=device)[0])
        del floor
        RESULTS["floor_ms"][shape_name] = floor_ms
        if args.topk and shape_name == "A":
            before = set(RESULTS["rows"])
            topk_section(data, reps, device)
            for key in [k for k in RESULTS["rows"] if k not in before]:
                RESULTS["rows"][key].update(shape=shape_name, divergence="forward_kl_topk", method=key)
                keys.append(key)
        del data, small
        if device.type == "cuda":
            torch.cuda.empty_cache()
        base = min(floor_ms)
        for key in keys:
            row = RESULTS["rows"][key]
            ms = row.get("fwd_bwd_ms")
            # the top-k rows against the student's own 4-GEMM floor, the others against the two heads' floor
            ratio = f"{row['x_student_floor']:.2f}x (student)" if "x_student_floor" in row else (
                f"{ms / base:.2f}x" if ms else "-")
            table_rows.append([shape_name, row["method"], row["divergence"], f"{ms:.1f}" if ms else "-", ratio,
                               f"{row['extra_memory_gib']:.2f}" if "extra_memory_gib" in row else "-",
                               f"{row['loss_rel_err']:.1e}" if "loss_rel_err" in row else "-",
                               f"{row['divergence_max_abs_err']:.1e}" if "divergence_max_abs_err" in row else "-",
                               f"{row['d_hidden_rel_err']:.1e}" if "d_hidden_rel_err" in row else "-",
                               (row.get("error") or row.get("accuracy_error") or "")[:80]])
    table = markdown_table(["shape", "method", "divergence", "fwd+bwd ms", "x 4-GEMM floor", "GiB over grads",
                            "loss rel err", "div max abs err", "d_hidden rel err", "error"], table_rows)
    shapes_text = "; ".join(f"{x}: {shapes[x]}, floor {RESULTS['floor_ms'][x]} ms (before, after)" for x in names)
    head = (f"distillation, bf16, {shapes_text}{'; DRY RUN on CPU: not a measurement' if dry else ''}\n\n")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_distillation.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_distillation.md"), "w") as f:
        f.write(head + table)
    log(head + table)


if __name__ == "__main__":
    main()
