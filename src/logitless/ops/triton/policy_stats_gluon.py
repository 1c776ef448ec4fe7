"""Policy loss, stage 1 on Hopper: the statistics kernel of ``policy_stats`` written in Gluon (Triton's
lower-level language, shipped with triton 3.6), scheduled by hand so that one tile's epilogue runs while the
tensor cores compute the next tile.

The same outputs as ``policy_stats`` bit for bit (per-(token, vocabulary tile) m, s, t, the label logits zy and
e = exp(z - tile max) as float16; benchmarks/gpu_gluon_stats.py and tests/ops/test_policy_stats_gluon.py):

- one persistent program per multiprocessor walks the (token block, vocabulary tile) grid in grouped order of
  ``tile.tile_coords`` (the Triton function, called from Gluon: the same PTX); a tile is 64 x 256 with the
  default 256-column statistics tiles, 128 x 128 with 128-column ones (``TILE_ROWS``);
- a 1-warp load partition streams the h [rows, 64] and W [columns, 64] operand tiles into a STAGES-deep ring by
  TMA;
- two 4-warp consumer partitions take alternate tiles (ping-pong): while one runs its wgmma main loop, the other
  runs its epilogue (max, exp2, s, t, label pick) and hands e to a TMA store it waits for only at its next
  epilogue. Two ``turn`` barriers make them take the ring in turns.

Why: the Triton kernel (one 128 x 256 tile per program) leaves the tensor cores idle during each epilogue and
runs at 1.21-1.23x cuBLAS's product of the same shape; this one at 1.05-1.08x (H200, one 4096-token chunk,
V = 131072 / 151936; benchmarks/DESIGN.md). A cooperative form (both consumers on halves of a 128-row tile,
half the L2 reads of W) ran at 1.10-1.18x and was removed.

Used by ``policy_stats.chunk_stats`` where ``usable`` says so (Hopper, half-precision operands laid out for
TMA, e float16), and without its e store (STORE_E off: no staging buffers, no store) by ``forward_stats`` for
fused_logprobs' forward where ``usable_operands`` says so (H200: forward 1.02-1.05x cuBLAS against the Triton
kernel's 1.10-1.19x; benchmarks/results/gpu-invariance-2026-12-04.md); the Triton kernels stay the path everywhere
else and in the interpreter.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .common import capability_major, multiprocessors, tma_layout_ok
from .tile import tile_coords

LOG2E: gl.constexpr = gl.constexpr(1.4426950408889634)
LN2: gl.constexpr = gl.constexpr(0.6931471805599453)

# A consumer's tile, by the width of the caller's statistics tiles (policy_stats' BLOCK_N): token rows x that
# width, 16384 float32 accumulators (128 registers a thread) either way. 128 x 128 reads 20% fewer operand bytes
# per multiply-add than 64 x 256 (two 64-row wgmma per step).
TILE_ROWS = {256: 64, 128: 128}
BLOCK_K = 64
STAGES = 4          # 4 x 40 KiB (64 x 256; 32 KiB at 128 x 128) of operand ring + 2 x 32 KiB of e staging
FWD_STAGES = 4      # without e (fused_logprobs' forward): the ring alone; 5 measured no faster (H200)
GROUP_M = 16
CONSUMER_REGS = gl.constexpr(240)   # setmaxnreg per partition: 240 + 240 for the consumers, 24 for the loader
LOADER_REGS = gl.constexpr(24)
# The kernel's own register limit: its 12 warps (the loader's warp rounded up to a warpgroup) start with an
# equal share of the 64K registers, 65536 / 384 rounded down to 8, then trade them (setmaxnreg). A launch with
# maxnreg 240 is refused: 384 threads x 240 registers do not fit.
KERNEL_REGS = 65536 // (12 * 32) // 8 * 8


@gluon.jit
def _load_partition(args):
    """The loader warp: for each of this program's tiles, its K_TILES operand pairs into the ring."""
    (h_desc, w_desc, e_desc, ring_h, ring_w, e_bufs, ready, empty, turn, labels_ptr, inv_temp_ptr,
     part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr, n_rows, n_cols, K_TILES, STAGES_, GROUP) = args
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    n_tiles = gl.cdiv(n_rows, BM) * gl.cdiv(n_cols, BN)
    it = 0
    for tile_id in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        pid_m, pid_n = tile_coords(tile_id, n_rows, n_cols, BM, BN, GROUP)
        for k in range(K_TILES):
            s = it % STAGES_
            phase = (it // STAGES_) & 1
            # a slot starts empty: the first wait on its barrier passes (a fresh barrier's "previous phase"
            # counts as complete)
            mbarrier.wait(empty.index(s), phase ^ 1)
            mbarrier.expect(ready.index(s), h_desc.block_type.nbytes + w_desc.block_type.nbytes)
            # rows past n_rows and columns past n_cols come in as zeros (TMA bounds)
            tma.async_copy_global_to_shared(h_desc, [pid_m * BM, k * BK], ready.index(s), ring_h.index(s))
            tma.async_copy_global_to_shared(w_desc, [pid_n * BN, k * BK], ready.index(s), ring_w.index(s))
            it += 1


@gluon.jit
def _tile(args, tile_id, local, WHICH: gl.constexpr, WITH_T: gl.constexpr):
    """Consumer WHICH's tile (this program's local-th): the wgmma main loop over the ring, then the epilogue."""
    (h_desc, w_desc, e_desc, ring_h, ring_w, e_bufs, ready, empty, turn, labels_ptr, inv_temp_ptr,
     part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr, n_rows, n_cols, K_TILES, STAGES_, GROUP) = args
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, mma)
    col_layout: gl.constexpr = gl.SliceLayout(0, mma)
    pid_m, pid_n = tile_coords(tile_id, n_rows, n_cols, BM, BN, GROUP)
    base = local * K_TILES      # ring position of this tile's first operand pair
    # This consumer's m-th tile (m = local // 2) takes the ring once the other consumer has finished reading its
    # previous tile from it: phase m - 1 of turn[0] for consumer 0 (its first tile goes at once), phase m of
    # turn[1] for consumer 1. Without the turns, a consumer would wait on a slot's ready barrier a whole ring
    # ahead of the loader, which an mbarrier's one-bit phase cannot tell apart.
    m = local // 2
    if WHICH == 0:
        mbarrier.wait(turn.index(0), (m - 1) & 1, pred=m > 0)
    else:
        mbarrier.wait(turn.index(1), m & 1)
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma)
    for k in range(K_TILES):
        s = (base + k) % STAGES_
        mbarrier.wait(ready.index(s), ((base + k) // STAGES_) & 1)
        acc = warpgroup_mma(ring_h.index(s), ring_w.index(s).permute((1, 0)), acc, is_async=True)
        # at most one wgmma in flight: the previous one has read its slot, which goes back to the loader
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((base + k + STAGES_ - 1) % STAGES_), count=1, pred=k > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((base + K_TILES - 1) % STAGES_), count=1)
    mbarrier.arrive(turn.index(1 - WHICH), count=1)     # the other consumer's turn on the ring

    # the epilogue of tile.tempered_tile_stats / store_row_stats / store_label_logit, in the same order of
    # operations (the outputs agree bit for bit). Written again here, not called: those Triton functions do not
    # compile in Gluon (a scalar fill such as tl.where(..., -inf) needs a layout there; tried with triton 3.6).
    # tile.tile_coords, scalar-only, is called as it is.
    rows = pid_m * BM + gl.arange(0, BM, layout=row_layout)
    cols = pid_n * BN + gl.arange(0, BN, layout=col_layout)
    row_ok = rows < n_rows
    inv_t = gl.load(inv_temp_ptr + rows, mask=row_ok, other=1.0)
    # the label's logit first: after it only the exponentials need the tile (fewer live registers)
    label = gl.load(labels_ptr + rows, mask=row_ok, other=-1)
    here = row_ok & (label >= pid_n * BN) & (label < pid_n * BN + BN)
    zy = gl.sum(gl.where(cols[None, :] == label[:, None], acc, 0.0), axis=1) * inv_t
    gl.store(zy_ptr + rows, zy, mask=here)
    unlabelled = row_ok & ((label < 0) | (label >= n_cols)) & (pid_n == 0)
    gl.store(zy_ptr + rows, gl.zeros_like(inv_t), mask=unlabelled)
    acc = gl.where((cols < n_cols)[None, :], acc, float("-inf"))
    m_acc = gl.max(acc, axis=1)
    scale2 = inv_t * LOG2E
    d2 = acc * scale2[:, None] - (m_acc * scale2)[:, None]
    e = gl.exp2(d2)
    out = pid_n.to(gl.int64) * n_rows + rows
    gl.store(part_m_ptr + out, m_acc * inv_t, mask=row_ok)
    gl.store(part_s_ptr + out, gl.sum(e, axis=1), mask=row_ok)
    if WITH_T:
        gl.store(part_t_ptr + out, gl.sum(e * gl.maximum(d2, -1e30), axis=1) * LN2, mask=row_ok)
    if _stores_e(h_desc, e_desc):
        _store_e(e, e_desc, e_bufs.index(WHICH), pid_m, pid_n, BM, BN)


@gluon.constexpr_function
def _stores_e(h_desc, e_desc):
    """Whether the launch writes e: without it, e_desc is h's descriptor ([rows, BLOCK_K] blocks, never as wide as
    a statistics tile). Read from the descriptors' block shapes, which stay compile-time in every partition."""
    return e_desc.block_type.shape[1] != h_desc.block_type.shape[1]


@gluon.jit
def _store_e(e, e_desc, e_smem, pid_m, pid_n, BM: gl.constexpr, BN: gl.constexpr):
    """e to the workspace through this consumer's staging buffer ``e_smem`` by a TMA store left in flight."""
    # this consumer's previous store must have left the staging buffer (the issuing thread waits; the
    # barrier holds the partition's other warps until it has); the TMA store clips rows past n_rows, and columns
    # past n_cols only to a multiple of 8 (16 bytes): those few get e = 0 (``usable`` checks they exist)
    tma.store_wait(0)
    gl.thread_barrier()
    e_smem.store(e.to(gl.float16))
    fence_async_shared()
    gl.thread_barrier()     # every warp's part of e is in shared memory before the copy starts
    tma.async_copy_shared_to_global(e_desc, [pid_m * BM, pid_n * BN], e_smem)


@gluon.jit
def _consume(args, WHICH: gl.constexpr, WITH_T: gl.constexpr):
    """Consumer WHICH (0 or 1): every other tile of this program, so that one consumer's epilogue runs
    during the other's main loop."""
    (h_desc, w_desc, e_desc, ring_h, ring_w, e_bufs, ready, empty, turn, labels_ptr, inv_temp_ptr,
     part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr, n_rows, n_cols, K_TILES, STAGES_, GROUP) = args
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    n_tiles = gl.cdiv(n_rows, BM) * gl.cdiv(n_cols, BN)
    local = 0
    for tile_id in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
        if local % 2 == WHICH:
            _tile(args, tile_id, local, WHICH, WITH_T)
        local += 1
    tma.store_wait(0)


# The consumers' entry points, one per (consumer, with t): a constexpr inside ``args`` reaches the partitions as
# a run-time value, so the compile-time flags are in the choice of function instead.
@gluon.jit
def _consumer0(args):
    _consume(args, 0, True)


@gluon.jit
def _consumer1(args):
    _consume(args, 1, True)


@gluon.jit
def _consumer0_no_t(args):
    _consume(args, 0, False)


@gluon.jit
def _consumer1_no_t(args):
    _consume(args, 1, False)


# n_rows (the tokens of the call) is not specialised, so every batch runs the same build (docs/determinism.md)
@gluon.jit(do_not_specialize=["n_rows"])
def _policy_stats_gluon_kernel(h_desc, w_desc, e_desc, labels_ptr, inv_temp_ptr, part_m_ptr, part_s_ptr, part_t_ptr,
                               zy_ptr, n_rows, n_cols, K_TILES: gl.constexpr, STAGES_: gl.constexpr,
                               GROUP: gl.constexpr, STORE_E: gl.constexpr, WITH_T: gl.constexpr):
    """STORE_E: write e (the policy loss); else e_desc is a placeholder and only the statistics are written
    (fused_logprobs' forward). WITH_T: write t (the entropy's sums)."""
    ring_h = gl.allocate_shared_memory(h_desc.dtype, [STAGES_] + h_desc.block_type.shape, h_desc.layout)
    ring_w = gl.allocate_shared_memory(w_desc.dtype, [STAGES_] + w_desc.block_type.shape, w_desc.layout)
    if STORE_E:     # the kernel's own constexpr (static here, unlike inside the partitions)
        e_bufs = gl.allocate_shared_memory(e_desc.dtype, [2] + e_desc.block_type.shape, e_desc.layout)
    else:
        e_bufs = ring_h     # not used
    ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    args = (h_desc, w_desc, e_desc, ring_h, ring_w, e_bufs, ready, empty, turn, labels_ptr, inv_temp_ptr,
            part_m_ptr, part_s_ptr, part_t_ptr, zy_ptr, n_rows, n_cols, K_TILES, STAGES_, GROUP)
    if WITH_T:
        gl.warp_specialize([(_consumer0, (args, )), (_consumer1, (args, )), (_load_partition, (args, ))],
                           [4, 1], [CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([(_consumer0_no_t, (args, )), (_consumer1_no_t, (args, )), (_load_partition, (args, ))],
                           [4, 1], [CONSUMER_REGS, LOADER_REGS])


# Gluon is experimental: its API has changed between triton releases (warp_specialize's arguments among them).
# The kernel was written and checked on the H200 with triton 3.6; other releases keep the Triton kernel until
# it has been checked there (benchmarks/gpu_gluon_stats.py, tests/ops/test_policy_stats_gluon.py on a GPU).
CHECKED_TRITON = ("3.6",)


def usable(hidden: torch.Tensor, weight: torch.Tensor, e: torch.Tensor | None, block_n: int) -> bool:
    """Whether this kernel can fill the statistics of ``hidden`` over ``weight`` into ``e``: ``usable_operands``,
    and e given, float16, unit column stride, 16-byte aligned rows whose storage extends to a multiple of 8
    columns."""
    if e is None or not usable_operands(hidden, weight, block_n):
        return False
    if not (e.dtype == torch.float16 and tma_layout_ok(e)):
        return False
    # The TMA store clips the columns past V only to 16 bytes (seen on the H200: V = 4099 writes columns up to
    # 4103): e's storage must reach that far in its last row. The policy workspace's rows are 64-column aligned.
    c, vocab = e.shape
    end = e.storage_offset() + (c - 1) * e.stride(0) + -(-vocab // 8) * 8
    return end * e.element_size() <= e.untyped_storage().nbytes()


def usable_operands(hidden: torch.Tensor, weight: torch.Tensor, block_n: int) -> bool:
    """Whether this kernel can compute the statistics of ``hidden`` over ``weight`` (without e: fused_logprobs'
    forward): a checked triton release, a Hopper GPU (sm_90: wgmma), bfloat16 / float16 operands with unit stride
    along H and 16-byte aligned rows (TMA), and statistics tiles 256 or 128 columns wide (``TILE_ROWS``)."""
    if hidden.device.type != "cuda" or torch.version.hip is not None:
        return False
    if not triton.__version__.startswith(CHECKED_TRITON):
        return False
    if capability_major(hidden.device) != 9 or block_n not in TILE_ROWS:
        return False
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return False
    return tma_layout_ok(hidden) and tma_layout_ok(weight)


def descriptors(hidden, weight, e, block_n: int):
    """TMA descriptors of h [c, H], W [V, H] (bfloat16 / float16) and e [c, V] (float16; None: h's descriptor
    stands in, unused), for consumer tiles TILE_ROWS[block_n] x block_n."""
    dt = gl.bfloat16 if hidden.dtype == torch.bfloat16 else gl.float16
    block_m = TILE_ROWS[block_n]
    h_layout = gl.NVMMASharedLayout.get_default_for([block_m, BLOCK_K], dt)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, BLOCK_K], dt)
    h_desc = TensorDescriptor(hidden, list(hidden.shape), list(hidden.stride()), [block_m, BLOCK_K], h_layout)
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_n, BLOCK_K], w_layout)
    if e is None:
        return h_desc, w_desc, h_desc
    e_layout = gl.NVMMASharedLayout.get_default_for([block_m, block_n], gl.float16)
    return h_desc, w_desc, TensorDescriptor(e, list(e.shape), list(e.stride()), [block_m, block_n], e_layout)


def _launch_args(hidden, store_e: bool = True, with_t: bool = True) -> dict:
    return dict(K_TILES=triton.cdiv(hidden.shape[1], BLOCK_K), STAGES_=STAGES if store_e else FWD_STAGES,
                GROUP=GROUP_M, STORE_E=store_e, WITH_T=with_t)


def chunk_stats_gluon(hidden, weight, labels, inv_temp, part_m, part_s, part_t, zy, e, block_n: int):
    """As ``policy_stats.chunk_stats`` with statistics tiles ``block_n`` wide: with e given where ``usable``
    holds; with e None (only the statistics, fused_logprobs' forward; part_t None: no entropy) where
    ``usable_operands`` holds. Returns the compiled kernel (its registers and spills, for benchmarks)."""
    n = hidden.shape[0]
    vocab = weight.shape[0]
    h_desc, w_desc, e_desc = descriptors(hidden, weight, e, block_n)
    n_tiles = triton.cdiv(n, TILE_ROWS[block_n]) * triton.cdiv(vocab, block_n)
    with_t = part_t is not None
    return _policy_stats_gluon_kernel[(min(n_tiles, multiprocessors(hidden.device)), )](
        h_desc, w_desc, e_desc, labels, inv_temp, part_m, part_s, part_t if with_t else part_s, zy, n, vocab,
        **_launch_args(hidden, e is not None, with_t), num_warps=4, maxnreg=KERNEL_REGS)


def compile_for_hopper(c: int = 256, h: int = 4096, v: int = 8248, block_n: int = 256, store_e: bool = True):
    """Compile the kernel for sm_90 without a GPU (triton's own ptxas): the compiled kernel, for its shared
    memory, warps and registers. Needs triton imported without TRITON_INTERPRET (tests run it in a child)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    hidden, weight = torch.empty(c, h, dtype=torch.bfloat16), torch.empty(v, h, dtype=torch.bfloat16)
    stride = -(-v // 64) * 64
    e = torch.empty(c * stride, dtype=torch.float16).view(c, stride)[:, :v]
    h_desc, w_desc, e_desc = descriptors(hidden, weight, e if store_e else None, block_n)
    f = torch.empty(c)
    args = dict(h_desc=h_desc, w_desc=w_desc, e_desc=e_desc, labels_ptr=torch.empty(c, dtype=torch.int64),
                inv_temp_ptr=f, part_m_ptr=f, part_s_ptr=f, part_t_ptr=f, zy_ptr=f, n_rows=c, n_cols=v)
    const = _launch_args(hidden, store_e)
    sig = {k: mangle_type(x) for k, x in args.items()} | {k: "constexpr" for k in const}
    return triton.compile(GluonASTSource(_policy_stats_gluon_kernel, sig, const),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=KERNEL_REGS))
