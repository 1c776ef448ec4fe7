"""logitless.trl on a real trl.GRPOTrainer whose policy is sharded with FSDP2 (each decoder layer and the root,
as accelerate's FSDP2 wraps it) on two gloo processes on CPU: per-token log-probs, entropies, the loss and the
gradients FSDP2 reduces, with enable(trainer) and enable(trainer, fused_loss=True), against TRL's own
computation (trl_fsdp2_worker.py says why accelerate's own FSDP2 is not used on CPU)."""
import pytest

from ranks import check, fresh_seed, spawn
from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
import trl_fsdp2_worker  # noqa: E402


@pytest.fixture(scope="module")
def results(folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_fsdp2")
    return spawn(trl_fsdp2_worker.run, (folder, fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", trl_fsdp2_worker.CASES)
def test_grpo_trainer_under_fsdp2(results, case):
    check(results, case)
    for rank, res in enumerate(results):
        print(f"{case} rank {rank}: {res[case][1]}")
