"""Time fused_topk and the top-k distillation divergence on one GPU, in one process, against the GEMM floor.

    PYTHONPATH=src python3 benchmarks/gpu_topk.py [--out DIR] [--dry-run]
    PYTHONPATH=src python3 benchmarks/gpu_topk.py --sweep [--configs "BM,BN,BK,G,W,S:C;..."] [--dry-run]

Shape: bf16, 16 x 1024 tokens (about 12% not scored / masked), H=4096, V=151936, k=32 (and k=128 for fused_topk).
1. Checks against float64 on the first 64 tokens: fused_topk's ids, log-probs and tail; the divergences' values.
2. Timings (medians of 7 after 2 warm-up calls, CUDA events), in the same process:
   - floor: 1 GEMM forward ([N, H] x [H, V], cuBLAS, bf16 out), 4 GEMMs forward + backward;
   - fused_topk at k 32 and k 128 (backend "auto": the triton selection kernels on CUDA, ``topk_select``; the
     rows their candidates could not hold, redone exactly, are counted) against the 1-GEMM floor (target
     <= 1.10x); and the torch vocabulary pass it replaced (backend "chunked") at k 32;
   - naive top-k: bf16 logits, float32 log_softmax, torch.topk, the tail as log1p(-sum p) (it keeps [N, V]);
   - fused_distillation_loss forward + backward (token-mean), "forward_kl_topk" (its one-pass route: the policy
     pass's three GEMMs with the gradients formed in the forward, the student's own top k by the selection
     kernel in the statistics' GEMM; ``losses/distill_topk_function.py``) and "forward_kl_topk_tail"
     (topk_divergence's route: the torch pass forward, the backward's dlogits kernel ``triton/tail_dlogits.py``),
     backend "auto", against the 4-GEMM floor (targets <= 0.80x and <= 0.85x); "forward_kl_topk"
     with_overlap=False (the one-pass route without the selection); and "forward_kl_topk" by topk_divergence (the
     route through fused_logprobs_k: statistics pass + selection, then a backward that recomputes the logits), for
     comparison. Each row's ``_entry`` in the JSON is the op that ran last (``last_path().entry``):
     "fused_distillation_loss" for the one-pass route, "fused_logprobs_k" for the other;
   - peak memory above the inputs (MiB).
Writes DIR/gpu_topk.json and DIR/gpu_topk.md, and prints the table last.

--sweep: only fused_topk, one row per configuration of the selection kernels (tiles BM,BN,BK,GROUP_M,warps,stages
as LOGITLESS_TRITON_TOPK takes them, and the first pass's candidates a tile C, LOGITLESS_TOPK_CANDIDATES; "-"
keeps the forward's tiles) at k 32 and 128: ms (median of 3 after 1 warm-up), x the 1-GEMM floor, the first pass
alone on one chunk x the GEMM of that chunk (the kernel's own cost, without the finish, torch.topk and redo), and
the fraction of scored rows redone. Writes DIR/gpu_topk_sweep.json. --dry-run: tiny shapes on the CPU
(triton's interpreter, wall clock, no memory figures): a check of the script, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from logitless import fused_topk, last_backend  # noqa: E402
from logitless.losses import fused_distillation_loss  # noqa: E402
from logitless.losses.distill_topk import topk_divergence  # noqa: E402
from logitless.ops.triton import stages  # noqa: E402
from logitless.record import last_path  # noqa: E402
from logitless.tools.common import GemmFloor, env_set, markdown_table, peak_extra_bytes, random_head  # noqa: E402
from logitless.tools.common import time_cuda as _time_cuda  # noqa: E402
from logitless.tools.machine import machine, versions  # noqa: E402

FULL = dict(n=16 * 1024, h=4096, v=151936, k=32, k_large=128)
TINY = dict(n=40, h=32, v=1031, k=5, k_large=20)
MIB = 1 << 20
# (row, divergence, with_overlap, through fused_distillation_loss) of the timed losses
LOSSES = (("forward_kl_topk", "forward_kl_topk", True, True),
          ("forward_kl_topk_tail", "forward_kl_topk_tail", True, True),
          ("forward_kl_topk, no overlap", "forward_kl_topk", False, True),
          ("forward_kl_topk, topk_divergence", "forward_kl_topk", True, False))


def log(*a):
    print(*a, flush=True)


def warm_reps(dev):
    return (2, 7) if dev == "cuda" else (1, 2)


def time_ms(fn, dev):
    warm, reps = warm_reps(dev)
    return _time_cuda(fn, warm, reps, device=dev)[0]


def inputs(shape, dev, dtype):
    g = torch.Generator(device=dev).manual_seed(0)
    hidden, weight = random_head(shape["n"], shape["h"], shape["v"], dtype, dev, g)
    scored = torch.rand(shape["n"], device=dev, generator=g) > 0.12
    # a teacher's top-k: another head's (the student's weight plus noise), taken with fused_topk itself
    t_weight = (weight.float() + 0.5 * weight.float().std() * torch.randn(weight.shape, device=dev, generator=g))
    teacher = fused_topk(hidden, t_weight.to(dtype), shape["k"], mask=scored)
    labels = torch.where(scored, 0, -100)
    t_ids = torch.where(scored.unsqueeze(1), teacher.ids, torch.arange(shape["k"], device=dev))
    return hidden, weight, scored, labels, t_ids, teacher.logprobs.detach()


def checks(hidden, weight, scored, labels, t_ids, t_lp, k):
    """float64 on the first 64 tokens: the op's errors (what the table's error column shows)."""
    n = min(64, hidden.shape[0])
    h, m = hidden[:n], scored[:n]
    out = fused_topk(h, weight, k, mask=m)
    logp = torch.log_softmax(h.double() @ weight.double().t(), -1)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices[:, :k]
    lp = logp.gather(1, order)
    tail = torch.logsumexp(logp.scatter(1, order, float("-inf")), -1)
    res = {"topk_ids_equal": bool(torch.equal(out.ids[m], order[m])),
           "topk_logprob_err": float((out.logprobs[m].double() - lp[m]).abs().max()),
           "topk_tail_err": float((out.tail_logprob[m].double() - tail[m]).abs().max())}
    s = logp.gather(1, t_ids[:n])
    q = t_lp[:n].double()
    kl = (q.exp() * (q - s)).sum(-1).clamp_min(0)
    qt = (1 - q.exp().sum(-1)).clamp_min(0)
    s_tail = torch.logsumexp(logp.scatter(1, t_ids[:n], float("-inf")), -1)
    kl_tail = (q.exp() * (q - s)).sum(-1) + torch.where(qt > 0, qt * (qt.clamp_min(1e-300).log() - s_tail), 0.0)
    for name, want in (("forward_kl_topk", kl), ("forward_kl_topk_tail", kl_tail)):
        got = topk_divergence(h, weight, labels[:n], t_ids[:n], t_lp[:n], divergence=name).divergence
        res[f"{name}_err"] = float((got[m].double() - want[m]).abs().max())
    # gradients through the compiled backward (backend "auto": Triton's kernels on CUDA) against float64 autograd
    hg, wg = h.detach().requires_grad_(), weight.detach().requires_grad_()
    d = topk_divergence(hg, wg, labels[:n], t_ids[:n], t_lp[:n], divergence="forward_kl_topk_tail")
    d.divergence.sum().backward()
    res["grad_backend"] = last_backend()
    h64, w64 = h.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t(), -1)
    s = logp.gather(1, t_ids[:n])
    s_tail = torch.logsumexp(logp.scatter(1, t_ids[:n], float("-inf")), -1)
    want = (q.exp() * (q - s)).sum(-1) + torch.where(qt > 0, qt * (qt.clamp_min(1e-300).log() - s_tail), 0.0)
    (want * m).sum().backward()
    for name, got, ref in (("d_hidden", hg.grad, h64.grad), ("d_weight", wg.grad, w64.grad)):
        res[f"tail_{name}_rel_err"] = float((got.double() - ref).norm() / ref.norm())
    return res


def naive_topk(hidden, weight, k):
    logp = torch.log_softmax((hidden @ weight.t()).float(), -1)
    lp, ids = logp.topk(k, dim=-1)
    return ids, lp, torch.log1p(-lp.exp().sum(-1))


# the sweep's default configurations: (tiles or "-" for the forward's, C)
SWEEP = ("-:2", "-:4", "-:8", "128,256,64,16,8,4:4", "64,256,64,16,4,3:4", "128,128,64,16,8,4:4",
         "128,128,64,16,4,3:4", "64,256,64,16,4,4:2")
TINY_SWEEP = ("-:2", "16,64,32,4,4,1:4")


def parse_configs(text: str) -> list[tuple[str, int]]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        tiles, _, c = item.partition(":")
        if tiles != "-" and len(tiles.split(",")) != 6:
            raise ValueError(f"--configs: {item!r}: tiles are six integers BM,BN,BK,GROUP_M,warps,stages or '-'")
        out.append((tiles, int(c or stages.TOPK_CANDIDATES)))
    return out


def first_pass_ratio(hidden, weight, k, dev):
    """The first pass alone (candidates kernel) on one chunk of tokens, over the GEMM of that chunk."""
    rows = min(hidden.shape[0], stages.topk_chunk_rows(weight.shape[0], k, hidden.dtype, hidden.device))
    h = hidden[:rows]
    z = torch.empty((rows, weight.shape[0]), device=dev, dtype=hidden.dtype)
    gemm = _time_cuda(lambda: torch.mm(h, weight.t(), out=z), 1, 3, device=dev)[0]
    first = _time_cuda(lambda: stages.topk_first_pass(h, weight, k), 1, 3, device=dev)[0]
    return first / gemm


def sweep(args, dev, shape, dtype):
    """One row per configuration (``SWEEP`` or --configs) of fused_topk through the selection kernels."""
    g = torch.Generator(device=dev).manual_seed(0)
    hidden, weight = random_head(shape["n"], shape["h"], shape["v"], dtype, dev, g)
    scored = torch.rand(shape["n"], device=dev, generator=g) > 0.12
    floor = GemmFloor(hidden, weight)
    f = _time_cuda(floor.forward, 1, 3, device=dev)[0]
    floor.close()
    del floor
    configs = parse_configs(args.configs or ";".join(TINY_SWEEP if args.dry_run else SWEEP))
    backend = "triton" if args.dry_run else "auto"
    rows, res = [], {"shape": shape, "machine": machine(), "versions": versions(), "floor_fwd_ms": f, "rows": []}
    with stages.topk_rows_redone() as redone:
        for tiles, c in configs:
            env = {"LOGITLESS_TOPK_CANDIDATES": str(c)}
            if tiles != "-":
                env["LOGITLESS_TRITON_TOPK"] = tiles
            with env_set(**env):
                for k in (shape["k"], shape["k_large"]):
                    redone.clear()
                    try:
                        ms = _time_cuda(lambda k=k: fused_topk(hidden, weight, k, mask=scored, backend=backend),
                                        1, 3, device=dev)[0]
                        first = first_pass_ratio(hidden[scored], weight, k, dev)
                        frac = sum(redone) / len(redone) / max(1, int(scored.sum()))
                        row = dict(tiles=tiles, C=c, k=k, ms=ms, ratio=ms / f, first_pass_ratio=first,
                                   redone=frac, backend=last_backend())
                    except Exception as e:        # a configuration the compiler refuses (shared memory...)
                        row = dict(tiles=tiles, C=c, k=k, error=f"{type(e).__name__}: {str(e)[:120]}")
                    res["rows"].append(row)
                    log(row)
                    rows.append([tiles, str(c), str(k)] + (
                        [row["error"], "-", "-", "-"] if "error" in row else
                        [f"{row['ms']:.2f}", f"{row['ratio']:.3f}", f"{row['first_pass_ratio']:.3f}",
                         f"{row['redone']:.2e}"]))
    table = markdown_table(["tiles", "C", "k", "ms", "x GEMM", "first pass x chunk GEMM", "rows redone"], rows)
    with open(os.path.join(args.out, "gpu_topk_sweep.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    log(f"\nshape {shape}, bf16, {dev}; 1-GEMM floor {f:.2f} ms")
    log(table)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: checks the script only")
    p.add_argument("--sweep", action="store_true", help="only fused_topk, one row per kernel configuration")
    p.add_argument("--configs", default="", help='with --sweep: "BM,BN,BK,GROUP_M,warps,stages:C;..." ("-": the '
                   "forward's tiles)")
    args = p.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    shape = TINY if args.dry_run else FULL
    dtype = torch.bfloat16
    os.makedirs(args.out, exist_ok=True)
    if args.sweep:
        sweep(args, dev, shape, dtype)
        return
    res = {"shape": shape, "machine": machine(), "versions": versions(), "checks": {}, "ms": {}, "mib": {}}
    hidden, weight, scored, labels, t_ids, t_lp = inputs(shape, dev, dtype)
    res["checks"] = checks(hidden, weight, scored, labels, t_ids, t_lp, shape["k"])
    log("checks", res["checks"])

    floor = GemmFloor(hidden, weight)
    res["ms"]["floor_fwd"] = time_ms(floor.forward, dev)
    res["ms"]["floor_fwd_bwd"] = time_ms(floor.forward_backward, dev)
    floor.close()
    del floor

    k = shape["k"]
    # the dry run's CPU would pick the torch pass for "auto": the kernels run there through the interpreter
    backend = "triton" if args.dry_run else "auto"
    with stages.topk_rows_redone() as redone:
        for kk in (k, shape["k_large"]):
            key = f"fused_topk k{kk}"
            redone.clear()
            res["ms"][key] = time_ms(lambda kk=kk: fused_topk(hidden, weight, kk, mask=scored, backend=backend), dev)
            res[f"{key}_backend"] = last_backend()
            # rows the first pass's candidates could not hold (redone exactly by the second pass), per scored row
            res[f"{key}_rows_redone"] = sum(redone) / sum(warm_reps(dev)) / max(1, int(scored.sum()))
            res["mib"][key], _ = peak_extra_bytes(
                lambda kk=kk: fused_topk(hidden, weight, kk, mask=scored, backend=backend), dev)
    key = f"fused_topk k{k}, torch pass"
    res["ms"][key] = time_ms(lambda: fused_topk(hidden, weight, k, mask=scored, backend="chunked"), dev)
    try:
        res["ms"]["naive_topk"] = time_ms(lambda: naive_topk(hidden, weight, k), dev)
        res["mib"]["naive_topk"], _ = peak_extra_bytes(lambda: naive_topk(hidden, weight, k), dev)
    except torch.OutOfMemoryError:
        res["ms"]["naive_topk"] = None
    if dev == "cuda":
        torch.cuda.empty_cache()

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    for key, name, overlap, as_loss in LOSSES:
        def step(name=name, overlap=overlap, as_loss=as_loss):
            h.grad = w.grad = None
            if as_loss:     # token-mean over the scored tokens
                fused_distillation_loss(h, w, labels, divergence=name, teacher_topk_ids=t_ids,
                                        teacher_topk_logprobs=t_lp, log_prob_min_clamp=-10.0, with_overlap=overlap,
                                        backend=backend).loss.backward()
                return
            d = topk_divergence(h, w, labels, t_ids, t_lp, divergence=name, log_prob_min_clamp=-10.0,
                                with_overlap=overlap, backend=backend)
            (d.divergence.sum() / scored.sum()).backward()
        res["ms"][key] = time_ms(step, dev)
        res[f"{key}_backend"] = last_backend()
        res[f"{key}_entry"] = last_path().entry
        h.grad = w.grad = None      # the peak above the inputs alone (the timed calls' gradients freed first)
        res["mib"][key], _ = peak_extra_bytes(step, dev)
    res["mib"] = {key: (None if b is None else b / MIB) for key, b in res["mib"].items()}

    f, fb = res["ms"]["floor_fwd"], res["ms"]["floor_fwd_bwd"]
    rows = [["GEMM floor, 1 forward", f"{f:.2f}", "1.00", "-", "-"],
            ["GEMM floor, 4 forward+backward", f"{fb:.2f}", "1.00", "-", "-"]]
    targets = {"forward_kl_topk": "<= 0.80", "forward_kl_topk_tail": "<= 0.85"}
    for key, floor_ms, target in ((f"fused_topk k{k}", f, "<= 1.10"),
                                  (f"fused_topk k{shape['k_large']}", f, "<= 1.10"),
                                  (f"fused_topk k{k}, torch pass", f, "-"), ("naive_topk", f, "-"),
                                  *((key, fb, targets.get(key, "-")) for key, _, _, _ in LOSSES)):
        ms = res["ms"].get(key)
        mib = res["mib"].get(key)
        rows.append([key, "-" if ms is None else f"{ms:.2f}", "-" if ms is None else f"{ms / floor_ms:.2f}",
                     target, "-" if mib is None else f"{mib:.0f}"])
    table = markdown_table(["what", "ms", "x floor", "target", "peak MiB"], rows)
    with open(os.path.join(args.out, "gpu_topk.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    with open(os.path.join(args.out, "gpu_topk.md"), "w") as fh:
        fh.write(f"shape {shape}, bf16, device {dev}\n\nchecks {res['checks']}\n\n{table}")
    log(f"\nshape {shape}, bf16, {dev}; checks {res['checks']}")
    log(table)


if __name__ == "__main__":
    main()
