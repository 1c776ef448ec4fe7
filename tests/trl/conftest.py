"""TRL tests: tiny Qwen2s (random weights, fresh printed seeds) saved once per test module."""
import os

import pytest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import trl_tiny
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"model seed={seed}")
    return trl_tiny.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")), seed)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A wider, deeper tiny Qwen2 on the same vocabulary (H = 48, 3 layers): the distillation tests' teacher."""
    import trl_tiny
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"teacher seed={seed}")
    return trl_tiny.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_teacher")), seed, hidden_size=48, layers=3)
