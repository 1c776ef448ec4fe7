"""A float32 LM head on one CUDA GPU: each precision's time and error, against cuBLAS, in one process.

    PYTHONPATH=src python3 benchmarks/gpu_fp32_head.py [--shapes 8192,16384]
        [--paths split:both,split:hidden,split:neither,split:hidden+copies,split:neither+copies,tf32,ieee]
        [--out DIR] [--dry-run]

For each N (H 4096, V 151936; float32 hidden and weight, logit std 4, labels sampled from the softmax):
1. cuBLAS GEMM [N, H] x [H, V] in bfloat16 (float32 accumulation, the bf16 floor), TF32 and IEEE float32, and the
   bfloat16 4-GEMM floor of a forward+backward (``GemmFloor``);
2. logitless (triton) on float32 operands for each path, and on the same values rounded to bfloat16 ("bf16
   operands"): fused_logprobs forward, forward+backward, fused_policy_loss forward+backward (PPO clip, entropy
   bonus), medians of CUDA events; the ratios to the bf16 GEMM and to the 4-GEMM floor; peak memory beyond the
   inputs (forward+backward). Paths: "split:both" (both operands hold bfloat16 values: the adaptive split runs
   one product, "bf16x1"), "split:hidden" (hidden does, as TRL's cast_lm_head_to_fp32: "bf16x2"),
   "split:neither" (general float32 operands: "bf16x3"), each with the default precision (the adaptive split,
   checked against ``last_precision()``), split in the kernels' registers or, with the suffix "+copies", from the
   concatenated bfloat16 copies (LOGITLESS_SPLIT_IN_KERNEL=0), with "+flush<K>" the in-kernel split's accumulator
   flushed every K of the depth (LOGITLESS_SPLIT_FLUSH_K, 0: never), with "+tiles128x128x64x8x8x3" the kernels'
   tiles (LOGITLESS_TRITON_FWD / _BWD / _POLICY, a sweep); or a precision forced by name ("bf16x3",
   "bf16x6", "tf32", "ieee");
3. on the first 256 tokens: max |log-prob| and |entropy| error against float64 of the path's float32 operands,
   at logit std 4 and 8 (the weight doubled: exact, and still bfloat16 values where it was), and the gradients'
   relative errors (d_hidden, d_weight of sum(a * logprob) + sum(b * entropy)), with the default gradient
   products and, for the splits, with split gradients (grad_precision "bf16x3").
Targets (issue 42): "split:hidden" forward <= 2.3x the bf16 GEMM, fused_logprobs fwd+bwd <= 1.8x the 4-GEMM floor,
fused_policy_loss <= 1.2x; "split:both" within 5% of "bf16 operands" and the same statistics bit for bit
("same_as_bf16"); "split:neither" forward <= 3.2x, fwd+bwd <= 2.2x; every error <= 1e-4; peak memory <= the bf16
operands' + 0.5 GiB (fused_logprobs forward+backward beyond the inputs; the policy loss beyond the inputs
and its gradient buffers). Writes DIR/gpu_fp32_head.json and DIR/gpu_fp32_head.md and prints the table last. About 3
minutes on one H100 with the defaults (IEEE float32 runs 3 timed calls, the rest 5).
--dry-run: every step on tiny shapes on the CPU (triton's interpreter, wall-clock): a check of the script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from logitless import fused_logprobs, last_backend, last_precision  # noqa: E402
from logitless.losses import fused_policy_loss  # noqa: E402
from logitless.tools.common import (  # noqa: E402
    GemmFloor,
    env_set,
    markdown_table,
    peak_extra_bytes,
    random_head,
    run_each,
    sample_labels,
    time_cuda,
)
from logitless.tools.machine import machine, versions  # noqa: E402

PATHS = ("split:both", "split:hidden", "split:neither", "split:hidden+copies", "split:neither+copies", "tf32",
         "ieee")
# a path's suffixes: "+copies", its split made from the concatenated bfloat16 copies (LOGITLESS_SPLIT_IN_KERNEL=0),
# not in the kernels' registers; "+flush<K>", the in-kernel split's accumulator flushed every K of the depth
# (LOGITLESS_SPLIT_FLUSH_K; 0 never); "+tiles<BMxBNxBKxGROUPxWARPSxSTAGES>", every kernel's tiles
# (LOGITLESS_TRITON_FWD / _BWD / _POLICY): the ways in one process


def suffix_env(tag: str) -> dict:
    """The knobs a path's suffixes set."""
    env = {}
    for part in tag.split("+")[1:]:
        if part == "copies":
            env["LOGITLESS_SPLIT_IN_KERNEL"] = "0"
        elif part.startswith("flush") and part[5:].isdigit():
            env["LOGITLESS_SPLIT_FLUSH_K"] = part[5:]
        elif part.startswith("tiles") and len(part[5:].split("x")) == 6:
            for stage in ("FWD", "BWD", "POLICY"):
                env[f"LOGITLESS_TRITON_{stage}"] = part[5:].replace("x", ",")
        else:
            raise SystemExit(f"unknown suffix +{part} in {tag!r}: +copies, +flush<K> or +tiles<BMxBNxBKxGxWxS>")
    return env
# the adaptive split's products for each "split:" path's operands
SPLIT_RAN = {"both": "bf16x1", "hidden": "bf16x2", "neither": "bf16x3"}
LOSS = dict(clip_low=0.2, clip_high=0.28, entropy_coef=0.01, loss_agg="token-mean")
ERROR_TOKENS = 256
GIB = 1 << 30


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


class Bench:
    def __init__(self, dev: str, dry: bool):
        self.dev, self.dry = dev, dry

    def time(self, fn, slow=False):
        """median ms (3 timed calls for the slow IEEE path, 5 otherwise; 2 and 1 in a dry run)."""
        reps = 1 if self.dry else (3 if slow else 5)
        return time_cuda(fn, warmup=1, reps=reps, device=self.dev)[0]

    def gemms(self, hidden, weight, out: dict):
        """cuBLAS [N, H] x [H, V]: bf16 (float32 accumulation), TF32, IEEE float32; the bf16 4-GEMM floor."""
        hb, wb = hidden.bfloat16(), weight.bfloat16()
        floor = GemmFloor(hb, wb)
        out["gemm_bf16_ms"] = self.time(floor.forward)
        out["floor4_bf16_ms"] = self.time(floor.forward_backward)
        floor.close()
        del floor, hb, wb
        # float32 output in token chunks of at most 2^30 elements (4 GiB), the same GEMM
        f32 = GemmFloor(hidden, weight, max_elements=1 << 30)
        saved = torch.backends.cuda.matmul.allow_tf32
        try:
            torch.backends.cuda.matmul.allow_tf32 = True
            out["gemm_tf32_ms"] = self.time(f32.forward)
            torch.backends.cuda.matmul.allow_tf32 = False
            out["gemm_ieee_ms"] = self.time(f32.forward, slow=True)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved
            f32.close()

    def timings(self, hidden, weight, labels, adv, old, precision, out: dict):
        """fused_logprobs forward, forward+backward and fused_policy_loss forward+backward, ms; peak extra GiB."""
        hidden, weight, kw, expect = operands(precision, hidden, weight)
        slow = precision == "ieee"
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)

        def forward():
            with torch.no_grad():
                return fused_logprobs(h, w, labels, backend="triton", **kw)

        def forward_backward():
            o = fused_logprobs(h, w, labels, backend="triton", **kw)
            (o.logprobs.sum() + 0.01 * o.entropy.sum()).backward()
            h.grad = w.grad = None

        def policy():
            loss = fused_policy_loss(h, w, labels, adv, old, backend="triton", **kw, **LOSS).loss
            loss.backward()
            h.grad = w.grad = None

        out["forward_ms"] = self.time(forward, slow)
        assert last_backend() == "triton"
        out["ran"] = list(last_precision())
        assert out["ran"][0] == expect, out["ran"]
        out["fwd_bwd_ms"] = self.time(forward_backward, slow)
        out["policy_ms"] = self.time(policy, slow)
        peak, _ = peak_extra_bytes(forward_backward, self.dev)
        out["peak_fwd_bwd_gib"] = None if peak is None else peak / GIB
        # the policy loss's peak beyond the inputs less its gradient buffers (d_hidden, d_weight in the operands'
        # dtype): what the pass itself holds (workspace, statistics, the split's parts), issue 42's memory target
        peak, _ = peak_extra_bytes(policy, self.dev)
        grads = h.numel() * h.element_size() + w.numel() * w.element_size()
        out["peak_policy_beyond_grads_gib"] = None if peak is None else (peak - grads) / GIB

    def errors(self, hidden, weight, labels, precision, out: dict):
        """Against float64 of the float32 operands on the first ERROR_TOKENS tokens."""
        n = min(ERROR_TOKENS, hidden.shape[0])
        gen = torch.Generator(device=self.dev).manual_seed(7)
        a = torch.randn(n, device=self.dev, generator=gen, dtype=torch.float64)
        b = torch.randn(n, device=self.dev, generator=gen, dtype=torch.float64)
        y = labels[:n]
        # the path's float32 operands (the truth is theirs), and the rounded ones "bf16 operands" multiplies
        h_path, w_path, kw, _ = operands(precision, hidden[:n], weight)
        h32, w32 = (hidden[:n], weight) if precision == "bf16 operands" else (h_path, w_path)
        for scale, tag_std in ((1.0, ""), (2.0, "_std8")):
            h64 = h32.double().requires_grad_(True)
            w64 = (w32.double() * scale).detach().requires_grad_(True)
            logp = torch.log_softmax(h64 @ w64.t(), dim=-1)
            lp64 = logp.gather(1, y.unsqueeze(1)).squeeze(1)
            ent64 = -(logp.exp() * logp).sum(-1)
            ((lp64 * a).sum() + (ent64 * b).sum()).backward()
            dh64, dw64 = h64.grad, w64.grad
            del logp, h64, w64
            grads = [None] if tag_std or not precision.startswith(("split", "bf16x")) else [None, "bf16x3"]
            for grad_precision in grads:
                gkw = dict(kw, grad_precision=grad_precision) if grad_precision else kw
                h = h_path.detach().clone().requires_grad_(True)
                w = (w_path * scale).detach().requires_grad_(True)   # exact: a power of two
                o = fused_logprobs(h, w, y, backend="triton", **gkw)
                ((o.logprobs * a.float()).sum() + (o.entropy * b.float()).sum()).backward()
                if grad_precision is None:
                    out["logprob_err" + tag_std] = (o.logprobs.double() - lp64).abs().max().item()
                    out["entropy_err" + tag_std] = (o.entropy.double() - ent64).abs().max().item()
                if not tag_std:
                    tag = "" if grad_precision is None else "_split_grads"
                    out["dh_rel" + tag] = rel(h.grad, dh64)
                    out["dw_rel" + tag] = rel(w.grad, dw64)
                del o, h, w
        if precision == "split:both":   # one bfloat16 product: the bfloat16 path's statistics bit for bit
            with torch.no_grad():
                x = fused_logprobs(h_path, w_path, y, backend="triton")
                r = fused_logprobs(h_path.bfloat16(), w_path.bfloat16(), y, backend="triton")
            out["same_as_bf16"] = bool(torch.equal(x.logprobs, r.logprobs) and torch.equal(x.entropy, r.entropy))


def operands(path: str, hidden, weight):
    """(hidden, weight, fused_logprobs keywords, the statistics precision that must run) of a path."""
    path = path.split("+")[0]
    if path == "bf16 operands":   # the same values rounded: the bfloat16 path
        return hidden.bfloat16(), weight.bfloat16(), {}, "native"
    if path.startswith("split:"):
        exact = path.split(":", 1)[1]
        if exact not in SPLIT_RAN:
            raise SystemExit(f"unknown path {path!r}: split:both, split:hidden or split:neither")
        if exact in ("hidden", "both"):
            hidden = hidden.bfloat16().float()
        if exact == "both":
            weight = weight.bfloat16().float()
        # the default precision on CUDA is the adaptive split; the CPU's (a dry run) is IEEE: named there
        return hidden, weight, ({} if hidden.is_cuda else {"precision": "split"}), SPLIT_RAN[exact]
    return hidden, weight, {"precision": path}, path


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8192,16384", help="token counts N (H 4096, V 151936)")
    p.add_argument("--paths", default=",".join(PATHS),
                   help="split:both / split:hidden / split:neither (the default precision on such operands) or a "
                        "precision forced by name (bf16x3, bf16x6, tf32, ieee)")
    p.add_argument("--out", default="bench-fp32-head")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dry = args.dry_run
    dev = "cpu" if dry else "cuda"
    if not dry and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --dry-run)")
    h_size, vocab = (64, 1000) if dry else (4096, 151936)
    ns = [48, 40] if dry else [int(x) for x in args.shapes.split(",")]
    precisions = [x for x in args.paths.split(",") if x]
    os.makedirs(args.out, exist_ok=True)
    results = {"machine": machine(), "versions": versions(), "H": h_size, "V": vocab, "shapes": {}}
    bench = Bench(dev, dry)

    def save():
        with open(os.path.join(args.out, "gpu_fp32_head.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)

    for n in ns:
        run_shape(bench, n, h_size, vocab, precisions, results["shapes"].setdefault(str(n), {}), save)
        if dev == "cuda":
            torch.cuda.empty_cache()
    save()
    table = summary(results)
    with open(os.path.join(args.out, "gpu_fp32_head.md"), "w") as f:
        f.write(table)
    print(table)


def run_shape(bench: Bench, n: int, h_size: int, vocab: int, precisions: list, shape: dict, save) -> None:
    dev = bench.dev
    gen = torch.Generator(device=dev).manual_seed(n)
    hidden, weight = random_head(n, h_size, vocab, torch.float32, dev, gen)
    labels = sample_labels(hidden, weight, 1.0, gen)
    adv = torch.randn(n, device=dev, generator=gen)
    old = -torch.rand(n, device=dev, generator=gen) * 3
    log(f"N={n} H={h_size} V={vocab}")
    run_each(["cublas"], lambda tag: bench.gemms(hidden, weight, shape.setdefault(tag, {})), shape, save)
    log("cublas", shape.get("cublas"))

    def one(tag):
        out = shape.setdefault(tag, {})
        with env_set(**suffix_env(tag)):
            bench.errors(hidden, weight, labels, tag, out)
            bench.timings(hidden, weight, labels, adv, old, tag, out)
        log(tag, out)
    run_each(["bf16 operands", *precisions], one, shape, save)
    bench.__dict__.pop("ref", None)


def summary(results) -> str:
    rows = []
    for n, shape in results["shapes"].items():
        g = shape.get("cublas", {})
        gemm, floor = g.get("gemm_bf16_ms"), g.get("floor4_bf16_ms")
        for name in ("bf16", "tf32", "ieee"):
            ms = g.get(f"gemm_{name}_ms")
            rows.append([n, f"cuBLAS {name} GEMM", fmt(ms, ".1f"), ratio(ms, gemm), "-", "-", "-", "-", "-", "-",
                         "-", "-", "-"])
        for tag, out in shape.items():
            if tag == "cublas" or not isinstance(out, dict) or "forward_ms" not in out:
                continue
            rows.append([n, f"logitless {tag}", fmt(out["forward_ms"], ".1f"), ratio(out["forward_ms"], gemm),
                         fmt(out["fwd_bwd_ms"], ".1f"), ratio(out["fwd_bwd_ms"], floor), fmt(out["policy_ms"], ".1f"),
                         ratio(out["policy_ms"], floor),
                         f"{fmt(out.get('logprob_err'), '.1e')} / {fmt(out.get('logprob_err_std8'), '.1e')}",
                         f"{fmt(out.get('entropy_err'), '.1e')} / {fmt(out.get('entropy_err_std8'), '.1e')}",
                         f"{fmt(out.get('dh_rel'), '.1e')} / {fmt(out.get('dh_rel_split_grads'), '.1e')}",
                         fmt(out.get("peak_fwd_bwd_gib"), ".2f"), fmt(out.get("peak_policy_beyond_grads_gib"), ".2f")])
    cols = ["N", "path", "fwd ms", "x bf16 GEMM", "fwd+bwd ms", "x 4-GEMM floor", "policy ms", "x 4-GEMM floor",
            "lp err (std 4 / 8)", "ent err (std 4 / 8)", "dh rel (default / split grads)", "peak GiB",
            "policy peak GiB beyond grads"]
    return markdown_table(cols, [[str(c) for c in r] for r in rows])


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def ratio(a, b):
    return "-" if a is None or not b else f"{a / b:.2f}"


if __name__ == "__main__":
    main()
