"""Truncated log-probs with the LM head sharded by vocabulary rows over 2 gloo processes: the global kept sets, the
values and the gradients equal the unsharded call's and float64's (cases: tp_truncation_cases.py)."""
from __future__ import annotations

import pytest

import tp_truncation_cases
from tp_harness import EXIT, check_outcome

MODULE = "tp_truncation_cases"
WORLD = 2


@pytest.mark.parametrize("case", tp_truncation_cases.names(WORLD))
def test_truncation_vocab_parallel(case):
    check_outcome(WORLD, case, MODULE, skips=False)


def test_truncation_ranks_exit_cleanly():
    check_outcome(WORLD, EXIT, MODULE)
