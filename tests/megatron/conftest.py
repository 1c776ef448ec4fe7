
import pytest

from required import import_or_skip

mcore = import_or_skip("megatron.core", "make setup installs megatron-core")


@pytest.fixture(scope="module")
def megatron_tp1():
    """One gloo process group (world 1) and megatron's model-parallel state per test module;
    torch and torch.distributed are restored afterwards, so other tests see them untouched."""
    import mcore_env
    mcore_env.init_cpu_megatron(rank=0, world_size=1, tp=1)
    yield mcore_env
    mcore_env.teardown_cpu_megatron()
