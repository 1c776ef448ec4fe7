"""fused_forward and patch_model through FSDP1 (FullyShardedDataParallel) over two gloo ranks on
CPU, use_orig_params False and True: log-probs and entropy against the unwrapped model's own logits
in float64, and FSDP's averaged, sharded gradients against the unwrapped model's. A head in its own
FSDP unit works (its unit gathers it when logitless calls it); a tied embedding in its own unit is refused
by name. Both ranks run every case in one spawn (fsdp_worker.py)."""
import json
import os

import pytest
import torch.multiprocessing as mp

import fsdp_worker


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    seed = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    mp.spawn(fsdp_worker.run, args=(str(tmp / "store"), seed, str(tmp)), nprocs=2)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", fsdp_worker.CASES)
def test_fsdp1_two_ranks(fsdp_results, case):
    for rank, res in enumerate(fsdp_results):
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
