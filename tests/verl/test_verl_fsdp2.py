"""verl's FSDP2 fused forward on two gloo ranks on CPU (verl_fsdp2_worker.py): verl's apply_fsdp2 puts an untied
lm_head in its own unit; verl's own fused head fails on that sharded weight, and with logitless installed the
forward runs, with values and FSDP2-reduced gradients equal to verl's unfused path on the unsharded model."""
import json
import os

import pytest
import torch.multiprocessing as mp

from required import import_or_skip

import_or_skip("verl.utils.fsdp_utils", "make setup installs verl (--no-deps) and its import deps")
import verl_fsdp2_worker  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_fsdp2")
    seed = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    mp.spawn(verl_fsdp2_worker.run, args=(str(tmp / "store"), seed, str(tmp)), nprocs=2)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", verl_fsdp2_worker.CASES)
def test_verl_fsdp2_two_ranks(results, case):
    for rank, res in enumerate(results):
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
