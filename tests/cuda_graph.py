"""A training step captured in a CUDA graph, for the tests that replay one (GPU only)."""
from __future__ import annotations

import torch


def capture(step, leaves):
    """(graph, outputs) of ``step()`` (a whole step: forward, loss, backward) captured once. Two warm-up calls run
    first on a side stream (kernel builds, allocator pools, cached settings stay outside the capture); the
    ``leaves``' gradients are reset before each call, so the captured backward writes them afresh."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for leaf in leaves:
                leaf.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def replay_poisoned(graph, written) -> None:
    """``written`` filled with NaN, then the graph replayed and waited for: the replay must write every element."""
    for t in written:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
