"""enable(trainer, fused_loss=True) on a real trl.GRPOTrainer run by two gloo processes on CPU (accelerate sees
two processes): each rank its own rollout, 2 gradient-accumulation steps, completions of different lengths.
On every micro-batch of each rank the fused loss equals TRL's own _compute_loss: dapo / cispo / vespo normalise
by num_items_in_batch, which TRL gathers over both processes' generation batches and rescales by the number of
processes and accumulation steps; the metrics are reduced and gathered across ranks; the adaptive entropy
controller reduces its window across ranks; the entropy mask's quantile spans both ranks' entropies
(trl_processes_worker.py has the cases)."""
import pytest

from ranks import check, fresh_seed, spawn
from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
import trl_processes_worker  # noqa: E402


@pytest.fixture(scope="module")
def results(folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_processes")
    return spawn(trl_processes_worker.run, (folder, fresh_seed() % 2**24, str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", list(trl_processes_worker.CASES))
def test_fused_loss_on_two_processes_equals_trl(results, case):
    check(results, case)
    for rank, res in enumerate(results):
        print(f"{case} rank {rank}: {res[case][1]}")
