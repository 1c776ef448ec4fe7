"""Peak memory of the distillation loss's chunked pass, measured for real in child processes: a bounded
workspace, a small fraction of one [tokens x V] float32 logits tensor (the reference backend, both heads' logits
at once, is the measurement's control)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

N, H, V = 8192, 64, 16384
LOGITS_BYTES = N * V * 4   # one float32 logits tensor: 512 MiB
CHILD = Path(__file__).parents[1] / "peak_memory_distill_child.py"

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="needs Linux /proc to read and reset peak RSS")


def extra_bytes(backend: str, n: int = N) -> int:
    env = dict(os.environ)
    env.pop("LOGITLESS_CHUNK_ELEMENTS", None)   # the default chunk size is what users get
    # a fixed mmap threshold: every block above it is mapped and unmapped on its own, so the peak RSS is the pass's
    # allocations. glibc's default raises the threshold as large blocks are freed and then keeps the chunks it
    # serves from its heaps, which moved the same run's figure over 111-185 MiB (65.5-65.8 MiB with it fixed)
    env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    proc = subprocess.run([sys.executable, str(CHILD), backend, str(n), str(H), str(V)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(re.search(r"extra_bytes=(-?\d+)", proc.stdout).group(1))


def test_chunked_distillation_peak_memory_is_a_small_fraction_of_the_logits():
    chunked = extra_bytes("chunked")
    doubled = extra_bytes("chunked", 2 * N)
    reference = extra_bytes("reference")
    print(f"extra peak memory: chunked {chunked / 2**20:.0f} MiB ({doubled / 2**20:.0f} MiB at twice the tokens), "
          f"reference {reference / 2**20:.0f} MiB, one fp32 logits tensor {LOGITS_BYTES / 2**20:.0f} MiB")
    assert reference >= 2 * LOGITS_BYTES          # the control: both heads' logits at once are seen
    # a workspace of token chunks (the allocator's high-water mark included), not of the tokens: twice the tokens
    # add only their [N]-sized vectors
    assert chunked < 0.4 * LOGITS_BYTES
    assert doubled < chunked + 0.1 * LOGITS_BYTES
