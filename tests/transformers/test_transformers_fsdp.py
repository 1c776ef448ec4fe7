"""fused_forward and patch_model through FSDP1 (FullyShardedDataParallel) over two gloo ranks on
CPU, use_orig_params False and True: log-probs and entropy against the unwrapped model's own logits
in float64, and FSDP's averaged, sharded gradients against the unwrapped model's. A head in its own
FSDP unit works (its unit gathers it when logitless calls it); a tied embedding in its own unit is refused
by name. Both ranks run every case in one spawn (fsdp_worker.py)."""
import pytest

import fsdp_worker
from ranks import check, fresh_seed, spawn


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return spawn(fsdp_worker.run, (str(tmp / "store"), fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", fsdp_worker.CASES)
def test_fsdp1_two_ranks(fsdp_results, case):
    check(fsdp_results, case)
