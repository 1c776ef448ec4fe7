"""enable(trainer, fused_loss=True) on a real trl.GRPOTrainer run by two gloo processes on CPU (accelerate sees
two processes): each rank its own rollout, 2 gradient-accumulation steps, completions of different lengths.
On every micro-batch of each rank the fused loss equals TRL's own _compute_loss: dapo / cispo / vespo normalise
by num_items_in_batch, which TRL gathers over both processes' generation batches and rescales by the number of
processes and accumulation steps; the metrics are reduced and gathered across ranks; the adaptive entropy
controller reduces its window across ranks; the entropy mask's quantile spans both ranks' entropies
(trl_processes_worker.py has the cases)."""
import json
import os

import pytest
import torch.multiprocessing as mp

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
import trl_processes_worker  # noqa: E402


@pytest.fixture(scope="module")
def results(folder, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_processes")
    seed = int.from_bytes(os.urandom(3), "little")
    print(f"seed={seed}")
    mp.spawn(trl_processes_worker.run, args=(folder, seed, str(tmp)), nprocs=2)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", list(trl_processes_worker.CASES))
def test_fused_loss_on_two_processes_equals_trl(results, case):
    for rank, res in enumerate(results):
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"
        print(f"{case} rank {rank}: {msg}")
