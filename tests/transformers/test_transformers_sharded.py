"""fused_forward, patch_model and fused_policy_loss on sharded heads, over gloo ranks on CPU: FSDP2
(``fully_shard`` on each decoder layer and the root; the head in the root unit or its own, tied embeddings,
reshard_after_forward True / False, bf16 mixed precision) on 2 ranks, and tensor parallelism (the head
sharded over the vocabulary by ``ColwiseParallel``, uneven shards) on 2 and 3 ranks. Values and the
gradients FSDP2 reduces against the unsharded model; layouts that cannot work refused by name. Every case
of a suite runs in one spawn (sharded_worker.py)."""
import pytest

import sharded_worker
from ranks import check, fresh_seed, spawn


def _spawn(tmp, suite, world):
    return spawn(sharded_worker.run, (world, suite, str(tmp / "store"), fresh_seed(), str(tmp)), world, tmp)


@pytest.fixture(scope="module")
def fsdp2_results(tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp("fsdp2"), "fsdp2", 2)


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def tp_results(request, tmp_path_factory):
    return _spawn(tmp_path_factory.mktemp(f"tp{request.param}"), "tp", request.param)


@pytest.mark.parametrize("case", sharded_worker.FSDP2_CASES)
def test_fsdp2_two_ranks(fsdp2_results, case):
    check(fsdp2_results, case)


@pytest.mark.parametrize("case", sharded_worker.TP_CASES)
def test_tensor_parallel_head(tp_results, case):
    check(tp_results, case)
