"""What the Triton kernels share: the interpreter switch, dtypes and block-size choice."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ... import knobs
from ..maths import split_code, tf32_enabled

# triton decides at decoration time whether @triton.jit builds GPU code or interpreter functions,
# from TRITON_INTERPRET as it was when triton was imported.
INTERPRETING = bool(triton.knobs.runtime.interpret)

# constexprs so kernels can read them: the kernels work in base 2 (exp2 is the hardware's exponential)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def tl_dtype(dtype: torch.dtype):
    return _TL_DTYPES[dtype]


# The split kernels' K depth between flushes of their tensor-core accumulator onto a float32 sum (``tile._flush``).
# The tensor cores truncate each 16-deep step's sum relative to the accumulator: a model of that
# (benchmarks/cpu_accumulation_model.py) gives the log-prob error measured on an H100 without flushes (2.4e-4 at
# logit std 8, K 4096); flushing every 128 of K takes it to 1.0e-5 for float32 products and bf16x3 to its own
# rounding (9.9e-5 at std 8 over 32 tokens). Not yet measured on a GPU.
SPLIT_FLUSH_K = 128


def dot_flags(dtype: torch.dtype) -> dict:
    """Compile-time switches of the matrix product for inputs of ``dtype``.

    UPCAST: the interpreter's bf16 ``tl.dot`` is wrong (numpy has no bf16), so there, and only there,
    tiles are cast to float32 first. IEEE: float32 inputs must not silently become tf32 (error ~1e-3),
    except inside ``maths.tf32_products`` (precision "tf32": operands already rounded to TF32, exact either way;
    the interpreter keeps IEEE, the same numbers). SPLIT (``maths.split_code``) and FLUSH_K (``SPLIT_FLUSH_K``, or
    LOGITLESS_SPLIT_FLUSH_K): the split of float32 operands in the kernel, and its accumulator's flush depth.
    """
    split = split_code() if dtype == torch.float32 else 0
    return {"UPCAST": INTERPRETING and dtype != torch.float32,
            "IEEE": (dtype == torch.float32 and not tf32_enabled() and not split) or INTERPRETING,
            "SPLIT": split, "INTERP": INTERPRETING,
            "FLUSH_K": knobs.split_flush_k(SPLIT_FLUSH_K) if split else 0}


@dataclass(frozen=True)
class Tiles:
    """Block sizes and launch shape of one tile kernel."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Small tiles under the interpreter: its cost is per program and per op, and tests use small shapes.
INTERPRETER_TILES = Tiles(16, 64, 32, 4, 4, 1)


def hopper_or_newer(device: torch.device) -> bool:
    """NVIDIA compute capability >= 9.0: the bulk copy engine, and 228 KiB of shared memory per SM."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return capability_major(device) >= 9


def capability_major(device: torch.device) -> int:
    """The CUDA device's compute capability major (9: Hopper)."""
    return _capability_major(_index(device))


def multiprocessors(device: torch.device) -> int:
    """The CUDA device's number of streaming multiprocessors (a persistent kernel's programs)."""
    return _sm_count(_index(device))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# asked before every launch: a device's properties do not change, the query's host time adds up
@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Before Hopper (A100: 164 KiB shared memory, consumer parts ~100 KiB) the H200 tiles do not fit:
# 128 x 128 x 32 in 3 stages needs 48 KiB. Not tuned: no such GPU was measured.
PRE_HOPPER_TILES = Tiles(128, 128, 32, 8, 4, 3)
# float32 operands go through IEEE fp32 FMA (no tf32), whose tiles need more registers than bf16 wgmma
FLOAT32_TILES = Tiles(64, 64, 32, 8, 4, 3)
# float32 operands split in registers (``maths.split_in_kernel``): bfloat16 tensor-core dots on float32 tiles (a
# float32 [128 + 128, 32] stage is a bfloat16 [256, 64] one's bytes) and two float32 accumulators. Not tuned
# on a GPU yet: LOGITLESS_TRITON_FWD / _BWD / _POLICY override it for the sweep.
SPLIT_TILES = Tiles(128, 128, 32, 8, 8, 3)


# H200 sweep (benchmarks/DESIGN.md): 128 x 256 x 64, 8 warps, 16 token blocks per group; 3 stages forward,
# 4 backward
HOPPER_TILES = {"FWD": Tiles(128, 256, 64, 16, 8, 3), "BWD": Tiles(128, 256, 64, 16, 8, 4),
                # the policy-loss statistics kernel stores a tile, like BWD. H200 (benchmarks/DESIGN.md, 2026-12-03):
                # 32 token blocks per group measured 0.6% slower at A and 9% slower at B; 3 stages no better.
                # On Hopper the Gluon kernel (policy_stats_gluon, BLOCK_N 256) takes its place.
                "POLICY": Tiles(128, 256, 64, 16, 8, 4)}


def choose_tiles(stage: str, dtype: torch.dtype, device: torch.device) -> Tiles:
    """Tiles of the "FWD" or "BWD" kernel; LOGITLESS_TRITON_<stage> overrides them for benchmarking."""
    if INTERPRETING:
        return INTERPRETER_TILES
    env = knobs.triton_tiles(stage)
    if env is not None:
        return Tiles(*env)
    if dtype == torch.float32:
        return SPLIT_TILES if split_code() and hopper_or_newer(device) else \
            PRE_HOPPER_TILES if split_code() else FLOAT32_TILES
    if not hopper_or_newer(device):
        return PRE_HOPPER_TILES
    return HOPPER_TILES[stage]


def tma_layout_ok(t: torch.Tensor) -> bool:
    """The bulk copy engine needs unit stride along H and 16-byte aligned rows and base."""
    size = t.element_size()
    return (t.dim() == 2 and t.stride(1) == 1 and t.shape[0] > 0 and (t.stride(0) * size) % 16 == 0
            and t.data_ptr() % 16 == 0 and (t.shape[1] * size) >= 16)


def launch_options(tiles: Tiles, hidden: torch.Tensor, softcap) -> dict:
    """The compile-time keywords every tile kernel takes (tiles, K loop, dot switches, softcap) and
    the launch shape, for inputs ``hidden`` [N, K] and ``softcap`` (None or c > 0: the cap is a
    compile-time constant, one build per distinct value; a model has one)."""
    k = hidden.shape[1]
    return dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
                K_TILES=triton.cdiv(k, tiles.block_k), GROUP_M=tiles.group_m, EVEN_K=(k % tiles.block_k == 0),
                **dot_flags(hidden.dtype), SOFTCAP=softcap is not None,
                CAP=1.0 if softcap is None else float(softcap),
                num_warps=tiles.num_warps, num_stages=tiles.num_stages)


def int32_safe(t: torch.Tensor, block_k: int) -> torch.Tensor:
    """``t`` itself, or a contiguous copy when the pointer-load path's per-K-step offsets (block_k x the
    stride along H, computed in int32 by the kernel) would overflow: only a column-major operand with more
    than 2^31 / block_k rows gets here (the row offsets themselves are int64 in the kernel)."""
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) * block_k >= 2 ** 31:
        return t.contiguous()
    return t


def on_device(t: torch.Tensor):
    """A context in which kernels launch on ``t``'s GPU: triton launches on the current device (and its current
    stream), which need not be the tensors' on a host of several GPUs. A no-op for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
