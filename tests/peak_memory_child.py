"""Run one forward+backward of fused_logprobs in this process and print the peak resident memory it added.

Usage: python peak_memory_child.py BACKEND N H V
Prints one line: ``extra_bytes=<peak RSS during fwd+bwd - RSS before - gradient buffers>``.
The peak is the kernel's own high-water mark (VmHWM), reset after the inputs are built, so what is
measured is real allocation, not an estimate.
"""
import re
import sys

import torch

from logitless import fused_logprobs


def status_kib(key: str) -> int:
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))


def main():
    backend, n, h, v = sys.argv[1], *map(int, sys.argv[2:5])
    torch.manual_seed(0)
    hidden = torch.randn(n, h).requires_grad_(True)
    weight = (torch.randn(v, h) * (4.0 / h ** 0.5)).requires_grad_(True)
    labels = torch.randint(0, v, (n,))
    a, b = torch.randn(n), torch.randn(n)
    # warm up allocator, thread pools and kernels on a tiny problem
    fused_logprobs(hidden[:3], weight[:50], labels[:3] % 50, backend=backend).logprobs.sum().backward()
    hidden.grad = weight.grad = None
    before = status_kib("VmRSS") * 1024
    open("/proc/self/clear_refs", "w").write("5")   # reset VmHWM to the current RSS
    out = fused_logprobs(hidden, weight, labels, backend=backend)
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    peak = status_kib("VmHWM") * 1024
    grad_bytes = hidden.grad.nbytes + weight.grad.nbytes
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    print(f"extra_bytes={peak - before - grad_bytes}")


if __name__ == "__main__":
    main()
