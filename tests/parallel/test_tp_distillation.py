"""fused_distillation_loss with both LM heads sharded by vocabulary rows over 2 and 3 gloo processes: every
rank's loss, divergence, entropy and gradients equal the unsharded float64 computation
(cases: tp_distill_cases.py)."""
from __future__ import annotations

import pytest

import tp_distill_cases
from tp_harness import EXIT, check_outcome

MODULE = "tp_distill_cases"


@pytest.mark.parametrize("world,case", [(w, name) for w in (2, 3) for name, _ in tp_distill_cases.cases_for(w)])
def test_distillation_vocab_parallel(world, case):
    check_outcome(world, case, MODULE)


@pytest.mark.parametrize("world", [2, 3])
def test_distillation_ranks_exit_cleanly(world):
    check_outcome(world, EXIT, MODULE)
