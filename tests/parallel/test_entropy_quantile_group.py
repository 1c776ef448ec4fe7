"""The entropy mask's quantile over 2 and 3 gloo processes (``entropy_quantile_group``), each rank its own
batch: every rank's loss and gradients equal float64 ground truth with the group-wide quantile
(cases: entropy_group_cases.py)."""
from __future__ import annotations

import pytest

import entropy_group_cases
from tp_harness import EXIT, check_outcome

MODULE = "entropy_group_cases"


@pytest.mark.parametrize("world,case", [(w, name) for w in (2, 3) for name, _ in entropy_group_cases.cases_for(w)])
def test_entropy_quantile_over_the_group(world, case):
    check_outcome(world, case, MODULE, skips=False)


@pytest.mark.parametrize("world", [2, 3])
def test_entropy_group_ranks_exit_cleanly(world):
    check_outcome(world, EXIT, MODULE, skips=False)
