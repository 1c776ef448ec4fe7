"""Check and time the policy loss's dlogits pass (ops/triton/policy_dlogits.py) on one GPU, in one process.

    PYTHONPATH=src python3 benchmarks/gpu_dlogits.py [--steps A,B] [--rounds 6] [--out DIR]

1. One 4096-token chunk at shapes A and B's vocabularies: e, part_m, lse and entropy from the statistics kernel
   and the tile combine on random inputs, random loss gradients. Each variant (VARIANTS: the kernel's module
   constants) writes dlogits into a separate buffer (e stays valid between repetitions); its output must equal
   the default's (bit for bit; "max_rel_diff" says by how much a variant that rounds differently moves it).
   Timed in rounds (the card's clock drifts) next to a plain copy of the same bytes (the
   memory's practical speed), and the default in place (as in the pass).
2. --steps: whole fused policy-loss steps of the fastest variants that agree, alternating (ABBA) with the default.
Writes DIR/gpu_dlogits.json and prints a short table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from gpu_policy_loss import SHAPES, Step, alternate_pairs, make_inputs  # noqa: E402

from logitless.losses import fused_policy_loss  # noqa: E402
from logitless.ops.triton import stages  # noqa: E402
from logitless.tools.common import time_cuda  # noqa: E402

# name -> launch constants of the dlogits stage (stages.launch("dlogits", ...); the default first)
VARIANTS = {
    "default": {},
    "precise_log2": {"FAST_LOG2": False},
    "rows8": {"ROWS_PER_PROGRAM": 8},
    "tiles8": {"TILES_PER_PROGRAM": 8},
}


def chunk(v, c=4096, h=4096):
    hidden = torch.randn(c, h, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * (4 / h ** 0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (c,), device="cuda")
    inv_t = torch.ones(c, device="cuda")
    bufs = stages.policy_buffers(c, v, torch.bfloat16, "cuda")
    stages.policy_stats(hidden, weight, labels, inv_t, bufs)
    lse, ent = stages.combine(bufs)
    g_lp, g_ent = torch.randn(c, device="cuda") * 1e-4, torch.randn(c, device="cuda") * 1e-4
    return bufs, lse, ent, g_lp, g_ent, inv_t, labels


def one_chunk(v, rounds=4):
    bufs, lse, ent, g_lp, g_ent, inv_t, labels = chunk(v)
    e = bufs.e
    c = e.shape[0]
    # a separate output buffer keeps e intact across the variants (the pass itself writes over e)
    dl_buf = stages.policy_buffers(c, v, torch.bfloat16, "cuda").dlogits
    y = torch.empty_like(dl_buf)
    src = e.view(torch.bfloat16)

    def run(dl):
        stages.policy_dlogits(bufs, lse, ent, g_lp, g_ent, inv_t, labels, out=dl)

    out = {"V": v, "bytes": 2 * c * v * 2, "checks": {}}
    want = None
    for name, consts in VARIANTS.items():
        with stages.launch("dlogits", **consts):
            dl_buf.fill_(float("nan"))
            run(dl_buf)
            got = dl_buf.clone()
        if want is None:
            want = got
        out["checks"][name] = {"equal": bool(torch.equal(got, want)), "nan": bool(got.isnan().any()),
                               "max_rel_diff": float((got.float() - want.float()).abs().max()
                                                     / want.float().abs().max())}
    times = {"copy": [], "default_in_place": [], **{name: [] for name in VARIANTS}}
    for _ in range(rounds):
        times["copy"].append(time_cuda(lambda: y.copy_(src), reps=7)[0])
        for name, consts in VARIANTS.items():
            with stages.launch("dlogits", **consts):
                times[name].append(time_cuda(lambda: run(dl_buf), reps=7)[0])
    # last: in place destroys e (the rest of this shape's timings are done)
    times["default_in_place"] = [time_cuda(lambda: run(e.view(torch.bfloat16)), reps=7)[0] for _ in range(rounds)]
    out["ms"] = times
    return out


def steps(tag, names, rounds):
    step = Step(fused_policy_loss, make_inputs(*SHAPES[tag]), backend="triton")
    out = {"shape": tag}
    for name in names:
        consts = VARIANTS[name]

        @contextlib.contextmanager
        def setting(consts=consts):
            with stages.launch("dlogits", **consts):
                yield
        with setting():
            step()
        out[name] = alternate_pairs(step, setting, rounds=rounds)
        print(tag, name, out[name], flush=True)
    del step
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--steps", default="", help="shapes (A, B) to alternate whole steps of the best variants on")
    p.add_argument("--best", type=int, default=2, help="how many of the fastest variants go to --steps")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    result = {"chunks": [], "steps": []}
    for v in (151936, 131072):
        result["chunks"].append(one_chunk(v))
        print(result["chunks"][-1], flush=True)
        torch.cuda.empty_cache()
    mean = {}
    for r in result["chunks"]:
        for name, ms in r["ms"].items():
            mean.setdefault(name, []).append(sum(ms) / len(ms) / (sum(r["ms"]["copy"]) / len(r["ms"]["copy"])))
    ok = [n for n in VARIANTS if n != "default"
          and all(r["checks"][n]["equal"] and not r["checks"][n]["nan"] for r in result["chunks"])]
    best = sorted(ok, key=lambda n: sum(mean[n]))[:args.best]
    result["steps"] = [steps(tag, best, args.rounds) for tag in args.steps.split(",") if tag]
    with open(os.path.join(args.out, "gpu_dlogits.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n| variant | " + " | ".join(f"V={r['V']} ms (x copy)" for r in result["chunks"]) + " | equal |\n"
          + "|---" * (2 + len(result["chunks"])) + "|")
    for name in ("copy", "default_in_place", *VARIANTS):
        cells = []
        for r in result["chunks"]:
            ms = sum(r["ms"][name]) / len(r["ms"][name])
            copy = sum(r["ms"]["copy"]) / len(r["ms"]["copy"])
            cells.append(f"{ms:.3f} ({ms / copy:.2f}; {r['bytes'] / ms / 1e9:.2f} TB/s)")
        equal = all(r["checks"].get(name, {"equal": True})["equal"] for r in result["chunks"])
        print(f"| {name} | " + " | ".join(cells) + f" | {equal} |")
    if result["steps"]:
        print("\n| shape | variant | whole steps, variant / default | variant faster in |\n|---|---|---|---|")
        for r in result["steps"]:
            for name in best:
                print(f"| {r['shape']} | {name} | {r[name]['ratio']:.4f} | {r[name]['variant_faster_in']} |")


if __name__ == "__main__":
    main()
