"""Every ``LOGITLESS_*`` environment variable, read here and nowhere else (docs/knobs.md).

Read at call time, not at import, so a benchmark or test can set one for a single call. A value
that does not parse raises ValueError naming the variable.
"""
from __future__ import annotations

import os
from typing import Optional

_TRUE = ("1", "true", "yes", "on")


def _int(name: str, default: Optional[int]) -> Optional[int]:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a positive integer") from None
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be a positive integer")
    return value


def strict() -> bool:
    """LOGITLESS_STRICT: forbid every silent fallback to an unfused path ("1", "true", "yes", "on")."""
    return os.environ.get("LOGITLESS_STRICT", "").strip().lower() in _TRUE


def chunk_elements(default: Optional[int]) -> Optional[int]:
    """LOGITLESS_CHUNK_ELEMENTS: float32 logits per chunk of the chunked backend (``default`` when unset)."""
    return _int("LOGITLESS_CHUNK_ELEMENTS", default)


def chunked_columns() -> str:
    """LOGITLESS_CHUNKED_COLUMNS: where the chunked backend's forward cuts the vocabulary: "auto" (the default: the
    device's rule, ``chunked.DEFAULT_COLUMNS``), "fixed" (at columns set by the vocabulary and the tile budget alone,
    the same for every batch), "batch" (chunks of LOGITLESS_CHUNK_ELEMENTS / N columns, N the call's tokens)."""
    raw = os.environ.get("LOGITLESS_CHUNKED_COLUMNS", "").strip().lower() or "auto"
    if raw not in ("auto", "fixed", "batch"):
        raise ValueError(f"LOGITLESS_CHUNKED_COLUMNS={raw!r} must be auto, fixed or batch")
    return raw


def truncation_candidates() -> int:
    """LOGITLESS_TRUNCATION_CANDIDATES: ids per token in the first selection round of a truncated log-prob (default
    128, the largest the triton selection kernel takes); tokens whose kept set may be larger are asked again."""
    return _int("LOGITLESS_TRUNCATION_CANDIDATES", 128)


def dlogits_elements(default: int) -> int:
    """LOGITLESS_TRITON_DLOGITS_ELEMENTS: elements of the triton backward's dlogits workspace."""
    return _int("LOGITLESS_TRITON_DLOGITS_ELEMENTS", default)


def triton_tiles(stage: str) -> Optional[tuple[int, ...]]:
    """LOGITLESS_TRITON_FWD / _BWD / _POLICY / _TOPK / _ABOVE = "BM,BN,BK,GROUP_M,warps,stages":
    the tiles of that kernel (benchmarking only); None when unset."""
    return _ints(f"LOGITLESS_TRITON_{stage}", 6, "six positive integers BM,BN,BK,GROUP_M,warps,stages")


def _ints(name: str, count: int, rule: str, powers_of_two: bool = False) -> Optional[tuple[int, ...]]:
    """``count`` comma-separated positive integers (powers of two where asked) from ``name``; None when unset;
    a ValueError citing ``rule`` otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        values = tuple(int(x) for x in raw.split(","))
    except ValueError:
        values = ()
    if len(values) != count or min(values) < 1 or (powers_of_two and any(v & (v - 1) for v in values)):
        raise ValueError(f"{name}={raw!r} must be {rule}")
    return values


def truncation_dense_ids(default: int) -> int:
    """LOGITLESS_TRUNCATION_DENSE_IDS: kept ids from which a token of a truncated log-prob takes the dense backward
    (the plain op's, masked to its kept set) instead of the pairs' (default V / 200; where the wide round runs).
    1: every token whose set boundary is clear; a number past V: none."""
    return _int("LOGITLESS_TRUNCATION_DENSE_IDS", default)


def truncation_nucleus() -> str:
    """LOGITLESS_TRUNCATION_NUCLEUS: how the wide round decides a wide kept set: "kernel" (the default: its boundary,
    size, mass and entropy from the emitted logits as they lie, ``ops/triton/nucleus.py``) or "sort" (every emitted
    id sorted, then cut); for benchmarking."""
    raw = os.environ.get("LOGITLESS_TRUNCATION_NUCLEUS", "").strip().lower() or "kernel"
    if raw not in ("kernel", "sort"):
        raise ValueError(f"LOGITLESS_TRUNCATION_NUCLEUS={raw!r} must be kernel or sort")
    return raw


def pairs_path() -> str:
    """LOGITLESS_PAIRS_PATH: the truncated log-prob's kept-pair products: "auto" (the default: the Triton kernels
    for CUDA tensors where triton imports, else the torch gathers), "torch" (the torch gathers everywhere) or
    "triton" (the kernels on any tensors: on CPU ones through triton's interpreter); for benchmarking."""
    raw = os.environ.get("LOGITLESS_PAIRS_PATH", "").strip().lower() or "auto"
    if raw not in ("auto", "torch", "triton"):
        raise ValueError(f"LOGITLESS_PAIRS_PATH={raw!r} must be auto, torch or triton")
    return raw


def triton_pairs() -> Optional[tuple[int, ...]]:
    """LOGITLESS_TRITON_PAIRS = "BLOCK_P,BLOCK_H,warps": the kept pairs' kernels' pairs per step, H per tile and warps
    (benchmarking only; powers of two); None when unset."""
    return _ints("LOGITLESS_TRITON_PAIRS", 3, "three powers of two BLOCK_P,BLOCK_H,warps", powers_of_two=True)


def triton_tma() -> bool:
    """LOGITLESS_TRITON_TMA: "0" turns the bulk-copy (TMA) tile loads off (pointer loads instead)."""
    return os.environ.get("LOGITLESS_TRITON_TMA", "1").strip() != "0"


def split_in_kernel() -> bool:
    """LOGITLESS_SPLIT_IN_KERNEL: "0" runs the split precisions of float32 operands on the triton backend from the
    concatenated bfloat16 split copies ([V, kH] and [N, kH]: the bfloat16 kernels at k times the depth) instead of
    splitting the float32 tiles in the kernels' registers (the default: no copy). For benchmarks: the two paths'
    numbers agree to the split's rounding, their time and memory differ."""
    return os.environ.get("LOGITLESS_SPLIT_IN_KERNEL", "1").strip() != "0"


def split_flush_k(default: int) -> int:
    """LOGITLESS_SPLIT_FLUSH_K: K depth between the split kernels' flushes of their tensor-core accumulator onto a
    float32 sum (``ops/triton/tile.py``'s ``_flush``); "0" never flushes. For benchmarks: accuracy against time."""
    raw = os.environ.get("LOGITLESS_SPLIT_FLUSH_K", "").strip()
    if raw == "0":
        return 0
    return _int("LOGITLESS_SPLIT_FLUSH_K", default)


def topk_bytes(default: int) -> int:
    """LOGITLESS_TOPK_BYTES: bytes of one token chunk's candidates and residuals in the triton selection kernels
    (``ops/triton/topk_select.py``); more tokens run in chunks."""
    return _int("LOGITLESS_TOPK_BYTES", default)


def topk_candidates(default: int) -> int:
    """LOGITLESS_TOPK_CANDIDATES: candidates per tile and token in the triton selection kernels' first pass (a
    power of two; benchmarking)."""
    return _int("LOGITLESS_TOPK_CANDIDATES", default)


def given_set_bytes(default: int) -> int:
    """LOGITLESS_GIVEN_SET_BYTES: bytes of one token chunk's per-tile rests in the triton given-set kernels
    (``ops/triton/given_set.py``: the mass outside given ids); more tokens run in chunks."""
    return _int("LOGITLESS_GIVEN_SET_BYTES", default)


def triton_stats_bytes(default: int) -> int:
    """LOGITLESS_TRITON_STATS_BYTES: bytes of the triton forward's per-tile statistics workspace; more
    tokens than fit are processed in token chunks that reuse it."""
    return _int("LOGITLESS_TRITON_STATS_BYTES", default)


def triton_bwd_tokens(default: int) -> int:
    """LOGITLESS_TRITON_BWD_TOKENS: most tokens one call of the triton backward takes; more are processed in
    token chunks (d_weight then accumulates in float32 across them)."""
    return _int("LOGITLESS_TRITON_BWD_TOKENS", default)


def policy_workspace_bytes(default: int) -> int:
    """LOGITLESS_POLICY_WORKSPACE_BYTES: bytes of the triton policy loss's per-chunk [tokens x vocab] workspace
    (the e = exp(z - tile max) tile, then the chunk's dlogits); it sets how many tokens a chunk holds."""
    return _int("LOGITLESS_POLICY_WORKSPACE_BYTES", default)


def policy_workspace_max_bytes(default: int) -> int:
    """LOGITLESS_POLICY_WORKSPACE_MAX_BYTES: the most bytes the triton policy loss's workspace may grow to so that
    a loss coupled within sequences keeps its one pass when a sequence is longer than a chunk of
    LOGITLESS_POLICY_WORKSPACE_BYTES (default: twice that); a longer sequence takes the two-pass path."""
    return _int("LOGITLESS_POLICY_WORKSPACE_MAX_BYTES", default)


def policy_dw_fp32() -> bool:
    """LOGITLESS_POLICY_DW_FP32: "1" accumulates the triton policy loss's d_weight over token chunks in a
    float32 [V, H] buffer (one rounding at the end; 2 x the weight's size in extra memory for bf16) instead
    of in the gradient buffer itself (one rounding per chunk)."""
    return os.environ.get("LOGITLESS_POLICY_DW_FP32", "").strip().lower() in _TRUE


def forward_stats_kernel() -> str:
    """LOGITLESS_TRITON_FWD_KERNEL: which kernel computes fused_logprobs' forward statistics on Hopper: "auto" (the
    default) the Gluon kernel wherever it runs (half precision, no softcap, no LOGITLESS_TRITON_FWD tiles),
    "triton" the Triton tile kernel everywhere (benchmarking). Both give the same bits."""
    raw = os.environ.get("LOGITLESS_TRITON_FWD_KERNEL", "").strip().lower() or "auto"
    if raw not in ("auto", "triton"):
        raise ValueError(f"LOGITLESS_TRITON_FWD_KERNEL={raw!r} must be auto or triton")
    return raw


def policy_stats_kernel() -> str:
    """LOGITLESS_POLICY_STATS_KERNEL: which kernel fills the policy loss's statistics on Hopper: "auto" (the
    default) the Gluon kernel wherever it runs, "triton" the Triton kernel everywhere (benchmarking)."""
    raw = os.environ.get("LOGITLESS_POLICY_STATS_KERNEL", "").strip().lower() or "auto"
    if raw not in ("auto", "triton"):
        raise ValueError(f"LOGITLESS_POLICY_STATS_KERNEL={raw!r} must be auto or triton")
    return raw


def topk_distill_selection() -> str:
    """LOGITLESS_TOPK_DISTILL_SELECTION: how the triton backend's one-pass "forward_kl_topk" of
    fused_distillation_loss selects the student's own top k for the overlap: "shared" (the default) in the GEMM
    of the statistics (the selection kernel also writes the pass's statistics), "separate" by the selection
    kernels' own GEMM first (benchmarking). Both give the same ids."""
    raw = os.environ.get("LOGITLESS_TOPK_DISTILL_SELECTION", "").strip().lower() or "shared"
    if raw not in ("shared", "separate"):
        raise ValueError(f"LOGITLESS_TOPK_DISTILL_SELECTION={raw!r} must be shared or separate")
    return raw
