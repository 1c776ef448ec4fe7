"""The legacy path on a real megatron-core release without the hook (0.16.1, built by
`make setup` into .venv-legacy): runs legacy_suite.py with that venv's python, then checks that
the current release's hook path gives equal numbers on the same weights and inputs."""
import os
import re
import subprocess

import pytest
import torch

import mcore_env
from logitless.megatron import forward_padded, last_path
from mcore_env import ENT_TOL, LP_TOL

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
LEGACY_PY = os.path.join(ROOT, ".venv-legacy", "bin", "python")


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory):
    assert os.path.exists(LEGACY_PY), f"{LEGACY_PY} is missing: `make setup` builds it (megatron-core 0.16.1)"
    dump = str(tmp_path_factory.mktemp("legacy") / "dump.pt")
    env = dict(os.environ, LOGITLESS_LEGACY_DUMP=dump, OMP_NUM_THREADS="1")
    proc = subprocess.run([LEGACY_PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
                           os.path.join(HERE, "legacy_suite.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=420)
    return proc, dump


def test_legacy_release_suite_passes(legacy_run):
    proc, _ = legacy_run
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    m = re.search(r"(\d+) passed", proc.stdout)
    assert m and int(m.group(1)) >= 17 and "failed" not in proc.stdout and "skipped" not in proc.stdout, tail


LEGACY_TWO_PROCESS_CASES = ["legacy-nosp-untied", "legacy-sp-tied", "forward_padded-sp-thd", "forward_packed-nosp-thd",
                            "forward_padded-sp-bshd", "cp2-forward_packed-grads", "cp2-forward_padded-per_token"]


def test_legacy_release_two_processes():
    """TP=2 (with and without SP) and CP=2 through the legacy patch on the real older release."""
    assert os.path.exists(LEGACY_PY), f"{LEGACY_PY} is missing: `make setup` builds it (megatron-core 0.16.1)"
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    results = mcore_env.spawn_two(LEGACY_PY, seed, LEGACY_TWO_PROCESS_CASES)
    for case in LEGACY_TWO_PROCESS_CASES:
        for rank, res in enumerate(results):
            ok, msg = res[case]
            assert ok, f"{case} rank {rank}: {msg}"


def test_equal_numbers_across_releases(megatron_tp1, legacy_run):
    _, dump = legacy_run
    saved = torch.load(dump, weights_only=False)
    assert tuple(saved["release"]) < (0, 18)
    env = megatron_tp1
    model = env.build_gpt(tied=True, seed=0)
    missing, unexpected = model.load_state_dict(saved["weights"], strict=False)
    assert not [k for k in missing if "_extra_state" not in k] and not unexpected
    with torch.no_grad():
        out = forward_padded(model, saved["ids"], saved["mask"], temperature=saved["temps"], packed=False, strict=True)
    assert last_path().path == "hook"
    assert (out.logprobs - saved["logprobs"]).abs().max() <= LP_TOL
    assert (out.entropy - saved["entropy"]).abs().max() <= ENT_TOL
    assert saved["logprobs"].abs().sum() > 0
