"""logitless.trl on a real trl.GRPOTrainer whose policy is sharded with FSDP2 (each decoder layer and the root,
as accelerate's FSDP2 wraps it) on two gloo processes on CPU: per-token log-probs, entropies, the loss and the
gradients FSDP2 reduces, with enable(trainer) and enable(trainer, fused_loss=True), against TRL's own
computation (trl_fsdp2_worker.py says why accelerate's own FSDP2 is not used on CPU)."""
import json
import os

import pytest
import torch.multiprocessing as mp

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
import trl_fsdp2_worker  # noqa: E402


@pytest.fixture(scope="module")
def results(folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_fsdp2")
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"seed={seed}")
    mp.spawn(trl_fsdp2_worker.run, args=(folder, seed, str(tmp)), nprocs=2)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", trl_fsdp2_worker.CASES)
def test_grpo_trainer_under_fsdp2(results, case):
    for rank, res in enumerate(results):
        assert "setup" not in res, f"rank {rank}: {res['setup'][1]}"
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
        print(f"{case} rank {rank}: {msg}")
