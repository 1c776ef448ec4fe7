"""Which compiled build each Triton / Gluon launch of the forward statistics, the policy statistics and the combine
would use on an sm_90 GPU, for calls of different token counts, without a GPU.

Run as a child process without TRITON_INTERPRET (the suite sets it; under it there are no builds):
``python -m build_keys`` prints one JSON object {"keys": {kernel: {n: [key of each launch]}}, "programs":
{kernel: number of distinct sm_90 programs}}. A key is what triton's own launcher computes before it looks a build
up in its cache (the argument types and their specialisations: the value 1, divisibility by 16, pointer
alignment, plus the launch options); equal keys mean the same compiled kernel. The launches are intercepted
(nothing runs) and the host code is the real one, with the Hopper tiles and bulk-copy descriptors.

"keys" holds the statistics calls of 1 to 300 tokens. "programs" also takes the policy loss's real pass
(``policy_backend.policy_pass``), including chunks cut at sequence boundaries (``bounds``: a sequence-coupled loss),
whose slices of the labels, temperatures and statistics workspace start at any element, so their pointers are not
always 16-byte aligned and triton keys another build. Where a kernel has more than one key, each build is compiled
for sm_90 (triton's own compiler, no GPU) and the builds count as one program when their PTX is identical (the same
instructions in the same order: the same bits).
"""
from __future__ import annotations

import json

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
from triton.runtime.jit import create_function_from_signature

from logitless.ops.triton import combine, common, forward_stats, policy_backend, policy_stats, policy_stats_gluon

TOKENS = (1, 7, 16, 37, 64, 300)
# the policy pass: its own even chunks, and chunks at sequence boundaries starting at odd rows
POLICY_PASSES = {"pass of 37": (37, None), "pass of 300": (300, None), "bounds 0,3,10,37": (37, [0, 3, 10, 37]),
                 "bounds 0,5,133,300": (300, [0, 5, 133, 300])}
# the README's vocabulary: the combine's [512 tiles x 8 tokens] block, the layout that triton compiled differently for
# n % 16 == 0 (at a few dozen tiles the builds' programs happen to agree, and the PTX check below would miss it)
H, V = 96, 151936
TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
# the Gluon kernel runs only on the triton releases it was checked with (policy_stats_gluon.CHECKED_TRITON): on
# another the ops launch the Triton kernels alone, and so does this drive
GLUON = triton.__version__.startswith(policy_stats_gluon.CHECKED_TRITON)
KEYS: dict = {}
BUILDS: dict = {}     # kernel -> {key: what triton.compile needs}


def _intercept(name, fn, case):
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)

    def run(*args, grid, warmup, **kwargs):
        bound, spec, options = binder(*args, **kwargs)
        key = repr((spec, options))
        if isinstance(case[0], int):
            KEYS.setdefault(name, {}).setdefault(str(case[0]), []).append(key)
        if key not in BUILDS.setdefault(name, {}):
            BUILDS[name][key] = (fn, *fn._pack_args(BACKEND, kwargs, bound, spec, options))
    fn.run = run


def _ptx(fn, options, signature, constexprs, attrs) -> str:
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__).asm["ptx"]


def _usable_operands(hidden, weight, block_n):
    """policy_stats_gluon.usable_operands, as it answers on an H200 (its device checks pass there)."""
    return (common.tma_layout_ok(hidden) and common.tma_layout_ok(weight) and block_n in policy_stats_gluon.TILE_ROWS
            and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype)


def main():
    common.hopper_or_newer = lambda device: True          # the H200's tiles and bulk-copy loads
    policy_stats_gluon.multiprocessors = lambda device: 132
    case = [0]
    _intercept("forward statistics (Triton)", forward_stats._tile_stats_kernel, case)
    _intercept("combine", combine._combine_kernel, case)
    _intercept("policy statistics (Triton)", policy_stats._policy_stats_kernel, case)
    if GLUON:
        _intercept("statistics (Gluon)", policy_stats_gluon._policy_stats_gluon_kernel, case)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(max(TOKENS), H, generator=g).bfloat16()
    weight = torch.empty(V, H, dtype=torch.bfloat16)      # nothing runs: only its shape, strides and address
    labels = torch.randint(0, V, (max(TOKENS),), generator=g)
    inv_t = torch.ones(max(TOKENS))
    n_tiles = -(-V // 256)
    stride = -(-V // 64) * 64
    for n in TOKENS:
        case[0] = n
        h, y, t = hidden[:n], labels[:n], inv_t[:n]
        forward_stats.stats(h, weight, y, t, True)
        parts = [torch.empty(n_tiles, n) for _ in range(3)]
        zy = torch.empty(n)
        e = torch.empty(n * stride, dtype=torch.float16).view(n, stride)[:, :V]
        policy_stats.chunk_stats(h, weight, y, t, *parts, zy, e)
        if GLUON:
            policy_stats_gluon.chunk_stats_gluon(h, weight, y, t, *parts, zy, e, 256)
            policy_stats_gluon.chunk_stats_gluon(h, weight, y, t, parts[0], parts[1], None, zy, None, 256)

    # the policy pass as on an H200: its statistics from the Gluon kernel (the Triton one on another triton), then
    # the combine
    if GLUON:
        policy_stats_gluon.usable_operands = _usable_operands
        policy_stats.gluon_stats = policy_stats_gluon            # None off the GPU
    for stage in ("dlogits_in_place", "product_into", "accumulate_product"):   # after the statistics: not keyed
        setattr(policy_backend, stage, lambda *args, **kwargs: None)

    def no_loss(start, stop, lse, ent, zy):
        return lse, ent, torch.zeros(stop - start), torch.zeros(stop - start)
    for name, (n, bounds) in POLICY_PASSES.items():
        case[0] = name
        policy_backend.policy_pass(hidden[:n], weight, labels[:n], inv_t[:n], no_loss, torch.empty(n, H), None,
                                   bounds=bounds)
    programs = {}
    for kernel, builds in BUILDS.items():
        # builds of one variant (the same compile-time constants and options: with or without e, entropy...)
        variants: dict = {}
        for fn, options, signature, constexprs, attrs in builds.values():
            variant = variants.setdefault(repr((sorted(constexprs.items()), options)), [])
            variant.append((fn, options, signature, constexprs, attrs))
        programs[kernel] = max(len({_ptx(*build) for build in variant}) if len(variant) > 1 else 1
                               for variant in variants.values())
    print(json.dumps({"keys": KEYS, "programs": programs}))


if __name__ == "__main__":
    main()
