"""fused_policy_loss with the LM head sharded by vocabulary rows over 2 and 3 gloo processes: every
rank's loss, metrics and gradients equal the unsharded float64 computation (cases: tp_policy_cases.py)."""
from __future__ import annotations

import pytest

import tp_policy_cases
from tp_harness import EXIT, check_outcome

MODULE = "tp_policy_cases"


@pytest.mark.parametrize("world,case", [(w, name) for w in (2, 3) for name, _ in tp_policy_cases.cases_for(w)])
def test_policy_loss_vocab_parallel(world, case):
    check_outcome(world, case, MODULE)


@pytest.mark.parametrize("world", [2, 3])
def test_policy_ranks_exit_cleanly(world):
    check_outcome(world, EXIT, MODULE)
