"""Two spawned CPU processes (gloo): tensor parallelism 2, with and without sequence parallelism
(the hook, the legacy patch and the batch entry points against the unfused model, per rank),
then context parallelism 2 (zigzag THD split and gather in forward_padded / forward_packed).

Both ranks run every case once in one spawn (tp2_worker.py); each test below reads its case.
"""
import os
import sys

import pytest

import mcore_env
from tp2_worker import CASES


@pytest.fixture(scope="module")
def tp2_results():
    from logitless.parallel import VocabParallel, gather_sequence  # noqa: F401  (tp_group support)
    seed = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    return mcore_env.spawn_two(sys.executable, seed)


@pytest.mark.parametrize("case", CASES)
def test_tp2(tp2_results, case):
    for rank, res in enumerate(tp2_results):
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
