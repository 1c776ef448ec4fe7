"""k ids per token with the LM head sharded by vocabulary rows over 2 and 3 gloo processes: fused_logprobs with
labels [..., k], fused_topk and the top-k divergences equal float64 on the full weight, or the unsharded call
(cases: tp_topk_cases.py)."""
from __future__ import annotations

import pytest

import tp_topk_cases
from tp_harness import EXIT, run_world

MODULE = "tp_topk_cases"


def check_outcome(world: int, case: str) -> None:
    per_rank = run_world(world, MODULE)[case]
    failed = [o for o in per_rank if o != "ok" and not o.startswith("skip: ")]
    assert not failed, "\n\n".join(failed)
    skips = sorted({o for o in per_rank if o.startswith("skip: ")})
    if skips:
        pytest.skip("; ".join(s[len("skip: "):] for s in skips))


@pytest.mark.parametrize("world,case", [(w, name) for w in (2, 3) for name in tp_topk_cases.names(w)])
def test_topk_vocab_parallel(world, case):
    check_outcome(world, case)


@pytest.mark.parametrize("world", [2, 3])
def test_topk_ranks_exit_cleanly(world):
    check_outcome(world, EXIT)
