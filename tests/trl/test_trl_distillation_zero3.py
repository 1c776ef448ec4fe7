"""logitless.trl.enable on real distillation trainers (DistillationTrainer, GKDTrainer) whose student and teacher are
DeepSpeed ZeRO-3 engines on two gloo processes (deepspeed's CPU accelerator): the loss, the entropy TRL logs from and
the full gradients ZeRO averages, against TRL's own loss on unsharded copies of the same batches
(trl_zero3_distillation_worker.py says why not on the engines)."""
import pytest

from ranks import check, fresh_seed, spawn
from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
import_or_skip("deepspeed", "make setup installs it (DS_BUILD_OPS=0, against the installed torch)")
import trl_zero3_distillation_worker as worker  # noqa: E402


@pytest.fixture(scope="module")
def results(folder, teacher, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_distillation_zero3")
    return spawn(worker.run, (folder, teacher, fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", worker.CASES)
def test_distillation_under_zero3(results, case):
    check(results, case)
    for rank, res in enumerate(results):
        print(f"{case} rank {rank}: {res[case][1]}")
