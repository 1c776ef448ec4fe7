"""Run one forward+backward of fused_distillation_loss (jsd) in this process and print the peak resident memory
it added beyond the student's gradient buffers (see peak_memory_child.py for the method).

Usage: python peak_memory_distill_child.py BACKEND N H V
"""
import re
import sys

import torch

from logitless.losses import fused_distillation_loss


def status_kib(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def main():
    backend, n, h, v = sys.argv[1], *map(int, sys.argv[2:5])
    torch.manual_seed(0)
    hs = torch.randn(n, h).requires_grad_(True)
    ws = (torch.randn(v, h) * (4.0 / h ** 0.5)).requires_grad_(True)
    ht, wt = torch.randn(n, h + 8), torch.randn(v, h + 8) * (4.0 / h ** 0.5)
    labels = torch.randint(0, v, (n,))

    def step(rows, vocab):
        out = fused_distillation_loss(hs[:rows], ws[:vocab], labels[:rows] % vocab, teacher_hidden=ht[:rows],
                                      teacher_weight=wt[:vocab], divergence="jsd", beta=0.5, backend=backend)
        out.loss.backward()
    step(3, 50)      # warm up allocator, thread pools and kernels on a tiny problem
    hs.grad = ws.grad = None
    before = status_kib("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")   # reset VmHWM to the current RSS
    step(n, v)
    peak = status_kib("VmHWM") * 1024
    assert torch.isfinite(hs.grad).all() and torch.isfinite(ws.grad).all()
    print(f"extra_bytes={peak - before - hs.grad.nbytes - ws.grad.nbytes}")


if __name__ == "__main__":
    main()
