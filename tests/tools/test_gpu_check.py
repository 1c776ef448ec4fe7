"""benchmarks/gpu_check.py, the one command that re-checks every GPU claim: its dry run (every step on tiny shapes
through triton's interpreter) so the script cannot rot between GPU runs; its list of GPU tests against the suite;
its baseline comparison."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


def test_every_gpu_conditional_test_file_is_checked_or_excused():
    """A test file with a CUDA-conditional skip is in the check's list, or excused with a reason: a new GPU test
    cannot stay out of `make gpu-check` unnoticed."""
    found = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path.name == "test_gpu_check.py":
            continue
        text = path.read_text()
        if "skipif" in text and re.search(r"cuda\.is_available\(\)|!= \"cuda\"|not CUDA\b", text):
            found.add(str(path.relative_to(ROOT)))
    listed = set(gpu_check.GPU_TESTS) | set(gpu_check.NOT_IN_CHECK)
    assert found - listed == set()
    for path in listed:
        assert (ROOT / path).exists(), path


def _fig(rounds, name="head A: forward", unit="x"):
    f = gpu_check.Figure(name, "shape", 1.05, unit)
    f.rounds = list(rounds)
    return f


def test_drift_flags_a_move_beyond_the_spread_with_the_commit_range():
    base = {"card": "NVIDIA H100 80GB HBM3", "commit": "aaa111",
            "figures": {"head A: forward": {"median": 1.00, "min": 0.99, "max": 1.01}}}
    card = "NVIDIA H100 80GB HBM3"
    assert gpu_check.drift(_fig([1.00, 1.01, 1.005]), base, card, "bbb222") == "steady"
    moved = gpu_check.drift(_fig([1.08, 1.09, 1.085]), base, card, "bbb222")
    assert moved.startswith("moved") and "bisect aaa111..bbb222" in moved
    # the tolerance is the larger spread: a wide spread this run absorbs the same move
    assert gpu_check.drift(_fig([1.00, 1.09, 1.05]), base, card, "bbb222") == "steady"
    assert "not compared" in gpu_check.drift(_fig([1.5]), base, "NVIDIA H200", "bbb222")
    assert gpu_check.drift(_fig([1.5], name="other"), base, card, "bbb222") == ""
    err = {"card": card, "commit": "a", "figures": {"e": {"median": 1e-5, "min": 1e-5, "max": 1e-5}}}
    assert gpu_check.drift(_fig([3e-5], "e", "err"), err, card, "b") == "steady"
    assert gpu_check.drift(_fig([3e-4], "e", "err"), err, card, "b").startswith("moved")


def test_verdicts():
    assert _fig([1.0, 1.02]).verdict() == "pass"
    assert _fig([1.2, 1.1]).verdict() == "miss"
    assert _fig([]).verdict() == "-"
    f = _fig([])
    f.error = "boom"
    assert f.verdict() == "error"


@pytest.mark.timeout(900)
def test_dry_run_runs_every_step(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                                             os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--no-peers",
                        "--out", str(tmp_path), "--commit", "c0ffee", "--test-workers", "2"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert res["dry_run"] and res["commit"] == "c0ffee"
    # the tests step collected every listed file, each in its own process
    assert [t["file"] for t in res["tests"]] == list(gpu_check.GPU_TESTS)
    for t in res["tests"]:
        assert t["rc"] == 0 and re.search(r"\d+ tests? collected", t["result"]), t
    figs = res["figures"]
    own = {n: f for n, f in figs.items() if f["target"] is not None and f["unit"] != "GiB"}
    # every headline figure of logitless ran (memory figures need CUDA's allocator statistics)
    for prefix in ("head A: forward", "head B: forward+backward", "policy loss", "float32 head: forward",
                   "distillation jsd: forward+backward", "fused_topk k=32", "fused_topk k=128",
                   "forward_kl_topk k=32", "forward_kl_topk_tail k=32: fwd+bwd"):
        assert any(n.startswith(prefix) for n in own), prefix
    for n, f in own.items():
        assert not f["error"] and len(f["rounds"]) >= 1 and f["verdict"] in ("pass", "miss"), (n, f)
    md = (tmp_path / "gpu-check.md").read_text()
    assert "DRY RUN" in md and "| verdict |" in md
