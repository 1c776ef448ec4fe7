import os

import torch

# Triton kernels run through triton's CPU interpreter where there is no GPU. It must be set before
# anything imports triton (megatron-core does at import time), hence here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
