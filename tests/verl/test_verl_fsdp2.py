"""verl's FSDP2 fused forward on two gloo ranks on CPU (verl_fsdp2_worker.py): verl's apply_fsdp2 puts an untied
lm_head in its own unit; verl's own fused head fails on that sharded weight, and with logitless installed the
forward runs, with values and FSDP2-reduced gradients equal to verl's unfused path on the unsharded model."""
import pytest

from ranks import check, fresh_seed, spawn
from required import import_or_skip

import_or_skip("verl.utils.fsdp_utils", "make setup installs verl (--no-deps) and its import deps")
import verl_fsdp2_worker  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verl_fsdp2")
    return spawn(verl_fsdp2_worker.run, (str(tmp / "store"), fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", verl_fsdp2_worker.CASES)
def test_verl_fsdp2_two_ranks(results, case):
    check(results, case)
