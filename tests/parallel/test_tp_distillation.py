"""fused_distillation_loss with both LM heads sharded by vocabulary rows over 2 and 3 gloo processes: every
rank's loss, divergence, entropy and gradients equal the unsharded float64 computation
(cases: tp_distill_cases.py)."""
from __future__ import annotations

import pytest

import tp_distill_cases
from tp_harness import EXIT, run_world

MODULE = "tp_distill_cases"


def check_outcome(world: int, case: str) -> None:
    per_rank = run_world(world, MODULE)[case]
    failed = [o for o in per_rank if o != "ok" and not o.startswith("skip: ")]
    assert not failed, "\n\n".join(failed)
    skips = sorted({o for o in per_rank if o.startswith("skip: ")})
    if skips:
        pytest.skip("; ".join(s[len("skip: "):] for s in skips))


@pytest.mark.parametrize("world,case", [(w, name) for w in (2, 3) for name, _ in tp_distill_cases.cases_for(w)])
def test_distillation_vocab_parallel(world, case):
    check_outcome(world, case)


@pytest.mark.parametrize("world", [2, 3])
def test_distillation_ranks_exit_cleanly(world):
    check_outcome(world, EXIT)
