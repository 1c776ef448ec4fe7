"""TRL tests: one tiny Qwen2 (random weights, a fresh printed seed) saved once per test module."""
import os

import pytest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import trl_tiny
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"model seed={seed}")
    return trl_tiny.save_tiny_qwen2(str(tmp_path_factory.mktemp("tiny_qwen2")), seed)
