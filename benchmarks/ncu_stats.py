"""One 4096-token chunk of the policy loss's statistics kernel (the default: Gluon on Hopper; --triton: the
Triton kernel) after a warm-up call, for a hardware-counter profile:

    ncu --clock-control none --kernel-name regex:policy_stats --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 benchmarks/ncu_stats.py [--triton]
"""
from __future__ import annotations

import argparse
import os

import torch

from logitless.ops.triton import stages


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--triton", action="store_true", help="the Triton kernel (LOGITLESS_POLICY_STATS_KERNEL=triton)")
    p.add_argument("--vocab", type=int, default=151936)
    args = p.parse_args()
    if args.triton:
        os.environ["LOGITLESS_POLICY_STATS_KERNEL"] = "triton"
    c, h, v = 4096, 4096, args.vocab
    hidden = torch.randn(c, h, device="cuda").to(torch.bfloat16)
    weight = (torch.randn(v, h, device="cuda") * (4 / h ** 0.5)).to(torch.bfloat16)
    labels = torch.randint(0, v, (c,), device="cuda")
    inv_t = torch.ones(c, device="cuda")
    bufs = stages.policy_buffers(c, v, torch.bfloat16, "cuda")
    for _ in range(2):
        stages.policy_stats(hidden, weight, labels, inv_t, bufs)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
