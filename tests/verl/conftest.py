"""verl tests: the Megatron harness (tests/megatron/mcore_env.py) is importable from here (the seed
fixture is tests/conftest.py's)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))


@pytest.fixture(scope="module", autouse=True)
def restored_environment():
    """The process's environment as it was before the module, after it: verl_engine.setup() sets the launcher's
    variables of its gloo group (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...) and verl's Worker writes more
    (REDIS_STORE_SERVER_HOST, ...); left set, a later test's subprocess inherits them and its
    init_process_group tries to listen on the port this process's store holds (EADDRINUSE). Autouse at module
    scope, so it is set up before the module's fixtures that build actors and torn down after them."""
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny tied Qwen2 checkpoint (verl_engine.save_tiny_qwen2, seed 3), saved once per test module."""
    import verl_engine
    path = str(tmp_path_factory.mktemp("qwen2"))
    verl_engine.save_tiny_qwen2(path, seed=3, tied=True)
    return path


@pytest.fixture
def uninstalled():
    """logitless.verl uninstalled before and after the test (whatever a test installs does not reach the next)."""
    import logitless.verl as lv
    lv.uninstall()
    yield
    lv.uninstall()


@pytest.fixture(scope="module")
def megatron_state():
    """Megatron's model-parallel state, which the first engine built in the module initialises, destroyed after
    the module."""
    yield
    import verl_megatron_engine
    verl_megatron_engine.teardown()
