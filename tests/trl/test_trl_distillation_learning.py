"""examples/trl_distillation_learning.py on tiny shapes: a teacher trained on the next-word rule, then three
distillation steps with TRL's loss and with logitless', from the same seed and the same models. Each run's JSON has
finite losses, step times, peak memory and held-out accuracies; step by step the two runs' loss and gradient norm
agree (the same seed samples the same completions while the weights agree), and so do the held-out accuracies;
--plot-only draws the curves and prints the table. The teacher's batches: consecutive runs, or (mixed) runs and a
prompt's run followed by random words, every word labelled with its successor."""
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trl_distillation_learning.py"


def _example():
    spec = importlib.util.spec_from_file_location("trl_distillation_learning", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(example, out, mode, *extra):
    example.main(["--size", "tiny", "--out", str(out), "--mode", mode, *extra])
    return json.loads((out / f"{mode}-seed0.json").read_text())


def _close(a, b, rel, what):
    assert math.isfinite(a) and math.isfinite(b), (what, a, b)
    assert abs(a - b) <= rel * max(abs(a), abs(b), 1e-3), f"{what}: {a} vs {b}"


def test_learning_script_modes_agree_step_by_step(tmp_path, capsys):
    example = _example()
    runs = {m: _run(example, tmp_path, m) for m in ("trl", "fused")}
    models = json.loads((tmp_path / "models" / "settings.json").read_text())
    # the teacher learned the rule (its held-out accuracy well above the untrained student's)
    assert models["teacher_heldout_accuracy"] > models["student_heldout_accuracy"] + 0.2, models
    for mode, run in runs.items():
        steps = run["steps"]
        assert [s["step"] for s in steps] == [1, 2, 3], mode
        assert all(s["step_time_s"] > 0 and s["peak_bytes"] > 0 for s in steps), mode
        assert all(math.isfinite(s["loss"]) and s["loss"] > 0 and math.isfinite(s["grad_norm"]) for s in steps), mode
        assert all(0.0 <= s["heldout_accuracy"] <= 1.0 for s in steps), mode
        assert run["models"] == models
    assert runs["fused"]["logitless_backend"] in ("chunked", "triton")
    trl, fused = runs["trl"]["steps"], runs["fused"]["steps"]
    for a, b in zip(trl, fused, strict=True):
        _close(b["loss"], a["loss"], 1e-5, f"step {a['step']} loss")
        _close(b["grad_norm"], a["grad_norm"], 1e-4, f"step {a['step']} grad norm")
        _close(b["entropy"], a["entropy"], 1e-5, f"step {a['step']} entropy")
        assert b["heldout_accuracy"] == a["heldout_accuracy"], a["step"]
    pytest.importorskip("matplotlib", reason="the bench extra installs matplotlib")
    capsys.readouterr()
    example.main(["--plot-only", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert (tmp_path / "distillation_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| mode | seed | loss, first 5 steps |" in printed and "\n| fused | 0 | " in printed, printed
    assert "fused seed 0 vs trl seed 0: mean |loss difference| per step" in printed, printed


@pytest.mark.parametrize("contexts", ["runs", "mixed"])
def test_teacher_batch_labels_every_word_with_its_successor(contexts):
    example = _example()
    args = example.parse_args(["--size", "tiny", "--out", "unused", "--teacher-batch", "7",
                               "--teacher-contexts", contexts])
    train_starts, held = example.split_starts(args)
    rows, labels = example.teacher_batch(args, torch.Generator().manual_seed(3), train_starts)
    length = args.prompt_words + args.completion_length
    assert rows.shape == (7, length) and bool(((rows >= 3) & (rows < 3 + args.task_words)).all())
    assert not bool(torch.isin(rows[:, 0] - 3, held).any())          # rows start at training starts only
    step = (rows[:, 1:] - rows[:, :-1]) % args.task_words
    if contexts == "runs":
        assert labels is rows and bool((step == 1).all())
        return
    # labels: each position's own word's successor (the model's loss is not shifted for these rows)
    assert torch.equal(labels, (rows - 3 + 1) % args.task_words + 3)
    assert bool((step[:3] == 1).all())                                 # the first half: consecutive runs
    assert bool((step[3:, :args.prompt_words - 1] == 1).all())          # the second: the prompt's run...
    assert not bool((step[3:, args.prompt_words - 1:] == 1).all())     # ...then random words
