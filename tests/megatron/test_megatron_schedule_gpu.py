"""The schedule-plan path overlapped, on a GPU: megatron-core's combined 1F1B chunk schedule runs
micro-batch 2's forward together with micro-batch 1's backward on two CUDA streams (compute and
communication), for a MoE GPTModel (all-to-all dispatcher) with and without an MTP layer, logitless' processor in
the post-process node. Checked against the model's own logits (float64 log-softmax) through its forward:
both micro-batches' log-probs / entropy and every parameter gradient, and the path record.

Needs CUDA (the overlap needs streams); on CPU, test_megatron_schedule.py runs the same schedule code
(check_two_micro_batches) with streams and events as no-ops.
"""
import os

import pytest
import torch

from required import import_or_skip

import_or_skip("megatron.core", "make setup installs megatron-core")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the overlapped 1F1B schedule needs CUDA streams")



@pytest.fixture(scope="module")
def megatron_gpu():
    import mcore_env
    with mcore_env.megatron_on_gpu():
        yield


@pytest.mark.parametrize("mtp", [False, True], ids=["moe", "moe-mtp"])
def test_overlapped_schedule_plan_equals_the_models_logits(megatron_gpu, mtp):
    from megatron.core.pipeline_parallel.utils import set_streams

    import mcore_env
    from test_megatron_schedule import check_two_micro_batches
    set_streams()
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    model = mcore_env.build_gpt(moe_experts=4, mtp=mtp, seed=seed, vocab=1031, hidden=64).cuda().train()
    with mcore_env.keep_schedule_node_inputs():       # one GPU: expert parallelism 1 (see mcore_env)
        worst, gworst = check_two_micro_batches(model, torch.Generator().manual_seed(seed), "cuda", s=24)
    torch.cuda.synchronize()
    print(f"schedule-plan overlapped ({'moe+mtp' if mtp else 'moe'}): max |d logprob/entropy| {worst:.2e}, "
          f"max grad rel err {gworst:.2e}")
