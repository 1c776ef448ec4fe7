"""verl on a real megatron-core release without the hook (0.16.1, built by `make setup` into
.venv-legacy, with verl, mbridge and verl's Megatron engine's imports installed there too): runs
verl_legacy_suite.py (verl's legacy fused forward with logitless' head) and
verl_megatron_legacy_suite.py (the fused policy loss on verl's Megatron engine through logitless'
legacy patch) with that venv's python, in one process."""
import os
import re
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
LEGACY_PY = os.path.join(ROOT, ".venv-legacy", "bin", "python")


def test_verl_legacy_release_suite_passes():
    assert os.path.exists(LEGACY_PY), f"{LEGACY_PY} is missing: `make setup` builds it (megatron-core 0.16.1 + verl)"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([LEGACY_PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                           os.path.join(HERE, "verl_legacy_suite.py"),
                           os.path.join(HERE, "verl_megatron_legacy_suite.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) >= 9 and "failed" not in proc.stdout and "skipped" not in proc.stdout, tail
