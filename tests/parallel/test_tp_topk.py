"""k ids per token with the LM head sharded by vocabulary rows over 2 and 3 gloo processes: fused_logprobs with
labels [..., k], fused_topk and the top-k divergences equal float64 on the full weight, or the unsharded call
(cases: tp_topk_cases.py)."""
from __future__ import annotations

import pytest

import tp_topk_cases
from tp_harness import EXIT, check_outcome

MODULE = "tp_topk_cases"


@pytest.mark.parametrize("world,case", [(w, name) for w in (2, 3) for name in tp_topk_cases.names(w)])
def test_topk_vocab_parallel(world, case):
    check_outcome(world, case, MODULE)


@pytest.mark.parametrize("world", [2, 3])
def test_topk_ranks_exit_cleanly(world):
    check_outcome(world, EXIT, MODULE)
