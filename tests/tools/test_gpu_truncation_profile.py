"""benchmarks/gpu_truncation_profile.py: its dry run (tiny shapes, triton's interpreter) times every stage it
names, so the script cannot rot between GPU runs."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_times_the_stages(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_truncation_profile.py"), "--dry-run",
                        "--n", "8", "--settings", "top_p=0.95", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_truncation_profile.json").read_text())
    row = res["rows"]["top_p=0.95"]
    assert row["forward_ms"] > 0 and row["forward+backward_ms"] > 0 and row["kept_median"] >= 1
    forward, step = row["stages_forward"], row["stages_step"]
    # the selection's rounds (tokens x candidates asked each) and the pairs' products, forward and backward
    assert forward["select: fused_topk rounds"]["calls"] >= 1
    assert forward["select: fused_topk rounds"]["notes"][0].startswith("8x")
    # the forward multiplies each token's anchor and its label where outside its set (the dense tokens' apart)
    assert forward["pairs: products (forward)"]["calls"] >= 1
    # the backward: the pairs' for narrow sets, the dense one for wide sets (V / 200 = 5 ids here)
    backward_calls = [step.get(name, {}).get("calls", 0) for name in (
        "pairs: d_hidden (backward)", "pairs: d_weight (backward)", "dense backward (wide sets)")]
    assert backward_calls[0] == backward_calls[1] and sum(backward_calls) >= 1, backward_calls
    assert "pairs: d_hidden (backward)" not in forward and "dense backward (wide sets)" not in forward
    md = (tmp_path / "gpu_truncation_profile.md").read_text()
    assert "| top_p=0.95 | forward |" in md
    # the kept pairs alone, torch path and Triton kernels side by side: timed, and the same numbers
    pairs = res["pairs"]
    assert pairs["pairs"] == 8 * 50 and pairs["gemm_ms"] > 0
    for path in ("torch", "triton"):
        for name in ("products (forward)", "d_hidden (backward)", "d_weight (backward)"):
            assert pairs["ms"][f"{path}: {name}"] > 0
    assert pairs["rel_diff"]["products (forward)"] < 1e-5 and pairs["rel_diff"]["d_hidden (backward)"] < 1e-5
    assert pairs["rel_diff"]["d_weight (backward)"] < 1e-2          # bf16 d_weight: one rounding each
    assert "| d_weight (backward) |" in md


def test_dry_run_times_the_wide_round_both_ways(tmp_path):
    """Past 8 first candidates the wide round runs: its emitting pass and the nucleus kernel timed as stages, and
    top_p with the sets sorted (``/sort``) beside it, the two routes' outputs compared (the same sets)."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_truncation_profile.py"), "--dry-run",
                        "--n", "8", "--settings", "top_p=0.95,top_p=0.95/sort", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "LOGITLESS_TRUNCATION_CANDIDATES": "8"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((tmp_path / "gpu_truncation_profile.json").read_text())["rows"]
    kernel, sort = rows["top_p=0.95"]["stages_forward"], rows["top_p=0.95/sort"]["stages_forward"]
    assert kernel["wide: above-bound pass (GEMM)"]["calls"] >= 1 and kernel["wide: nucleus kernel"]["calls"] >= 1
    assert "wide: sort and cut" in sort and "wide: nucleus kernel" not in sort
    versus = rows["top_p=0.95/sort"]["vs_top_p=0.95"]
    assert versus["kept_count_differ"] == 0 and versus["inside_differ"] == 0 and versus["logprobs_max_diff"] < 1e-5
