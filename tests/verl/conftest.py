"""verl tests: the Megatron harness (tests/megatron/mcore_env.py) is importable from here, and a
fresh seed per test."""
import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "megatron"))


@pytest.fixture
def seed():
    """A fresh seed per test (printed, so a failure can be replayed with LOGITLESS_SEED)."""
    s = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={s}")
    random.seed(s)
    return s
