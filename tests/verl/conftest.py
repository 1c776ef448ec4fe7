"""verl tests: the Megatron harness (tests/megatron/mcore_env.py) is importable from here (the seed
fixture is tests/conftest.py's)."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny tied Qwen2 checkpoint (verl_engine.save_tiny_qwen2, seed 3), saved once per test module."""
    import verl_engine
    path = str(tmp_path_factory.mktemp("qwen2"))
    verl_engine.save_tiny_qwen2(path, seed=3, tied=True)
    return path
