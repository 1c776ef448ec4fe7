"""The public ops' calls whose kernel launches ``sm90_launches`` records."""
from __future__ import annotations

import torch

import logitless

N, H, V = 7, 96, 4099


def drive(case):
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16,):
        case[0] = f"fused_logprobs {dtype}"
        hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
        weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_()
        labels = torch.randint(0, V, (N,), generator=g)
        out = logitless.fused_logprobs(hidden, weight, labels, backend="triton")
        (out.logprobs.sum() + out.entropy.sum()).backward()
