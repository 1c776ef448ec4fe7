"""Clear errors for tensor-parallel misuse, raised on every rank alike (so no rank hangs)."""
from __future__ import annotations

import pytest

import tp_cases
from test_tp_vocab_parallel import params
from tp_harness import check_outcome


@pytest.mark.parametrize("world,case", params(tp_cases.ERROR_CASES + [tp_cases.case_error_not_initialised]))
def test_tp_errors(world, case):
    check_outcome(world, case)
