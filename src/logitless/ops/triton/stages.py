"""The triton kernels' stages, one call each, for benchmarks and profiles (``benchmarks/*.py``).

The kernel modules' helpers (``chunk_stats``, ``combine_tiles``, ``row_stride``, launch constants) change
with the kernels; this module is the surface that stays: when a stage changes, its wrapper here changes
with it, and the benchmark scripts keep working. Nothing in the library calls this module.

Fused policy loss, per chunk of ``c`` token rows (see ``policy_backend``):

    plan = policy_plan(n, vocab, dtype, device)          # rows per chunk, tile width, workspace stride
    bufs = policy_buffers(c, vocab, dtype, device)       # statistics + the [c, V] workspace
    policy_stats(hidden[:c], weight, labels[:c], inv_temp[:c], bufs)   # stage 1: GEMM + statistics + e
    lse, ent = combine(bufs)                             # stage 2: float32 lse and entropy per token
    policy_dlogits(bufs, lse, ent, g_lp, g_ent, inv_temp[:c], labels[:c])   # stage 3: e -> dlogits
    # stage 4 is cuBLAS: bufs.dlogits @ weight, bufs.dlogits.T @ hidden[:c]

fused_logprobs' triton backend: ``logprob_stats`` (forward), ``logprob_grads`` (backward),
``logprob_dlogits_chunk`` / ``logprob_chunk_columns`` (one vocabulary chunk of the backward).

Shapes and dtypes: hidden [c, H] and weight [V, H] in one dtype (bf16 / fp16 / fp32) on a CUDA device (or the
CPU under ``TRITON_INTERPRET=1``); labels int64 [c] with -1 for "no label"; inv_temp float32 [c] (1 /
temperature); every statistic float32.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import triton
from torch import Tensor

from . import backward, forward_stats, policy_backend, policy_terms, topk_select
from . import combine as _combine
from . import policy_dlogits as _dlogits
from . import policy_stats as _stats
from .common import Tiles, choose_tiles

# the Gluon statistics kernel's module, None where it does not import (or under the interpreter)
policy_stats_gluon = _stats.gluon_stats


@dataclass(frozen=True)
class PolicyPlan:
    """How the policy pass cuts ``n`` tokens: ``rows`` per chunk, ``chunks`` of them, statistics tiles of
    ``tile_cols`` vocabulary columns (``n_tiles`` of them), workspace rows ``stride`` elements apart."""
    rows: int
    chunks: int
    tile_cols: int
    n_tiles: int
    stride: int
    tiles: Tiles

    def workspace_bytes(self, dtype: torch.dtype) -> int:
        return self.rows * self.stride * policy_backend.workspace_dtype(dtype).itemsize

    def stats_bytes(self) -> int:
        return (3 * self.n_tiles + 1) * self.rows * 4


def policy_plan(n: int, vocab: int, dtype: torch.dtype, device, with_grad: bool = True) -> PolicyPlan:
    """The chunk plan the pass uses for ``n`` tokens over ``vocab`` rows (knobs read now:
    LOGITLESS_POLICY_WORKSPACE_BYTES, LOGITLESS_TRITON_POLICY)."""
    tiles = choose_tiles("POLICY", dtype, torch.device(device))
    rows = policy_backend.chunk_rows(n, vocab, dtype, tiles.block_m, tiles.block_n, with_grad)
    return PolicyPlan(rows=rows, chunks=-(-n // rows), tile_cols=tiles.block_n,
                      n_tiles=triton.cdiv(vocab, tiles.block_n), stride=policy_backend.row_stride(vocab), tiles=tiles)


@dataclass
class PolicyBuffers:
    """One chunk's buffers: tile_max / tile_sum / tile_ent float32 [n_tiles, c] (per statistics tile: the
    maximum, sum of exp and sum of exp * (z - max) of the tempered logits), label_logit float32 [c], and the
    workspace: ``e`` [c, V] (float16 for half inputs, float32 for float32) and ``dlogits`` [c, V] in the
    inputs' dtype, the same memory (stage 3 overwrites e); both None without a workspace."""
    tile_max: Tensor
    tile_sum: Tensor
    tile_ent: Tensor
    label_logit: Tensor
    e: Optional[Tensor]
    dlogits: Optional[Tensor]
    tile_cols: int


def policy_buffers(rows: int, vocab: int, dtype: torch.dtype, device, workspace: bool = True,
                   fill: float | None = None) -> PolicyBuffers:
    """Buffers for a chunk of ``rows`` tokens, for the statistics tiles in force now (LOGITLESS_TRITON_POLICY).
    ``fill``: a value written everywhere first (NaN shows what a kernel left unwritten); None leaves them
    uninitialised."""
    device = torch.device(device)
    tile_cols = choose_tiles("POLICY", dtype, device).block_n
    n_tiles = triton.cdiv(vocab, tile_cols)
    make = torch.empty if fill is None else (lambda *s, **k: torch.full(s, fill, **k))
    parts = [make(n_tiles, rows, dtype=torch.float32, device=device) for _ in range(3)]
    label_logit = make(rows, dtype=torch.float32, device=device)
    e = dl = None
    if workspace:
        stride = policy_backend.row_stride(vocab)
        ws = make(rows * stride, dtype=policy_backend.workspace_dtype(dtype), device=device)
        e = ws.view(rows, stride)[:, :vocab]
        dl = (ws if ws.dtype == dtype else ws.view(dtype)).view(rows, stride)[:, :vocab]
    return PolicyBuffers(*parts, label_logit, e, dl, tile_cols)


def policy_stats(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, bufs: PolicyBuffers,
                 store_e: bool = True) -> None:
    """Stage 1: the statistics GEMM (the Gluon kernel on Hopper unless LOGITLESS_POLICY_STATS_KERNEL=triton).
    Fills ``bufs``' statistics and, with ``store_e``, e = exp(z - tile max)."""
    _stats.chunk_stats(hidden, weight, labels, inv_temp, bufs.tile_max, bufs.tile_sum, bufs.tile_ent,
                             bufs.label_logit, bufs.e if store_e else None)


def gluon_usable(hidden: Tensor, weight: Tensor, bufs: PolicyBuffers) -> bool:
    """Whether the Gluon statistics kernel can run on these operands (Hopper, triton 3.6, half dtypes, TMA-aligned)."""
    return policy_stats_gluon is not None and policy_stats_gluon.usable(hidden, weight, bufs.e, bufs.tile_cols)


def policy_stats_gluon_call(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, bufs: PolicyBuffers):
    """Stage 1 through the Gluon kernel whatever the knobs say (``gluon_usable`` first); returns the compiled
    kernel (``n_regs``, ``n_spills``)."""
    if policy_stats_gluon is None:
        raise RuntimeError("this triton has no Gluon")
    return policy_stats_gluon.chunk_stats_gluon(hidden, weight, labels, inv_temp, bufs.tile_max, bufs.tile_sum,
                                                bufs.tile_ent, bufs.label_logit, bufs.e, bufs.tile_cols)


def combine(bufs: PolicyBuffers) -> tuple[Tensor, Tensor]:
    """Stage 2: lse and entropy float32 [c] of the tempered logits from the tile statistics (one kernel)."""
    return _combine.combine_tiles(bufs.tile_max, bufs.tile_sum, bufs.tile_ent)


def policy_dlogits(bufs: PolicyBuffers, lse: Tensor, ent: Tensor, g_lp: Tensor, g_ent: Optional[Tensor],
                   inv_temp: Tensor, labels: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Stage 3: d loss / d logits [c, V] from e and the per-token gradients g_lp, g_ent (float32 [c]; g_ent
    None: no entropy term), written into ``out`` (default: ``bufs.dlogits``, over e). Returns it."""
    out = bufs.dlogits if out is None else out
    return _dlogits.dlogits_in_place(bufs.e, out, bufs.tile_max, lse, ent, g_lp, g_ent, inv_temp, labels,
                                           bufs.tile_cols)


# launch constants a benchmark may vary, by stage: name -> (module, attribute)
_LAUNCH = {
    "dlogits": (_dlogits, ("ROWS_PER_PROGRAM", "TILES_PER_PROGRAM", "WARPS", "FAST_LOG2")),
    # STAGES: the operand ring of the policy pass (which also stores e); FWD_STAGES: fused_logprobs' forward's
    "gluon_stats": (policy_stats_gluon, ("STAGES", "FWD_STAGES", "GROUP_M", "BLOCK_K")),
}


def launch_settings(stage: str) -> dict:
    """The launch constants of ``stage`` ("dlogits", "gluon_stats") now in force."""
    module, names = _LAUNCH[stage]
    return {} if module is None else {k: getattr(module, k) for k in names}


@contextlib.contextmanager
def launch(stage: str, **values) -> Iterator[None]:
    """Launch constants of ``stage`` changed for the block and restored after, e.g.
    ``with launch("dlogits", ROWS_PER_PROGRAM=8): ...``. Unknown names raise ValueError."""
    module, names = _LAUNCH[stage]
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"launch({stage!r}): unknown constants {sorted(unknown)}; known: {list(names)}")
    if module is None and values:
        raise RuntimeError(f"launch({stage!r}): this triton has no Gluon")
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


# The policy pass's stage calls as ``policy_backend`` makes them.
POLICY_STAGES = ("chunk_stats", "combine_tiles", "dlogits_in_place", "product_into", "accumulate_product")


@contextlib.contextmanager
def instrument_policy_pass(stage: Callable[[str, Callable], Callable], host: Callable[[str, Callable], Callable],
                           host_steps: tuple = ()) -> Iterator[None]:
    """For the block, every stage call of the policy pass (``POLICY_STAGES``) goes through ``stage(name, fn)``'s
    result, and the pass itself (``policy_pass``) and each ``(module, function)`` of ``host_steps`` (the
    caller's own preparation, named by the benchmark) through ``host(name, fn)``'s: where the time of an
    unprofiled step goes (CUDA events, host clocks). Restored after."""
    saved = []
    targets = [(policy_backend, name, stage) for name in POLICY_STAGES] + [(policy_backend, "policy_pass", host)]
    targets += [(importlib.import_module(module), name, host) for module, name in host_steps]
    try:
        for module, name, wrap in targets:
            fn = getattr(module, name)
            saved.append((module, name, fn))
            setattr(module, name, wrap(name, fn))
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


def term_settings(spec, device) -> policy_terms.TermSettings:
    """The per-token terms' settings on the device, once per loss call (``spec``: ``PolicyLoss.term_spec()``)."""
    return policy_terms.TermSettings.make(spec, device)


def policy_terms_kernel(lp: Tensor, ent: Tensor, tokens, settings: policy_terms.TermSettings, sums: Tensor
                        ) -> tuple[Tensor, Optional[Tensor]]:
    """The per-token terms and their gradients in one kernel: (g_lp, g_ent or None) float32 [n]; adds
    (sum w f, clipped count, sum w kl) into ``sums`` (float64 [3])."""
    return policy_terms.chunk_terms(lp, ent, tokens, settings, sums)


def logprob_stats(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, with_entropy: bool = True):
    """fused_logprobs' triton forward on one call's tokens: (lse, entropy or None, label logit), float32 [n]."""
    return forward_stats.stats(hidden, weight, labels, inv_temp, with_entropy)


def logprob_grads(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, lse: Tensor,
                  ent: Optional[Tensor], g_lp: Tensor, g_ent: Optional[Tensor], need_hidden: bool = True,
                  need_weight: bool = True):
    """fused_logprobs' triton backward: (d_hidden, d_weight), each None when not needed."""
    return backward.grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_hidden, need_weight)


def logprob_chunk_columns(n_tokens: int, vocab: int, block_n: int) -> int:
    """Vocabulary columns per chunk of the backward's dlogits workspace (LOGITLESS_TRITON_DLOGITS_ELEMENTS)."""
    return backward.chunk_columns(n_tokens, vocab, block_n)


def logprob_dlogits_chunk(hidden: Tensor, w_chunk: Tensor, col0: int, labels: Tensor, inv_temp: Tensor, lse: Tensor,
                          ent: Optional[Tensor], g_lp: Tensor, g_ent: Optional[Tensor], out: Tensor) -> Tensor:
    """One vocabulary chunk of the backward: recompute the logits of rows ``col0 ...`` and write their dlogits
    into ``out`` [n, chunk] (the inputs' dtype)."""
    return backward.dlogits_chunk(hidden, w_chunk, col0, labels, inv_temp, lse, ent, g_lp, g_ent, out)


# ---------------------------------------------------------------- the top-k selection (fused_topk's first pass)

TOPK_CANDIDATES = topk_select.CANDIDATES     # candidates a tile keeps by default (LOGITLESS_TOPK_CANDIDATES)


def topk_chunk_rows(vocab: int, k: int, dtype: torch.dtype, device) -> int:
    """Tokens of one chunk of the selection (its candidates fit LOGITLESS_TOPK_BYTES)."""
    return topk_select.chunk_rows(vocab, k, dtype, device)


def topk_first_pass(hidden: Tensor, weight: Tensor, k: int):
    """The selection's first pass (the candidates kernel) over every row of ``hidden`` at temperature 1, with the
    tiles and candidates the knobs choose now: (candidate keys, rest keys, rest sums)."""
    tiles = topk_select.tiles_for(hidden.dtype, hidden.device)
    c = topk_select.first_candidates(k, weight.shape[0], tiles)
    inv_temp = torch.ones(hidden.shape[0], device=hidden.device)
    return topk_select._first_pass(hidden, weight, inv_temp, c, None, tiles)


@contextlib.contextmanager
def topk_rows_redone() -> Iterator[list]:
    """Within the block, the rows each selection had to redo (its first pass could not hold them), one entry per
    selection call, in a list the block reads."""
    counts: list = []
    select = topk_select.select

    def counting(*a, **kw):
        out = select(*a, **kw)
        counts.append(out.fallback)
        return out
    topk_select.select = counting
    try:
        yield counts
    finally:
        topk_select.select = select
