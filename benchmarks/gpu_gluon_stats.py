"""Check and time the policy loss's statistics kernel on one Hopper GPU, in one process: the Gluon kernel
(ops/triton/policy_stats_gluon.py, the default there) against the Triton kernel and cuBLAS.

    PYTHONPATH=src python3 benchmarks/gpu_gluon_stats.py [--check-only] [--out DIR]

1. Outputs of the Gluon kernel against the Triton kernel's (max abs difference of m, s, t, zy and e; they
   agree bit for bit) on an odd shape (300 tokens, H=96, V=1031, labels with -1, per-token temperature) and a
   full-width chunk (4096 tokens, H=4096, V=151936).
2. One 4096-token chunk at shapes A and B's vocabularies, in rounds (the card's clock drifts; compare within a
   round): cuBLAS's [c, V] product, the Triton kernel, the Gluon kernel and its variants (VARIANTS: consumer
   tiles), each checked against the Triton kernel with the same statistics tiles.
3. --steps A,B: whole fused policy-loss steps (forward + backward, gpu_policy_loss.py's loss) of each variant
   alternating with the default in ABBA order, --rounds pairs: the variant's time over the default's.
Writes DIR/gpu_gluon_stats.json and prints a short table last.
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
from logitless.tools.common import env_set, time_cuda  # noqa: E402

# name -> (launch constants of the Gluon kernel: stages.launch("gluon_stats", ...), environment), the default
# first. 128-column statistics tiles
# (LOGITLESS_TRITON_POLICY) give the Gluon kernel 128 x 128 consumer tiles.
TILES_128 = {"LOGITLESS_TRITON_POLICY": "128,128,64,16,8,4"}
VARIANTS = {"gluon": ({}, {}), "gluon_128": ({}, TILES_128)}


def buffers(c, v):
    """NaN-filled buffers of one chunk, for the statistics tiles in force."""
    return stages.policy_buffers(c, v, torch.bfloat16, "cuda", fill=float("nan"))


def triton_kernel():
    return env_set(LOGITLESS_POLICY_STATS_KERNEL="triton")


def compare(c, h, v, consts, env):
    hidden = torch.randn(c, h, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * (4 / h ** 0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (c,), device="cuda")
    labels[::7] = -1
    inv_t = torch.rand(c, device="cuda") + 0.5
    out = []
    with env_set(**env), stages.launch("gluon_stats", **consts):
        for gluon in (True, False):
            bufs = buffers(c, v)
            assert stages.gluon_usable(hidden, weight, bufs)
            if gluon:
                k = stages.policy_stats_gluon_call(hidden, weight, labels, inv_t, bufs)
                print(f"compiled: {k.n_regs} registers, {k.n_spills} spills", flush=True)
            else:
                with triton_kernel():
                    stages.policy_stats(hidden, weight, labels, inv_t, bufs)
            torch.cuda.synchronize()
            out.append((bufs.tile_max, bufs.tile_sum, bufs.tile_ent, bufs.label_logit, bufs.e.float()))
    row = {"shape": [c, h, v], "consts": consts, "env": env}
    for name, a, b in zip(("m", "s", "t", "zy", "e"), out[1], out[0], strict=True):
        row[name] = {"max_abs": (a - b).abs().max().item(), "nan": b.isnan().any().item()}
    return row


def timing(v, rounds=4):
    c, h = 4096, 4096
    hidden = torch.randn(c, h, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * (4 / h ** 0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (c,), device="cuda")
    inv_t = torch.ones(c, device="cuda")
    z = torch.empty(c, v, dtype=torch.bfloat16, device="cuda")
    res = {"cublas": [], "triton": [], **{name: [] for name in VARIANTS}}

    def stats():
        bufs = buffers(c, v)      # sized for the statistics tiles in force
        return time_cuda(lambda: stages.policy_stats(hidden, weight, labels, inv_t, bufs), reps=5)[0]

    for _ in range(rounds):
        res["cublas"].append(time_cuda(lambda: torch.mm(hidden, weight.t(), out=z), reps=5)[0])
        with triton_kernel():
            res["triton"].append(stats())
        for name, (consts, env) in VARIANTS.items():
            with stages.launch("gluon_stats", **consts), env_set(**env):
                res[name].append(stats())
    return {"V": v, **res}


def variant_setting(consts, env):
    """A context-manager factory that puts a variant in force (for ``alternate_pairs``)."""
    @contextlib.contextmanager
    def setting():
        with stages.launch("gluon_stats", **consts), env_set(**env):
            yield
    return setting


def steps(tag, rounds):
    """Each variant's whole steps against the default's, alternating (ABBA)."""
    step = Step(fused_policy_loss, make_inputs(*SHAPES[tag]), backend="triton")
    out = {"shape": tag}
    for name, (consts, env) in list(VARIANTS.items())[1:]:
        with variant_setting(consts, env)():
            step()      # compile outside the timing
        out[name] = alternate_pairs(step, variant_setting(consts, env), rounds=rounds)
        print(tag, name, out[name], flush=True)
    del step
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--steps", default="", help="shapes (A, B) to alternate whole steps of each variant on")
    p.add_argument("--rounds", type=int, default=6, help="ABBA pairs per variant in --steps")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    result = {"checks": [], "timing": []}
    for shape in ((300, 96, 1031), (4096, 4096, 151936)):
        for name, (consts, env) in VARIANTS.items():
            result["checks"].append({"variant": name, **compare(*shape, consts, env)})
            print(result["checks"][-1], flush=True)
    if not args.check_only:
        for v in (151936, 131072):
            result["timing"].append(timing(v))
            print(result["timing"][-1], flush=True)
    result["steps"] = [steps(tag, args.rounds) for tag in args.steps.split(",") if tag]
    with open(os.path.join(args.out, "gpu_gluon_stats.json"), "w") as f:
        json.dump(result, f, indent=1)
    kinds = ("triton",) + tuple(VARIANTS)
    print("\n| V | cuBLAS ms | " + " | ".join(f"{k} ms (x cuBLAS)" for k in kinds) + " |\n"
          + "|---" * (2 + len(kinds)) + "|")
    for r in result["timing"]:
        mean = {k: sum(r[k]) / len(r[k]) for k in ("cublas",) + kinds}
        print(f"| {r['V']} | {mean['cublas']:.3f} | "
              + " | ".join(f"{mean[k]:.3f} ({mean[k] / mean['cublas']:.3f})" for k in kinds) + " |")
    if result["steps"]:
        print("\n| shape | variant | whole steps, variant / default | variant faster in |\n|---|---|---|---|")
        for r in result["steps"]:
            for name in list(VARIANTS)[1:]:
                print(f"| {r['shape']} | {name} | {r[name]['ratio']:.4f} | {r[name]['variant_faster_in']} |")


if __name__ == "__main__":
    main()
