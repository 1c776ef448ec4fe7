"""benchmarks/gpu_check.py, the one command that re-checks every GPU claim: its dry run (every step on tiny shapes
through triton's interpreter) so the script cannot rot between GPU runs; its list of GPU tests against the suite;
its baseline comparison; its budget (cheaper plans, skipped sections, cut test files) and the results files written
as it goes (a section that raises or a call killed mid-way leaves every finished figure on disk)."""
import json
import os
import re
import subprocess
import sys
import time
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


def _report(tmp_path):
    """An empty run's results files under tmp_path, as main sets them up."""
    res = {"date": "2026-01-01", "commit": "c0ffee", "card": "cpu", "versions": {"torch": "t", "triton": "t"},
           "dry_run": True, "rounds": 3, "reps": 5, "budget_s": 30.0, "status": "running"}
    gpu_check.FIGURES.clear()
    gpu_check.REPORT = gpu_check.Report(str(tmp_path), res, None)
    return res


@pytest.fixture
def no_report():
    yield
    gpu_check.REPORT = None
    gpu_check.FIGURES.clear()


def _section(name, estimate, values, after=None, clock=None, spend=0.0):
    """A section declaring one figure per value; measuring puts them in order, then ``after()``; ``spend``
    seconds pass on the fake ``clock``."""
    def build():
        figs = [gpu_check.figure(f"{name} {i}", "s", 1.0) for i in range(len(values))]

        def measure():
            for f, v in zip(figs, values, strict=True):
                gpu_check.put(f, v)
            if clock is not None:
                clock.now += spend
            if after is not None:
                after()
        return measure
    return gpu_check.Section(name, estimate, build)


def _on_disk(tmp_path):
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    return res, (tmp_path / "gpu-check.md").read_text()


def test_a_section_that_raises_or_a_kill_leaves_the_finished_figures_on_disk(tmp_path, no_report):
    _report(tmp_path)

    def boom():
        raise RuntimeError("boom")

    def killed():
        raise KeyboardInterrupt

    sections = [_section("first", 1, [1.01]), _section("second", 1, [0.5], after=boom),
                _section("third", 1, [2.0]), _section("fourth", 1, [0.9, 0.8], after=killed),
                _section("fifth", 1, [0.7])]
    # "second" declares a figure it never measures
    second_build = sections[1].build

    def build_second():
        measure = second_build()
        gpu_check.figure("second never", "s", 1.0)
        return measure
    sections[1] = gpu_check.Section("second", 1, build_second)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run_sections(sections, time.monotonic() + 600, 3, 5)
    res, md = _on_disk(tmp_path)
    figs = res["figures"]
    assert figs["first 0"]["median"] == 1.01 and figs["first 0"]["verdict"] == "miss"
    assert figs["second 0"]["median"] == 0.5 and figs["second 0"]["verdict"] == "pass"
    assert figs["second never"]["error"] == "RuntimeError: boom" and figs["second never"]["verdict"] == "error"
    assert figs["third 0"]["median"] == 2.0                 # the section after the error ran
    assert figs["fourth 0"]["median"] == 0.9 and figs["fourth 1"]["median"] == 0.8   # saved before the kill
    assert figs["fifth 0"]["median"] is None                # declared, never reached
    status = {r["section"]: r["status"] for r in res["sections"]}
    assert status == {"first": "done", "second": "error: RuntimeError: boom", "third": "done",
                      "fourth": "interrupted", "fifth": "not started"}
    assert "| fourth 1 |" in md and "| second never |" in md


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_spent_budget_skips_the_later_sections_and_says_so(tmp_path, no_report):
    _report(tmp_path)
    clock = _Clock()
    sections = [_section(n, 10, [1.0, 1.0], clock=clock, spend=20) for n in ("a", "b", "c")]
    rows = gpu_check.run_sections(sections, clock.now + 30, 3, 5, clock=clock)
    # a: 30 s left, its share a third; b: 10 s left (its estimate's third is 3.3 s), overruns; c: none left
    assert [r["status"] for r in rows] == ["done", "done", gpu_check.NOT_RUN]
    assert rows[0]["share_s"] == 10.0 and rows[1]["share_s"] == 5.0 and rows[2]["share_s"] is None
    res, md = _on_disk(tmp_path)
    assert [res["figures"][f"c {i}"]["verdict"] for i in range(2)] == [gpu_check.NOT_RUN] * 2
    assert res["figures"]["b 1"]["verdict"] == "pass"
    assert md.count(gpu_check.NOT_RUN) == 3                 # the section's row and its two figures'


def test_cheaper_plans_fit_the_share():
    choose = gpu_check.choose_plan
    fast = [0.03, 0.03]                         # a warm-up call before each round's calls
    assert choose(fast, 3, 5, 2.0) == (3, 5)    # 3 * 6 * 0.06 = 1.08 s
    assert choose(fast, 3, 5, 0.8) == (3, 3)    # 3 * 4 * 0.06 = 0.72 s
    slow = [0.1, 2.0]                           # the 2 s call is its own warm-up
    assert choose(slow, 3, 5, 10.0) == (2, 2)   # 2 * (3 * 0.1 + 2 * 2) = 8.6 s
    assert choose(slow, 3, 5, 5.0) == (2, 1)
    assert choose(slow, 3, 5, 1.0) == (1, 1)    # nothing fits: one round of one call
    assert choose(slow, 2, 3, 1e9) == (2, 3)    # never above the asked plan


def test_a_zero_budget_marks_every_figure_not_run(tmp_path, no_report):
    rc = gpu_check.main(["--dry-run", "--no-peers", "--only", "timings", "--budget", "0", "--out", str(tmp_path),
                         "--commit", "c0ffee", "--baseline", str(tmp_path / "none.json")])
    assert rc == 0
    res, md = _on_disk(tmp_path)
    assert res["status"] == "done" and len(res["figures"]) > 20
    assert {f["verdict"] for f in res["figures"].values()} == {gpu_check.NOT_RUN}
    assert [r["status"] for r in res["sections"]] == [gpu_check.NOT_RUN] * len(res["sections"])
    assert "| head A: forward |" in md and "| truncation top_p=0.95: fwd+bwd (x plain head fwd+bwd) |" in md


def test_a_test_file_cut_by_the_budget_says_how_far_it_got(tmp_path, monkeypatch):
    slow = tmp_path / "test_slow.py"
    slow.write_text("import time\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n")
    other = tmp_path / "test_other.py"
    other.write_text("def test_never():\n    pass\n")
    monkeypatch.setattr(gpu_check, "GPU_TESTS", (str(slow), str(other)))
    t = time.monotonic()
    rows = gpu_check.run_tests(time.monotonic() + 15, False, workers=1)
    assert time.monotonic() - t < 60
    assert rows[0]["result"].startswith("timed out (budget): 1 passed") and rows[0]["rc"] is None, rows[0]
    assert rows[1]["result"] == gpu_check.NOT_RUN


def test_progress_of_a_cut_run():
    assert gpu_check.progress("..F.s                [ 40%]\n..E\nFAILED x") == "5 passed, 1 failed, 1 error, 1 skipped"
    assert gpu_check.progress("collecting ...") == "none finished"


def test_verdicts():
    assert _fig([1.0, 1.02]).verdict() == "pass"
    assert _fig([1.2, 1.1]).verdict() == "miss"
    assert _fig([]).verdict() == "-"
    f = _fig([])
    f.error = "boom"
    assert f.verdict() == "error"
    f = _fig([])
    f.status = gpu_check.NOT_RUN
    assert f.verdict() == gpu_check.NOT_RUN


@pytest.mark.timeout(900)
def test_dry_run_runs_every_step(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                                             os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--no-peers",
                        "--out", str(tmp_path), "--commit", "c0ffee", "--test-workers", "2",
                        # a budget for a shared CPU (the interpreter), not the H100's
                        "--budget", "1500", "--tests-budget", "900"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu-check.json").read_text())
    assert res["dry_run"] and res["commit"] == "c0ffee" and res["status"] == "done"
    # every section ran within its share, its seconds logged and kept
    assert [r["section"] for r in res["sections"]] == ["head A", "head B", "policy loss", "float32 head",
                                                      "distillation", "top-k", "truncation"]
    for r in res["sections"]:
        assert r["status"] == "done" and r["seconds"] is not None and r["share_s"] > 0, r
        assert f"section {r['section']}: done, {r['seconds']} s" in p.stdout
    # the tests step collected every listed file, each in its own process
    assert [t["file"] for t in res["tests"]] == list(gpu_check.GPU_TESTS)
    for t in res["tests"]:
        assert t["rc"] == 0 and re.search(r"\d+ tests? collected", t["result"]), t
    figs = res["figures"]
    own = {n: f for n, f in figs.items() if f["target"] is not None and f["unit"] != "GiB"}
    # every headline figure of logitless ran (memory figures need CUDA's allocator statistics)
    for prefix in ("head A: forward", "head B: forward+backward", "policy loss", "float32 head: forward",
                   "distillation jsd: forward+backward", "fused_topk k=32", "fused_topk k=128",
                   "forward_kl_topk k=32", "forward_kl_topk_tail k=32: fwd+bwd", "truncation top_k=50: forward",
                   "truncation top_p=0.95: fwd+bwd"):
        assert any(n.startswith(prefix) for n in own), prefix
    for n, f in own.items():
        assert not f["error"] and len(f["rounds"]) >= 1 and f["verdict"] in ("pass", "miss"), (n, f)
        # each figure was logged the moment its rounds were done
        assert f"figure {n}: " in p.stdout, n
    md = (tmp_path / "gpu-check.md").read_text()
    assert "DRY RUN" in md and "| verdict |" in md
