import os
import random

import pytest
import torch

# Triton kernels run through triton's CPU interpreter where there is no GPU. It must be set before
# anything imports triton (megatron-core does at import time), hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def seed():
    """A fresh seed per test (printed, so a failure can be replayed with LOGITLESS_SEED)."""
    s = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={s}")
    random.seed(s)
    return s
