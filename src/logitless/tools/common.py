"""What every benchmark shares: input dtypes, random LM-head inputs with realistic logits, labels
sampled from the softmax, the cuBLAS GEMM floor, device synchronisation, timing and table cells.

Used by `logitless bench`, `logitless bench --tp` and the GPU scripts under benchmarks/, so that they
all measure the same work against the same floor.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
import traceback
from typing import Callable, Iterator, Optional

import torch
from torch import Tensor

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Logit standard deviation of the benchmark inputs (what trained LM heads show, roughly).
LOGIT_STD = 4.0
# Tokens whose labels are sampled at once: never an [N, V] softmax (it would not fit at large N).
SAMPLE_ELEMENTS = 1 << 24


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of ``fn`` (synchronised before and after); its result is dropped after the
    clock stops."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    seconds = time.perf_counter() - t0
    del out
    return seconds


def time_calls(fn: Callable[[], object], device, reps: int = 7, warmup: int = 2) -> list[float]:
    """Milliseconds of each of ``reps`` calls of ``fn`` after ``warmup`` calls: CUDA events on a CUDA
    ``device``, the wall clock (synchronised) elsewhere (the GPU scripts' CPU dry runs)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            times.append(time_call(fn, device) * 1e3)
    return times


def time_cuda(fn: Callable[[], object], warmup: int = 2, reps: int = 7, device="cuda") -> tuple[float, float, float]:
    """(median, min, max) of :func:`time_calls` on ``device`` (CUDA events on a GPU)."""
    times = sorted(time_calls(fn, device, reps, warmup))
    return times[len(times) // 2], times[0], times[-1]


def peak_extra_bytes(fn: Callable[[], object], device) -> tuple[Optional[int], object]:
    """(peak bytes allocated during ``fn()`` above what was allocated before, fn's result); the bytes are
    None off CUDA (torch's allocator statistics are CUDA's)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, fn()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    out = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base, out


@contextlib.contextmanager
def env_set(**values) -> Iterator[None]:
    """Environment variables (LOGITLESS_* knobs, read at call time) set for the block, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: str(v) for k, v in values.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def random_head(n: int, h: int, v: int, dtype: torch.dtype, device, generator: torch.Generator,
                logit_std: float = LOGIT_STD) -> tuple[Tensor, Tensor]:
    """hidden [n, h] ~ N(0, 1) and weight [v, h] ~ N(0, s^2) in ``dtype``, with s = logit_std / sqrt(h)
    so that every logit has standard deviation ``logit_std``."""
    hidden = torch.randn(n, h, device=device, generator=generator).to(dtype)
    weight = (torch.randn(v, h, device=device, generator=generator) * (logit_std / math.sqrt(h))).to(dtype)
    return hidden, weight


def sample_labels(hidden: Tensor, weight: Tensor, temperature: float, generator: torch.Generator) -> Tensor:
    """int64 [N]: one token per row drawn from softmax(hidden @ weight.T / temperature), as RL rollouts
    draw them, a few rows at a time (float32 logits of at most SAMPLE_ELEMENTS)."""
    n, v = hidden.shape[0], weight.shape[0]
    labels = torch.empty(n, dtype=torch.long, device=hidden.device)
    step = max(1, SAMPLE_ELEMENTS // v)
    with torch.no_grad():
        for i in range(0, n, step):
            z = (hidden[i:i + step] @ weight.t()).float() / temperature
            labels[i:i + step] = torch.multinomial(torch.softmax(z, dim=1), 1, generator=generator).squeeze(1)
    return labels


# Elements of the [tokens, V] buffers the floor multiplies into (2^32: 8 GiB in bf16 each). Larger problems
# (a million tokens) run the same GEMMs over token chunks of that size, accumulating dW.
FLOOR_ELEMENTS = 1 << 32


class GemmFloor:
    """The GEMMs of an [N, H] x [V, H] head in the input dtype: forward = 1 ([N,H] x [H,V]),
    forward+backward = 4 (forward, the recompute a fused backward does, dH = dZ W, dW = dZ^T h).

    Where [N, V] exceeds ``max_elements`` the same products run over token chunks (dW accumulated
    across them), so the floor exists at any N. Construction allocates and touches the [chunk, V]
    output and the gradient-sized buffers, so the timed calls measure arithmetic, not page faults of
    fresh buffers; ``close()`` frees them."""

    def __init__(self, hidden: Tensor, weight: Tensor, max_elements: int = FLOOR_ELEMENTS):
        n, v = hidden.shape[0], weight.shape[0]
        self.hidden, self.weight = hidden, weight
        self.step = max(1, min(n, max_elements // v))
        self.z = torch.full((self.step, v), 0.5, device=hidden.device, dtype=hidden.dtype)
        # stands for d_logits; drawn in the input dtype (a float32 draw would double the buffer)
        self.dz = torch.randn(self.step, v, device=hidden.device, dtype=hidden.dtype)
        self.dh = torch.full_like(hidden, 0.5)
        self.dw = torch.full_like(weight, 0.5)

    def _chunks(self):
        n = self.hidden.shape[0]
        for start in range(0, n, self.step):
            stop = min(start + self.step, n)
            yield self.hidden[start:stop], self.z[:stop - start], self.dz[:stop - start], self.dh[start:stop]

    def forward(self) -> None:
        for h, z, _, _ in self._chunks():
            torch.mm(h, self.weight.t(), out=z)

    def forward_backward(self) -> None:
        for i, (h, z, dz, dh) in enumerate(self._chunks()):
            torch.mm(h, self.weight.t(), out=z)
            torch.mm(h, self.weight.t(), out=z)
            torch.mm(dz, self.weight, out=dh)
            if i == 0:
                torch.mm(dz.t(), h, out=self.dw)
            else:
                self.dw.addmm_(dz.t(), h)

    def close(self) -> None:
        self.z = self.dz = self.dh = self.dw = None


def rel_err(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the benches' gradient errors against their reference)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def gemm_tflops(n: int, h: int, v: int, seconds: float, gemms: int = 1) -> float:
    return gemms * 2.0 * n * h * v / seconds / 1e12


def cell(value: Optional[float], spec: str) -> str:
    """A table cell: ``value`` formatted, or "-" when there is none."""
    return "-" if value is None else format(value, spec)


def markdown_table(columns: list[str], rows: list[list[str]]) -> str:
    """A markdown table of string cells ("|" inside a cell becomes "/")."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def run_each(tags: list[str], run: Callable[[str], object], results: dict,
             after: Callable[[], object] = lambda: None) -> None:
    """``run(tag)`` for each tag; one that raises leaves the tail of its traceback in
    ``results.setdefault(tag, {})["error"]`` (and on stdout), and the next tag still runs; ``after()``
    follows every tag (the GPU scripts save their results there)."""
    for tag in tags:
        try:
            run(tag)
        except Exception:  # noqa: BLE001 - a shape that fails is a result too
            results.setdefault(tag, {})["error"] = traceback.format_exc()[-2000:]
            print(traceback.format_exc(), flush=True)
        after()
