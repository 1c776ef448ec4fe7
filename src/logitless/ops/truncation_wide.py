"""Kept sets wider than a token's candidates (a top-p nucleus of thousands of ids on a flat distribution, a low
min-p): every logit above a per-token bound, from one more GEMM over the vocabulary (the triton backend's
``above_select`` kernel), sorted and decided as the candidates are (``truncation_select.decide``).

The bound is one the kept set cannot reach below, from what the first selection pass gave (the candidates'
log-probs and lse):
  - min_p on: log(min_p) + the largest log-prob (every survivor lies at or above it, and the set is closed),
    half a nat lower (the first id left out is then seen: ``truncation_dense.boundary``);
  - top_p alone: log(1 - top_p) - log(V): each id below it has p < (1 - top_p) / V, so all of them together hold
    less than 1 - top_p, and the nucleus (mass before an id < top_p) ends above it.
minus a margin of float32 rounding (an id just below is emitted too; the decision drops it). top_k on: not here
(its candidates hold k + 1). A token whose ids above its bound exceed MAX_SLOTS, or whose decision still reaches
past them, is left to the caller (more candidates, up to the whole vocabulary).

Only for the triton backend on half-precision operands ("native" products) without tensor parallelism: the
emitting kernel forms the logits exactly as the selection kernel does (the same tiles, the same bits).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import truncation_dense
from .function import OpOptions
from .truncation_select import RowSettings, decide

# slots a token first: the top_p-alone bound keeps about 16000 ids a token at V = 151936 on logits of std 4
# (top_p 0.95, nuclei of ~2000), so fewer would send most such tokens through a second pass
FIRST_SLOTS = 16384
MAX_SLOTS = 1 << 15
# token rows x slots of one emitting pass: values and ids (8 bytes), then keys, sorted keys and their order
# (24 bytes): about 512 MiB at once
BLOCK_ELEMENTS = 1 << 24
MIN_P_BELOW = 0.5
# a top_p-alone token's emitted ids are narrowed to the histogram bins that hold its nucleus, plus the next
# one holding an id
PRUNE_BINS = 64


def usable(options: OpOptions, hidden: Tensor) -> bool:
    return (options.backend == "triton" and options.tp_group is None and options.precision == "native"
            and hidden.dtype in (torch.bfloat16, torch.float16))


def bounds(lp: Tensor, lse: Tensor, s: RowSettings, vocab: int) -> tuple[Tensor, Tensor]:
    """(tau float32 [r] in tempered-logit units, which [r] bool: the tokens this pass takes) from the first pass's
    log-probs lp [r, C] (descending) and lse [r]."""
    lp0 = lp[:, 0].double()
    minp = s.min_p > 0.0
    topk = (s.top_k > 0) & (s.top_k < vocab)
    topp = s.top_p < 1.0
    # min_p: half a nat further down, so that the first id left out is seen too (the dense backward's boundary)
    tau_lp = torch.where(minp, lp0 + torch.log(s.min_p.clamp(min=1e-300)) - MIN_P_BELOW,
                         torch.log1p(-s.top_p.clamp(max=1.0 - 1e-16)) - math.log(vocab))
    lse64 = lse.double()
    margin = 2.0 ** -12 * (1.0 + lse64.abs())
    which = ~topk & (minp | topp)
    tau = torch.where(which, tau_lp + lse64 - margin, torch.full_like(lse64, float("inf")))
    return tau.float(), which


def _keys(values: Tensor, ids: Tensor, filled: Tensor) -> Tensor:
    """int64 keys (value descending, then id ascending: ``topk_select``'s), NO_KEY (below every real one) where
    not ``filled``."""
    from .triton.topk_select import NO_KEY, encode
    return torch.where(filled, encode(values, ids), NO_KEY)


def _decode(keys: Tensor) -> tuple[Tensor, Tensor]:
    """(values float32, ids int64) of keys: -inf and 0 for NO_KEY."""
    from .triton.topk_select import NO_KEY, decode
    values, ids = decode(keys)
    empty = keys == NO_KEY
    return values.masked_fill(empty, float("-inf")), ids.masked_fill(empty, 0)


class Wide(NamedTuple):
    """Decided tokens: pos [m] (positions in the caller's block), ids [m, L] int64 and lp [m, L] float32 (sorted
    descending, -inf padding), keep [m, L] bool (the kept set)."""
    pos: Tensor
    ids: Tensor
    lp: Tensor
    keep: Tensor


def _nucleus_prefix(values: Tensor, filled: Tensor, lse: Tensor, s: RowSettings, tau: Tensor,
                    bins: int = PRUNE_BINS) -> tuple[Tensor, Tensor]:
    """(filled [r, w], pruned [r]): the emitted ids of top_p-alone tokens narrowed, before they are sorted, to those
    above a value that already holds more than top_p of the mass (every id the nucleus keeps, and the ids just
    past its cut, lie above it: whatever follows it comes after a mass >= top_p), from a histogram of the emitted
    mass over ``bins`` bins between tau and the token's largest logit, plus the next bin holding an id. Other
    tokens (min_p on: their survivors are renormalised) keep every emitted id."""
    prune = (s.top_p < 1.0) & (s.min_p <= 0.0)          # (no top_k token reaches the wide round)
    if not bool(prune.any()):
        return filled, prune
    v = values.masked_fill(~filled, float("-inf"))
    top = v.amax(dim=1)
    span = (top - tau).clamp(min=1e-30)
    b = ((top.unsqueeze(1) - v) / span.unsqueeze(1) * bins).floor().clamp(0, bins - 1).long()
    mass = torch.exp(v.double() - lse.double().unsqueeze(1))              # 0 where not filled
    hist = torch.zeros(v.shape[0], bins, dtype=torch.float64, device=v.device).scatter_add_(1, b, mass)
    reach = torch.cumsum(hist, dim=1) >= s.top_p.unsqueeze(1) + 1e-6     # the slack above float32 rounding
    first = torch.where(reach.any(dim=1), reach.int().argmax(dim=1), torch.full_like(top, bins, dtype=torch.long))
    # and the next bin that holds an id, however far: its largest id is the first one the nucleus may leave out
    # (``truncation_dense.boundary`` needs it seen); the next bin alone is often empty where the top is sparse
    held = torch.zeros_like(hist).scatter_add_(1, b, filled.double()) > 0
    after = held & (torch.arange(bins, device=v.device).unsqueeze(0) > first.unsqueeze(1))
    last_bin = torch.where(after.any(dim=1), after.int().argmax(dim=1), torch.full_like(first, bins - 1))
    prune = prune & (first < bins)
    return filled & (~prune.unsqueeze(1) | (b <= last_bin.unsqueeze(1))), prune


def _emit(hidden: Tensor, weight: Tensor, inv_temp: Tensor, tau: Tensor, slots: int, softcap):
    """The emitting GEMM pass (``triton.above_select.above``): every tempered logit >= tau, ``slots`` a token."""
    from .triton import above_select
    return above_select.above(hidden, weight, inv_temp, tau, slots, softcap)


class Direct(NamedTuple):
    """Tokens decided without their ids (``triton.nucleus``; each a dense backward's token): pos [m] (positions in
    the caller's block), kept [m] int64 (the kept set's size), log_mass [m] float64 (log of its mass under the
    full softmax), entropy [m] float64 (of the truncated distribution), member [m] float32 (the kept set is
    z >= member: the midpoint between its smallest logit and the first left out), inside [m] bool (the label
    kept)."""
    pos: Tensor
    kept: Tensor
    log_mass: Tensor
    entropy: Tensor
    member: Tensor
    inside: Tensor


def _direct(a, width: int, count: Tensor, fits: Tensor, lse: Tensor, s: RowSettings, vocab: int,
            labels: Tensor) -> tuple[Tensor, Direct]:
    """(which [r] bool, their Direct) of a block's emitted rows: the tokens the nucleus kernel decides with a clear
    boundary (``truncation_dense.boundary``'s rule) and a kept set wide enough for the dense backward."""
    from .triton.nucleus import nucleus
    log_min_p = torch.where(s.min_p > 0.0, torch.log(s.min_p.clamp(min=1e-300)),
                            torch.full_like(s.min_p, float("-inf")))
    nd = nucleus(a.values[:, :width], a.ids[:, :width], count, lse, s.top_p, log_min_p, count >= vocab, labels)
    last, out = nd.last.double(), nd.out.double()
    clear = torch.isfinite(out) & (last - out > truncation_dense.GAP * (1.0 + last.abs()))
    which = fits & nd.decided & clear & (nd.kept >= truncation_dense.min_ids(vocab))
    idx = which.nonzero().squeeze(1)
    member = ((last + out) / 2).float()
    return which, Direct(idx, *(t.index_select(0, idx) for t in (nd.kept, nd.log_mass, nd.entropy, member,
                                                                 nd.inside)))


def _sorted(values: Tensor, ids: Tensor, count: Tensor, fits: Tensor, slots: int, pos: Tensor, lse: Tensor,
            s: RowSettings, tau: Tensor, vocab: int) -> tuple[Wide, Tensor]:
    """(the decided tokens, the undecided positions that fit) of emitted rows (values / ids [r, slots], count [r],
    fits [r]): every emitted id of a row sorted, then cut as the candidates are."""
    # a token's matches fill its first count slots: the widest fitting token's, plus the empty column
    width = min(slots, int(count.masked_fill(~fits, 0).max()) + 1)
    filled = torch.arange(width, device=count.device).unsqueeze(0) < count.unsqueeze(1)
    filled, pruned = _nucleus_prefix(values[:, :width], filled, lse, s, tau)
    # the emitted ids in order, only as many columns as the fullest row holds, plus an empty one
    # (over the rows that fit: the others are asked again, and all their columns are filled)
    keep_cols = min(width, int(filled.sum(dim=1).masked_fill(~fits, 0).max()) + 1)
    keys = torch.topk(_keys(values[:, :width], ids[:, :width], filled), keep_cols, dim=1).values
    values, ids = _decode(keys)
    row_lp = values - lse.unsqueeze(1)
    # the mass below the bound: what the emitted ids leave (only read where no setting closes the set)
    tail = torch.log1p(-torch.exp(torch.logsumexp(row_lp.double(), dim=1)).clamp(max=1.0 - 1e-16))
    # the rows padded with -inf to the widest: only a row that emitted every id has seen the whole
    # vocabulary (the width alone may reach it while a top_p-alone nucleus must count its tail)
    d = decide(row_lp, tail, vocab, s, complete=(count >= vocab) & ~pruned)
    keep = d.keep & torch.isfinite(row_lp)
    ok = d.decided & fits & ~(d.keep & ~torch.isfinite(row_lp)).any(dim=1)
    idx = ok.nonzero().squeeze(1)
    wide = Wide(pos.index_select(0, idx), ids.index_select(0, idx), row_lp.index_select(0, idx),
                keep.index_select(0, idx))
    return wide, pos[fits & ~ok]


def wide_round(hidden: Tensor, weight: Tensor, inv_temp: Tensor, lp: Tensor, lse: Tensor, s: RowSettings,
               vocab: int, softcap, labels: Tensor, by_kernel: bool) -> tuple[list[Wide], list[Direct], Tensor]:
    """For r tokens (hidden [r, H], inv_temp [r], their first pass's lp [r, C] and lse [r], settings s [r], labels
    [r]): (the kept sets decided from their sorted ids, those decided without them, the positions [u] left
    undecided). by_kernel: the nucleus kernel decides what it can (LOGITLESS_TRUNCATION_NUCLEUS), else all sorted."""
    tau, which = bounds(lp, lse, s, vocab)
    left = [(~which).nonzero().squeeze(1)]
    done: list[Wide] = []
    direct: list[Direct] = []
    todo = which.nonzero().squeeze(1)
    slots = min(vocab, FIRST_SLOTS)
    while todo.numel():
        over = []
        step = max(1, BLOCK_ELEMENTS // slots)
        for start in range(0, todo.numel(), step):
            pos = todo[start:start + step]
            a = _emit(hidden.index_select(0, pos), weight, inv_temp.index_select(0, pos), tau.index_select(0, pos),
                      slots, softcap)
            count = a.count.long()
            fits = count < slots          # one slot left empty: the -inf column after the last emitted id
            s_pos = s.rows(pos)
            lse_pos = lse.index_select(0, pos)
            over.append((pos[~fits], count[~fits]))
            tau_pos = tau.index_select(0, pos)
            if not by_kernel:
                wide, undecided = _sorted(a.values, a.ids, count, fits, slots, pos, lse_pos, s_pos, tau_pos, vocab)
                done.append(wide)
                left.append(undecided)
                continue
            width = min(slots, int(count.masked_fill(~fits, 0).max()) + 1)
            taken, d = _direct(a, width, count, fits, lse_pos, s_pos, vocab, labels.index_select(0, pos))
            direct.append(d._replace(pos=pos.index_select(0, d.pos)))
            # the rest that fit (a tie split by the nucleus, a boundary too close, a narrow set) sorted
            sub = (fits & ~taken).nonzero().squeeze(1)
            if sub.numel():
                rows = [t.index_select(0, sub) for t in (a.values, a.ids, count, fits, pos, lse_pos)]
                wide, undecided = _sorted(*rows[:4], slots, *rows[4:], s_pos.rows(sub), tau_pos.index_select(0, sub),
                                          vocab)
                done.append(wide)
                left.append(undecided)
        todo, count = torch.cat([p for p, _ in over]), torch.cat([c for _, c in over])
        # asked again with as many slots as the largest count needs; past MAX_SLOTS left to the caller
        wider = count + 1 > MAX_SLOTS
        left.append(todo[wider])
        todo, count = todo[~wider], count[~wider]
        if todo.numel():
            slots = int(count.max()) + 1
    return done, direct, torch.cat(left)
