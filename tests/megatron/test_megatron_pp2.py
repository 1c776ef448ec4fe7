"""Pipeline parallelism 2 over two spawned gloo ranks (pp2_worker.py): logitless.megatron's output processor and
fused policy loss on the last stage, through megatron-core's own schedule (1F1B, and interleaved with 2 virtual
stages per rank), against the model's own logits through the same schedule: losses, log-probs and entropies per
micro-batch, every stage's parameter gradients."""
import os

import pytest

import pp2_worker


@pytest.fixture(scope="module")
def pp2_results(tmp_path_factory):
    from ranks import fresh_seed, spawn
    tmp = tmp_path_factory.mktemp("megatron_pp2")
    return spawn(pp2_worker.run, (os.path.join(tmp, "store"), fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", pp2_worker.CASES)
def test_pipeline_parallel_two_ranks(pp2_results, case):
    from ranks import check
    check(pp2_results, case)
