"""examples/trl_grpo_learning.py on tiny shapes: three GRPO steps with TRL's loss and with logitless' fused
loss (and Liger's, where liger-kernel is installed, run on CPU as a check), from the same seed. Each run's
JSON has finite rewards, step times and peak memory; on the same first batch the modes' loss and gradient
norm agree (and the off-policy second step's loss, whose KL and clipping are not 0); --plot-only draws the
curves and prints the table."""
import importlib.util
import json
import math
from pathlib import Path

import pytest

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo_learning.py"


def _example():
    spec = importlib.util.spec_from_file_location("trl_grpo_learning", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _liger_installed():
    try:
        import liger_kernel.chunked_loss  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure: not usable
        return False
    return True


def _run(example, out, mode, *extra):
    example.main(["--size", "tiny", "--steps", "3", "--out", str(out), "--mode", mode, *extra])
    return json.loads((out / f"{mode}-seed0.json").read_text())


def _close(a, b, rel, what):
    assert math.isfinite(a) and math.isfinite(b), (what, a, b)
    assert abs(a - b) <= rel * max(abs(a), abs(b), 1e-3), f"{what}: {a} vs {b}"


def test_learning_script_modes_agree_on_the_first_steps(tmp_path):
    example = _example()
    modes = ["trl", "fused"] + (["liger"] if _liger_installed() else [])
    runs = {m: _run(example, tmp_path, m, "--liger-on-cpu") for m in modes}
    for mode, run in runs.items():
        assert "skipped" not in run, run.get("skipped")
        steps = run["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3], mode
        rewards = [s["reward"] for s in steps if "reward" in s]
        assert len(rewards) == 2 and all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards), (mode, rewards)
        assert all(s["step_time_s"] > 0 and s["peak_bytes"] > 0 for s in steps), mode
        assert all(math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) for s in steps), mode
    assert runs["fused"]["logitless_backend"] in ("chunked", "triton")
    trl, first = runs["trl"]["steps"], runs["trl"]["steps"][0]
    # the batch of step 1 is on-policy yet its loss is not 0 (steps_per_generation=2 shuffles the generation
    # batch, so the half a step trains on is not whole groups); step 2 is off-policy: KL and clipping act
    assert abs(first["loss"]) > 1e-3 and first["grad_norm"] > 1e-2, first
    assert trl[1]["kl"] > 0 and abs(trl[1]["loss"]) > 1e-3, trl[1]
    for mode in modes[1:]:
        other = runs[mode]["steps"]
        assert other[0]["reward"] == first["reward"], (mode, "the same seed samples the same first batch")
        _close(other[0]["loss"], first["loss"], 1e-5, f"{mode} step-1 loss")
        _close(other[0]["grad_norm"], first["grad_norm"], 1e-4, f"{mode} step-1 grad norm")
        _close(other[1]["loss"], trl[1]["loss"], 1e-4, f"{mode} step-2 loss")
        _close(other[1]["kl"], trl[1]["kl"], 1e-4, f"{mode} step-2 kl")


def test_learning_script_plot_and_table(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the bench extra installs matplotlib")
    example = _example()
    _run(example, tmp_path, "trl", "--steps", "2")
    skipped = _run(example, tmp_path, "liger", "--steps", "2")      # skipped here unless CUDA (and liger) exist
    capsys.readouterr()
    example.main(["--plot-only", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    png = tmp_path / "reward_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| mode | seed | reward, first 10 steps |" in printed and "\n| trl | 0 | " in printed, printed
    if "skipped" in skipped:
        assert f"| liger | 0 | skipped: {skipped['skipped']}" in printed, printed
