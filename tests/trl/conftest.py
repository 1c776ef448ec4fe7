import os
import random

import pytest


@pytest.fixture
def seed():
    """A fresh seed per test (printed, so a failure can be replayed with LOGITLESS_SEED)."""
    s = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={s}")
    random.seed(s)
    return s
