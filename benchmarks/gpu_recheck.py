"""Re-time the triton backend against the cuBLAS floor at the published shapes (docs/performance.md), in one
process: a short check after a kernel refactor that should not change speed (the full study is gpu_triton.py).

    PYTHONPATH=src python3 benchmarks/gpu_recheck.py [--shapes A,B]

Per shape (bf16, logit std 4, labels sampled from the softmax): the floor (1 and 4 GEMMs) before and after,
fused_logprobs forward (no grad) and forward+backward (loss sum(a*lp) + sum(b*ent)); median of 7 calls.
"""
from __future__ import annotations

import argparse

import torch

from logitless import fused_logprobs, last_backend
from logitless.tools.common import GemmFloor, random_head, sample_labels, time_cuda

SHAPES = {"A": (16384, 4096, 151936), "B": (8192, 4096, 131072)}


def floor_ms(hidden, weight):
    gemms = GemmFloor(hidden, weight)
    out = time_cuda(gemms.forward, reps=15)[0], time_cuda(gemms.forward_backward, reps=7)[0]
    gemms.close()
    return out


def one_shape(tag: str) -> str:
    """The table row of shape ``tag``."""
    n, h, v = SHAPES[tag]
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden, weight = random_head(n, h, v, torch.bfloat16, "cuda", g)
    labels = sample_labels(hidden, weight, 1.0, g)
    a, b = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    before = floor_ms(hidden, weight)

    def fwd():
        with torch.no_grad():
            return fused_logprobs(hidden, weight, labels, backend="triton")

    def fwd_bwd():
        hd, wd = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        out = fused_logprobs(hd, wd, labels, backend="triton")
        ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
        return hd.grad, wd.grad

    f = time_cuda(fwd)[0]
    fb = time_cuda(fwd_bwd, reps=5)[0]
    assert last_backend() == "triton"
    after = floor_ms(hidden, weight)
    g1, g4 = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    return f"| {tag} | {g1:.2f} | {f:.2f} | {f / g1:.3f} | {g4:.2f} | {fb:.2f} | {fb / g4:.3f} |"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="A,B")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| shape | floor fwd ms | fwd ms | fwd x | floor 4-GEMM ms | fwd+bwd ms | fwd+bwd x |")
    print("|---|---|---|---|---|---|---|")
    for tag in args.shapes.split(","):
        print(one_shape(tag), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
