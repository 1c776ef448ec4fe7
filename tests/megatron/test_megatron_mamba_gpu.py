"""A HybridModel with real Mamba layers on a GPU: megatron-core's MambaMixer with mamba-ssm's Triton SSD scan and
gated RMSNorm kernels (mamba_env.py: mamba-ssm's source, no CUDA extension; causal-conv1d absent, so the mixer's
torch Conv1d), through logitless' legacy patch, against the model's own logits: log-probs, entropy, every
parameter gradient and the fused policy loss (test_megatron_mamba.check_against_own_logits)."""
import os

import pytest
import torch

from required import import_or_skip

import_or_skip("megatron.core", "make setup installs megatron-core")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="mamba-ssm's Triton kernels need a GPU")


@pytest.fixture(scope="module")
def megatron_gpu():
    import mcore_env
    with mcore_env.megatron_on_gpu():
        yield


@pytest.fixture(scope="module")
def mixer():
    import mamba_env
    with mamba_env.mamba_mixer() as module:
        yield module


def test_mamba_hybrid_on_gpu(megatron_gpu, mixer):
    import mamba_env
    from test_megatron_mamba import check_against_own_logits
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    # Triton's tl.dot wants blocks of 16 or more: chunks of 64 tokens (two here, the second partial), heads of 64
    model = mamba_env.build_mamba_hybrid(mixer, seed=seed, chunk_size=64, head_dim=64).cuda()
    worst, gworst = check_against_own_logits(model, "cuda", torch.Generator().manual_seed(seed), b=2, s=125)
    print(f"mamba hybrid on GPU: max |d logprob/entropy| {worst:.2e}, max grad rel err {gworst:.2e}")
