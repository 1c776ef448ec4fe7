"""The Gluon statistics kernel (ops/triton/policy_stats_gluon.py), the policy loss's stage 1 on Hopper.

- On any machine: it compiles for sm_90 within one block's shared memory and a launchable register budget. In
  a child process: the suite imports triton with TRITON_INTERPRET=1 (tests/conftest.py), under which Gluon does
  not compile.
- On a Hopper GPU: its outputs equal the Triton kernel's bit for bit (which the rest of the suite holds to
  float64), on ragged shapes with ignored labels and per-token temperatures, and it is the kernel used there.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from logitless.ops.triton.common import INTERPRETING

pytest.importorskip("triton.experimental.gluon")

from logitless.ops.triton.policy_stats_gluon import CHECKED_TRITON  # noqa: E402

CHILD = """
import json
from logitless.ops.triton.policy_stats_gluon import TILE_ROWS, compile_for_hopper
for block_n in TILE_ROWS:
    for store_e in (True, False):
        k = compile_for_hopper(block_n=block_n, store_e=store_e)
        print(json.dumps({"block_n": block_n, "store_e": store_e, "shared": k.metadata.shared,
                          "num_warps": k.metadata.num_warps, "maxnreg": k.metadata.maxnreg,
                          "cubin": len(k.asm["cubin"])}))
"""


@pytest.mark.skipif(not triton.__version__.startswith(CHECKED_TRITON),
                    reason=f"the ops launch the Gluon kernel on triton {CHECKED_TRITON} only (Gluon's API changes "
                           f"between releases; triton {triton.__version__}: the Triton kernels run, and the Gluon "
                           "kernel does not compile there as written)")
def test_compiles_for_hopper():
    """Both consumer tiles (64 x 256 and 128 x 128), with e (the policy loss) and without (fused_logprobs)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    metas = [json.loads(line) for line in out.stdout.strip().splitlines() if line.startswith("{")]
    assert sorted((m["block_n"], m["store_e"]) for m in metas) == [(128, False), (128, True), (256, False),
                                                                   (256, True)]
    for meta in metas:
        assert meta["shared"] <= 232448      # the H100 / H200 limit per block
        assert meta["num_warps"] == 12       # two consumer warpgroups and the loader's (rounded to a warpgroup)
        # the launch is refused unless every thread's starting share of the 64K registers fits
        assert meta["num_warps"] * 32 * meta["maxnreg"] <= 65536
        assert meta["cubin"] > 0


HOPPER = (not INTERPRETING and torch.cuda.is_available() and torch.version.hip is None
          and torch.cuda.get_device_capability()[0] == 9)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on Hopper GPUs only (wgmma, TMA)")
@pytest.mark.parametrize("tiles", ["", "128,128,64,16,8,4"])
def test_gluon_statistics_equal_the_triton_kernel(monkeypatch, tiles):
    """Several programs' worth of tiles with an odd count per program (the consumers alternate), ragged last
    row block, vocabulary tile and K step, both half-precision dtypes; the default 256-column statistics tiles
    and 128-column ones (LOGITLESS_TRITON_POLICY: the Gluon kernel's 128 x 128 consumer tiles)."""
    from logitless.ops.triton import policy_stats
    from logitless.ops.triton.common import choose_tiles
    from logitless.ops.triton.policy_backend import row_stride
    monkeypatch.setenv("LOGITLESS_TRITON_POLICY", tiles)
    for dtype, (c, h, v) in itertools.product((torch.bfloat16, torch.float16),
                                              ((300, 256, 4099), (7, 96, 1031), (4096 + 65, 512, 8192 + 300))):
        hidden = torch.randn(c, h, device="cuda").to(dtype)
        weight = (torch.randn(v, h, device="cuda") * (3 / h ** 0.5)).to(dtype)
        labels = torch.randint(0, v, (c,), device="cuda")
        labels[::5] = -1
        inv_t = torch.rand(c, device="cuda") + 0.5
        block_n = choose_tiles("POLICY", dtype, hidden.device).block_n
        n_tiles = triton.cdiv(v, block_n)
        results = []
        for kernel in ("auto", "triton"):
            monkeypatch.setenv("LOGITLESS_POLICY_STATS_KERNEL", kernel)
            ws = torch.full((c, row_stride(v)), float("nan"), dtype=torch.float16, device="cuda")
            parts = [torch.full((n_tiles, c), float("nan"), device="cuda") for _ in range(3)]
            zy = torch.full((c,), float("nan"), device="cuda")
            if kernel == "auto":
                assert policy_stats.gluon_stats.usable(hidden, weight, ws[:, :v], block_n)
            policy_stats.chunk_stats(hidden, weight, labels, inv_t, *parts, zy, ws[:, :v])
            torch.cuda.synchronize()
            # every e written; of the padding at most the columns up to a multiple of 8 (the Gluon kernel's TMA
            # store clips to 16 bytes), and those with 0
            pad = -(-v // 8) * 8 if kernel == "auto" else v
            assert not ws[:, :v].isnan().any() and ws[:, pad:].isnan().all()
            assert (ws[:, v:pad] == 0).all()
            assert not any(p.isnan().any() for p in parts) and not zy.isnan().any()
            results.append((ws[:, :v], *parts, zy))
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), (dtype, c, h, v)
        # a last row that ends at V (not a multiple of 8) leaves the store no room: the Triton kernel then
        tight = torch.empty(c * row_stride(v) - (row_stride(v) - v), dtype=torch.float16, device="cuda")
        tight_e = tight.as_strided((c, v), (row_stride(v), 1))
        assert policy_stats.gluon_stats.usable(hidden, weight, tight_e, block_n) == (v % 8 == 0)


@pytest.mark.skipif(not HOPPER, reason="the Gluon kernel runs on Hopper GPUs only (wgmma, TMA)")
def test_gluon_forward_statistics_equal_the_triton_kernel(monkeypatch):
    """fused_logprobs' forward statistics (no e) from the Gluon kernel equal the Triton tile kernel's bit for bit,
    with and without the entropy's sums; and the default uses the Gluon kernel."""
    from logitless.ops.triton import forward_stats
    for dtype, (c, h, v), with_entropy in itertools.product(
            (torch.bfloat16, torch.float16), ((300, 256, 4099), (7, 96, 1031), (4096 + 65, 512, 8192 + 300)),
            (True, False)):
        hidden = torch.randn(c, h, device="cuda").to(dtype)
        weight = (torch.randn(v, h, device="cuda") * (3 / h ** 0.5)).to(dtype)
        labels = torch.randint(0, v, (c,), device="cuda")
        labels[::5] = -1
        inv_t = torch.rand(c, device="cuda") + 0.5
        block_n = forward_stats.choose_tiles("FWD", dtype, hidden.device).block_n
        monkeypatch.delenv("LOGITLESS_TRITON_FWD_KERNEL", raising=False)
        assert forward_stats._gluon_usable(hidden, weight, None, block_n)
        results = []
        for kernel in ("auto", "triton"):
            monkeypatch.setenv("LOGITLESS_TRITON_FWD_KERNEL", kernel)
            out = forward_stats.tile_stats(hidden, weight, labels, inv_t, with_entropy)
            results.append([x for x in out if x is not None])
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b), (dtype, c, h, v, with_entropy)
