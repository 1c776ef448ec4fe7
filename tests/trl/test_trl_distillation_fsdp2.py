"""logitless.trl.enable on a real trl.DistillationTrainer whose student and teacher are both sharded with FSDP2 (each
decoder layer and the root, as accelerate's FSDP2 wraps them) on two gloo processes on CPU: the loss, the entropy
TRL logs from and the gradients FSDP2 reduces, against TRL's own _compute_loss (trl_fsdp2_distillation_worker.py)."""
import pytest

from ranks import check, fresh_seed, spawn
from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
import trl_fsdp2_distillation_worker as worker  # noqa: E402


@pytest.fixture(scope="module")
def results(folder, teacher, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_distillation_fsdp2")
    return spawn(worker.run, (folder, teacher, fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", worker.CASES)
def test_distillation_trainer_under_fsdp2(results, case):
    check(results, case)
    for rank, res in enumerate(results):
        print(f"{case} rank {rank}: {res[case][1]}")
