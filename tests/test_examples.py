"""The examples run as a user runs them (a fresh process), and print what they promise."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(name: str, *args: str) -> str:
    env = dict(os.environ)
    env.pop("LOGITLESS_CHUNK_ELEMENTS", None)  # the defaults users get
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    # Python's "...Warning:" and a library logger's "[WARNING]" alike
    warned = [line for line in (proc.stdout + proc.stderr).splitlines() if "warning" in line.lower()]
    assert not warned, "\n".join(warned)
    return proc.stdout


def measured(text: str, what: str):
    m = re.search(re.escape(what) + r": loss_abs_diff=(\S+) max_grad_rel_err=(\S+)", text)
    assert m, f"no '{what}' line in:\n{text}"
    return float(m.group(1)), float(m.group(2))


def test_grpo_step_fused_matches_unfused():
    out = run_example("grpo_step.py")
    loss_diff, grad_err = measured(out, "agreement fused vs unfused")
    assert loss_diff <= 1e-5 and grad_err <= 1e-3, out
    loss_diff, grad_err = measured(out, "accuracy fused vs float64")
    assert loss_diff <= 1e-5 and grad_err <= 1e-4, out
    assert "MISMATCH" not in out

    losses = dict(re.findall(r"^(fused|unfused) \(.*?loss=(\S+)", out, re.M))
    assert losses.keys() == {"fused", "unfused"}, out
    peaks = dict(re.findall(r"^(fused|unfused) \(.*peak memory\s+(\S+) MiB", out, re.M))
    assert peaks.keys() == {"fused", "unfused"}, out  # printed for both paths
    # the unfused path holds [tokens x vocab] float32 logits and their log-softmax at once
    logits_mib = float(re.search(r"one float32 logits tensor .* = (\S+) MiB", out).group(1))
    assert float(peaks["unfused"]) >= logits_mib
    assert float(peaks["fused"]) < float(peaks["unfused"])
    assert re.search(r"^fused backend: (chunked|triton)$", out, re.M), out
    assert "What this shows:" in out
