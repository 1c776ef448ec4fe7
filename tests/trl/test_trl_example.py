"""examples/trl_grpo.py runs as a user runs it (a fresh process), prints a loss and a reward per step, explains
the loss, and prints no library warnings."""
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
    steps = re.findall(r"^step (\d+): loss=(\S+) reward=(\S+) kl=(\S+) completion lengths (\d+)-(\d+)$",
                       proc.stdout, re.M)
    assert [int(s[0]) for s in steps] == [1, 2, 3], proc.stdout
    assert all(abs(float(s[1])) < 1e3 and 0.0 <= float(s[2]) <= 1.0 for s in steps), proc.stdout
    assert "Why the loss is 0 at step 1" in proc.stdout
    # what the explanation says: with equal completion lengths the on-policy loss is beta * kl (beta = 0.04)
    for _, loss, _, kl, lo, hi in steps:
        if lo == hi:
            assert abs(float(loss) - 0.04 * float(kl)) <= 2e-6, proc.stdout
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if "warning" in line.lower()], proc.stderr
    assert re.search(r"^logitless enabled: True, backend: (chunked|triton)$", proc.stdout, re.M), proc.stdout
