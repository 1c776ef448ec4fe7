"""Which compiled build each Triton / Gluon launch of the forward statistics, the policy statistics and the combine
would use on an sm_90 GPU, for calls of different token counts, without a GPU.

Run as a child process without TRITON_INTERPRET (the suite sets it; under it there are no builds):
``python -m build_keys`` prints one JSON object {kernel: {n: [key of each launch]}}. A key is what triton's own
launcher computes before it looks a build up in its cache (the argument types and their specialisations: the
value 1, divisibility by 16, pointer alignment, plus the launch options); equal keys mean the same compiled
kernel. The launches are intercepted (nothing runs) and the host code is the real one, with the Hopper tiles and
bulk-copy descriptors.
"""
from __future__ import annotations

import json

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from logitless.ops.triton import combine, common, forward_stats, policy_stats, policy_stats_gluon

TOKENS = (1, 7, 16, 37, 64, 300)
H, V = 96, 4099
BACKEND = make_backend(GPUTarget("cuda", 90, 32))
KEYS: dict = {}


def _intercept(name, fn, n_of):
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)

    def run(*args, grid, warmup, **kwargs):
        _, spec, options = binder(*args, **kwargs)
        KEYS.setdefault(name, {}).setdefault(str(n_of[0]), []).append(repr((spec, options)))
    fn.run = run


def main():
    common._hopper_or_newer = lambda device: True          # the H200's tiles and bulk-copy loads
    policy_stats_gluon.multiprocessors = lambda device: 132
    current = [0]
    _intercept("forward statistics (Triton)", forward_stats._tile_stats_kernel, current)
    _intercept("combine", combine._combine_kernel, current)
    _intercept("policy statistics (Triton)", policy_stats._policy_stats_kernel, current)
    _intercept("statistics (Gluon)", policy_stats_gluon._policy_stats_gluon_kernel, current)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(max(TOKENS), H, generator=g).bfloat16()
    weight = torch.randn(V, H, generator=g).bfloat16()
    labels = torch.randint(0, V, (max(TOKENS),), generator=g)
    inv_t = torch.ones(max(TOKENS))
    n_tiles = -(-V // 256)
    stride = -(-V // 64) * 64
    for n in TOKENS:
        current[0] = n
        h, y, t = hidden[:n], labels[:n], inv_t[:n]
        forward_stats.stats(h, weight, y, t, True)
        parts = [torch.empty(n_tiles, n) for _ in range(3)]
        zy = torch.empty(n)
        e = torch.empty(n * stride, dtype=torch.float16).view(n, stride)[:, :V]
        policy_stats.chunk_stats(h, weight, y, t, *parts, zy, e)
        policy_stats_gluon.chunk_stats_gluon(h, weight, y, t, *parts, zy, e, 256)
        policy_stats_gluon.chunk_stats_gluon(h, weight, y, t, parts[0], parts[1], None, zy, None, 256)
    print(json.dumps(KEYS))


if __name__ == "__main__":
    main()
