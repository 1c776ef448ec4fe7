"""examples/trl_grpo.py runs as a user runs it (a fresh process) and prints a loss and a reward per step."""
import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"


def test_trl_grpo_example_runs_three_steps():
    env = dict(os.environ)
    env.pop("LOGITLESS_CHUNK_ELEMENTS", None)
    proc = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    steps = re.findall(r"^step (\d+): loss=(\S+) reward=(\S+)$", proc.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == [1, 2, 3], proc.stdout
    assert all(abs(float(loss)) < 1e3 and 0.0 <= float(reward) <= 1.0 for _, loss, reward in steps), proc.stdout
    assert re.search(r"^logitless enabled: True, backend: (chunked|triton)$", proc.stdout, re.M), proc.stdout
