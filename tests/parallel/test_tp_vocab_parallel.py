"""fused_logprobs with the LM head sharded by vocabulary rows over 2 and 3 gloo processes: every
rank's log-probs, entropy and gradients equal the unsharded float64 computation."""
from __future__ import annotations

import pytest

import tp_cases
from tp_harness import EXIT, check_outcome


def params(fns):
    return [(world, name) for world in (2, 3) for name in tp_cases.names(fns, world)]


@pytest.mark.parametrize("world,case", params(tp_cases.VOCAB_CASES + [tp_cases.case_triton_interpreted,
                                                                      tp_cases.case_triton_batch_invariance]))
def test_vocab_parallel(world, case):
    check_outcome(world, case)


@pytest.mark.parametrize("world", [2, 3])
def test_rank_processes_exit_cleanly(world):
    check_outcome(world, EXIT)
