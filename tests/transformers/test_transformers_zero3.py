"""fused_forward and fused_policy_loss through DeepSpeed ZeRO-3 on two CPU ranks (deepspeed's CPU
accelerator over gloo): the partitioned head is gathered by its own call and its gradient partitioned as for
the unfused head; values and full gradients against the unsharded model (zero3_worker.py)."""
import pytest

from ranks import check, fresh_seed, spawn
from required import import_or_skip

# make setup installs deepspeed: under `make test` (LOGITLESS_REQUIRE_INTEGRATIONS=1) a missing or broken install
# fails the run instead of skipping the ZeRO-3 check
import_or_skip("deepspeed", "make setup installs it (DS_BUILD_OPS=0, against the installed torch)")
import zero3_worker  # noqa: E402


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    return spawn(zero3_worker.run, (str(tmp / "store"), fresh_seed(), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", zero3_worker.CASES)
def test_zero3_two_ranks(zero3_results, case):
    check(zero3_results, case)
