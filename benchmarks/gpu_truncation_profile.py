"""Where the truncated log-prob's time goes, stage by stage: the selection rounds (candidates per round, tokens
asked), the per-token decisions, the kept pairs' products and their backward, the plain op of the tokens left
untruncated; beside the plain head's forward and forward+backward on the same inputs.

    PYTHONPATH=src python3 benchmarks/gpu_truncation_profile.py --out DIR [--n 16384] [--logit-std 4]
    PYTHONPATH=src python3 benchmarks/gpu_truncation_profile.py --dry-run      # CPU, tiny shapes, interpreter

Shape: bf16, N tokens (default 16 x 1024), H 4096, V 151936, labels sampled from the head's distribution (as
`make gpu-check`'s truncation section). Settings: top_k 50, top_p 0.95, min_p 0.05 (`--settings`). Each stage is
timed by wrapping the function that runs it, with a device synchronisation either side (so the stages' sum is a
little above the call's own time); the whole calls are timed without the wrappers. Then the kept pairs alone (each
token's top `--pair-k` ids, 50 by default: top_k 50's pairs): their products, d_hidden and d_weight on the torch
path (float32 gathers, index_add) and on the Triton kernels (``ops/triton/pair_products``), side by side in this
process, against one LM-head GEMM [N, H] x [H, V] (cuBLAS) and the bytes of the pairs' rows read once. Writes
DIR/gpu_truncation_profile.json and .md, and prints the tables.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from logitless import Truncation, fused_logprobs, fused_topk  # noqa: E402
from logitless.ops import function, kept_pairs, label_set_function, truncation, truncation_dense, truncation_wide  # noqa: E402
from logitless.tools.common import env_set, markdown_table, random_head, sample_labels, sync, time_calls  # noqa: E402
from logitless.tools.machine import machine, versions  # noqa: E402

FULL = dict(n=16 * 1024, h=4096, v=151936)
TINY = dict(n=24, h=40, v=1031)
SETTINGS = {"top_k=50": dict(top_k=50), "top_p=0.95": dict(top_p=0.95), "min_p=0.05": dict(min_p=0.05),
            # the wide round's kept sets sorted and cut (the route before ``triton/nucleus.py``), in this process
            "top_p=0.95/sort": dict(top_p=0.95),
            # the emitting pass on 128 x 128 tiles (ptxas: 0.4 KB of spills a thread, 4.3 KB at the default 128 x 256)
            "top_p=0.95/above128": dict(top_p=0.95)}
ENV = {"top_p=0.95/sort": {"LOGITLESS_TRUNCATION_NUCLEUS": "sort"},
       "top_p=0.95/above128": {"LOGITLESS_TRITON_ABOVE": "128,128,64,16,8,3"}}


class Stages:
    """Seconds and calls per stage name, from wrapped functions (synchronised either side)."""

    def __init__(self, dev):
        self.dev = dev
        self.seconds = collections.defaultdict(float)
        self.calls = collections.defaultdict(int)
        self.notes = collections.defaultdict(list)
        self._saved = []

    def wrap(self, module, name: str, stage: str, note=None) -> None:
        fn = getattr(module, name)

        def timed(*args, **kwargs):
            sync(self.dev)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.dev)
            self.seconds[stage] += time.perf_counter() - t0
            self.calls[stage] += 1
            if note is not None:
                self.notes[stage].append(note(*args, **kwargs))
            return out
        self._saved.append((module, name, fn))
        setattr(module, name, timed)

    def restore(self) -> None:
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.notes.clear()


def instrument(stages: Stages) -> None:
    # each selection round: candidates asked (k) and tokens asked (rows of the block)
    stages.wrap(label_set_function, "fused_topk", "select: fused_topk rounds",
                note=lambda h, w, it, mask, k, *a, **kw: f"{h.shape[0]}x{k}")
    stages.wrap(truncation, "decide", "select: decide")
    # the wide round (kept sets past the first candidates: its above-threshold passes, sorts and decisions)
    stages.wrap(truncation_wide, "wide_round", "select: wide round",
                note=lambda h, *a, **kw: f"{h.shape[0]} tokens")
    # inside the wide round: its emitting GEMM pass, the nucleus kernel's decisions, the sort-and-cut of the rest
    stages.wrap(truncation_wide, "_emit", "wide: above-bound pass (GEMM)", note=lambda h, w, it, tau, cap, *a: f"{cap}")
    stages.wrap(truncation_wide, "_direct", "wide: nucleus kernel")
    stages.wrap(truncation_wide, "_sorted", "wide: sort and cut", note=lambda v, *a, **kw: f"{v.shape[0]} tokens")
    stages.wrap(truncation, "select", "select (whole)")
    stages.wrap(truncation, "kept_logprobs", "kept log-probs (whole forward after select)")
    stages.wrap(kept_pairs, "pair_products", "pairs: products (forward)",
                note=lambda h, w, rows, ids: f"P={rows.numel()}")
    stages.wrap(kept_pairs, "add_pairs_dh", "pairs: d_hidden (backward)")
    # the wide sets' backward (dlogits masked to each kept set, then cuBLAS): tokens a call
    stages.wrap(truncation_dense.DenseBackward, "backward", "dense backward (wide sets)",
                note=lambda ctx, *g: f"{ctx.saved_tensors[2].numel()} tokens")
    stages.wrap(kept_pairs, "add_pairs_dw", "pairs: d_weight (backward)")
    stages.wrap(function, "fused_logprobs", "plain op (untruncated tokens)")


def pair_paths(hidden, weight, k: int, backend: str, dev: str, reps: int, warmup: int):
    """The kept pairs of each token's top k ids: ms of the products, d_hidden and d_weight on the torch path and on
    the Triton kernels (LOGITLESS_PAIRS_PATH set to each in turn), the two paths' largest differences, one
    LM-head GEMM's ms, and the bytes of each pair's weight row read once."""
    n, h = hidden.shape
    with torch.no_grad():
        ids = fused_topk(hidden, weight, k, backend=backend).ids
    rows = torch.arange(n, device=ids.device).repeat_interleave(ids.shape[1])
    ids = ids.reshape(-1).contiguous()
    g = torch.Generator(device=dev).manual_seed(1)
    coef = torch.randn(rows.shape, device=dev, generator=g)
    # the gradients add into buffers allocated once (the timed calls exclude the allocation and its zeroing)
    dh_acc = torch.zeros(n, h, dtype=torch.float32, device=dev)
    dw_acc = torch.zeros_like(weight)
    ops = {
        "products (forward)": lambda: kept_pairs.pair_products(hidden, weight, rows, ids),
        "d_hidden (backward)": lambda: kept_pairs.add_pairs_dh(dh_acc, weight, rows, ids, coef),
        "d_weight (backward)": lambda: kept_pairs.add_pairs_dw(dw_acc, hidden, rows, ids, coef),
    }
    outs: dict = {}
    ms: dict = {}
    before = os.environ.get("LOGITLESS_PAIRS_PATH")
    try:
        for path, knob in (("torch", "torch"), ("triton", "triton")):
            os.environ["LOGITLESS_PAIRS_PATH"] = knob
            for name, fn in ops.items():
                ms[(path, name)] = min(time_calls(fn, dev, reps=reps, warmup=warmup))
            raw = ops["products (forward)"]()
            dh = torch.zeros(n, h, dtype=torch.float32, device=dev)
            kept_pairs.add_pairs_dh(dh, weight, rows, ids, coef)
            dw = torch.zeros_like(weight)
            kept_pairs.add_pairs_dw(dw, hidden, rows, ids, coef)
            outs[path] = (raw, dh, dw.float())
    finally:
        if before is None:
            os.environ.pop("LOGITLESS_PAIRS_PATH", None)
        else:
            os.environ["LOGITLESS_PAIRS_PATH"] = before
    diff = {name: float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)
            for name, a, b in zip(ops, outs["triton"], outs["torch"], strict=True)}
    z = torch.empty(n, weight.shape[0], dtype=hidden.dtype, device=dev)
    gemm = min(time_calls(lambda: torch.mm(hidden, weight.t(), out=z), dev, reps=reps, warmup=warmup))
    return dict(pairs=rows.numel(), k=k, gemm_ms=gemm, row_bytes=rows.numel() * h * weight.element_size(),
                ms={f"{path}: {name}": v for (path, name), v in ms.items()}, rel_diff=diff)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-truncation-profile")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--logit-std", type=float, default=None, help="the head's logit std (default random_head's)")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pair-k", type=int, default=50, help="ids per token of the pairs' side-by-side section")
    args = ap.parse_args()
    shape = dict(TINY if args.dry_run else FULL)
    if args.n:
        shape["n"] = args.n
    dev = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    backend = "triton" if args.dry_run else "auto"
    g = torch.Generator(device=dev).manual_seed(0)
    kw = {} if args.logit_std is None else {"logit_std": args.logit_std}
    hidden, weight = random_head(shape["n"], shape["h"], shape["v"], torch.bfloat16, dev, g, **kw)
    labels = sample_labels(hidden, weight, 1.0, g)
    a = torch.randn(shape["n"], device=dev, generator=g)
    reps, warmup = (1, 0) if args.dry_run else (args.reps, 1)
    res = {"machine": machine(), "versions": versions(), "shape": shape, "logit_std": args.logit_std, "rows": {}}
    os.makedirs(args.out, exist_ok=True)

    def forward(t):
        def call():
            with torch.no_grad():
                return fused_logprobs(hidden, weight, labels, with_entropy=False, truncation=t, backend=backend)
        return call

    def step(t):
        hd, wd = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

        def call():
            hd.grad = wd.grad = None
            out = fused_logprobs(hd, wd, labels, with_entropy=False, truncation=t, backend=backend)
            (out.logprobs * a).sum().backward()
            return out
        return call

    plain_f = min(time_calls(forward(None), dev, reps=reps, warmup=warmup))
    plain_fb = min(time_calls(step(None), dev, reps=reps, warmup=warmup))
    res["plain_ms"] = {"forward": plain_f, "forward+backward": plain_fb}
    table = [["plain head", "forward", f"{plain_f:.1f}", "1.00", ""],
             ["plain head", "forward+backward", f"{plain_fb:.1f}", "1.00", ""]]
    stages = Stages(torch.device(dev))
    outs = {}
    for name in args.settings.split(","):
        with env_set(**ENV.get(name, {})):
            t = Truncation(**SETTINGS[name])
            f = min(time_calls(forward(t), dev, reps=reps, warmup=warmup))
            fb = min(time_calls(step(t), dev, reps=reps, warmup=warmup))
            out = step(t)()
            outs[name] = out
            row = {"forward_ms": f, "forward+backward_ms": fb,
                   "kept_median": int(out.kept_count.float().median()), "kept_max": int(out.kept_count.max()),
                   "stages_forward": {}, "stages_step": {}}
            base = outs.get(name.split("/")[0]) if "/" in name else None
            if base is not None:     # the two routes' outputs on the same inputs
                row["vs_" + name.split("/")[0]] = {
                    "kept_count_differ": int((out.kept_count != base.kept_count).sum()),
                    "inside_differ": int((out.inside != base.inside).sum()),
                    "logprobs_max_diff": float((out.logprobs - base.logprobs).detach().abs().max())}
            versus = "".join(f"; {k}: {v}" for k, v in row.items() if k.startswith("vs_"))
            table += [[name, "forward", f"{f:.1f}", f"{f / plain_f:.2f}", f"kept median {row['kept_median']}, "
                       f"max {row['kept_max']}{versus}"],
                      [name, "forward+backward", f"{fb:.1f}", f"{fb / plain_fb:.2f}", ""]]
            instrument(stages)
            try:
                for key, call in (("stages_forward", forward(t)), ("stages_step", step(t))):
                    stages.reset()
                    call()
                    row[key] = {s: {"ms": stages.seconds[s] * 1e3, "calls": stages.calls[s],
                                    "notes": stages.notes.get(s, [])[:8]} for s in stages.seconds}
                    for s, v in row[key].items():
                        table.append([name, f"  {key[7:]}: {s}", f"{v['ms']:.1f}", "", f"{v['calls']} calls "
                                      + " ".join(v["notes"])])
            finally:
                stages.restore()
            res["rows"][name] = row
            with open(os.path.join(args.out, "gpu_truncation_profile.json"), "w") as fh:
                json.dump(res, fh, indent=1)
    pairs = pair_paths(hidden, weight, min(args.pair_k, shape["v"]), backend, dev, reps, warmup)
    res["pairs"] = pairs
    with open(os.path.join(args.out, "gpu_truncation_profile.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    gbytes = pairs["row_bytes"] / 1e9
    pair_table = []
    for name in ("products (forward)", "d_hidden (backward)", "d_weight (backward)"):
        t_ms, k_ms = pairs["ms"][f"torch: {name}"], pairs["ms"][f"triton: {name}"]
        pair_table.append([name, f"{t_ms:.2f}", f"{k_ms:.2f}", f"{t_ms / k_ms:.2f}", f"{k_ms / pairs['gemm_ms']:.2f}",
                           f"{gbytes / (k_ms * 1e-3):.0f}", f"{pairs['rel_diff'][name]:.1e}"])
    card = torch.cuda.get_device_name() if dev == "cuda" else "CPU (dry run)"
    head = (f"truncation profile, {card}, torch {torch.__version__}, N {shape['n']} H {shape['h']} V {shape['v']} "
            f"bf16, logit std {args.logit_std or 'default'}; best of {reps} calls (ms)\n\n")
    md = head + markdown_table(["setting", "what", "ms", "x plain", "note"], table)
    md += (f"\n\nthe kept pairs alone: P {pairs['pairs']} (top {pairs['k']} ids a token), one LM-head GEMM "
           f"{pairs['gemm_ms']:.2f} ms; GB/s: the pairs' rows read once ({gbytes:.2f} GB) over the Triton time; "
           "diff: the largest |triton - torch| over the torch path's largest value\n\n")
    md += markdown_table(["pairs", "torch ms", "triton ms", "torch / triton", "triton x GEMM", "GB/s", "diff"],
                         pair_table)
    with open(os.path.join(args.out, "gpu_truncation_profile.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
