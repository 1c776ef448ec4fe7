"""Peak memory of the chunked backend, measured for real in child processes (issue: <15% of one logits tensor)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

N, H, V = 8192, 256, 65536
LOGITS_BYTES = N * V * 4   # one float32 logits tensor: 2 GiB

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="needs Linux /proc to read and reset peak RSS")


def extra_bytes(backend: str) -> int:
    env = dict(os.environ)
    env.pop("LOGITLESS_CHUNK_ELEMENTS", None)   # the default chunk size is what users get
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("peak_memory_child.py")), backend,
                           str(N), str(H), str(V)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return int(re.search(r"extra_bytes=(-?\d+)", proc.stdout).group(1))


def test_chunked_peak_memory_is_a_small_fraction_of_the_logits():
    chunked = extra_bytes("chunked")
    reference = extra_bytes("reference")
    print(f"extra peak memory: chunked {chunked / 2**20:.0f} MiB, reference {reference / 2**20:.0f} MiB, "
          f"one fp32 logits tensor {LOGITS_BYTES / 2**20:.0f} MiB")
    # the measurement sees a materialised logits tensor when there is one
    assert reference >= LOGITS_BYTES
    assert chunked < 0.15 * LOGITS_BYTES
