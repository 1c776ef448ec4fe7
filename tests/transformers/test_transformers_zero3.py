"""fused_forward and fused_policy_loss through DeepSpeed ZeRO-3 on two CPU ranks (deepspeed's CPU
accelerator over gloo): the partitioned head is gathered by its own call and its gradient partitioned as for
the unfused head; values and full gradients against the unsharded model (zero3_worker.py)."""
import json
import os

import pytest
import torch.multiprocessing as mp

pytest.importorskip("deepspeed", reason="DeepSpeed is in the test extra; this test needs it")
import zero3_worker  # noqa: E402


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    seed = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    mp.spawn(zero3_worker.run, args=(str(tmp / "store"), seed, str(tmp)), nprocs=2)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", zero3_worker.CASES)
def test_zero3_two_ranks(zero3_results, case):
    for rank, res in enumerate(zero3_results):
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
