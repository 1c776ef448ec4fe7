"""The label's log-prob under a truncated, renormalised distribution (top-k / top-p / min-p, or kept ids replayed),
forward and backward, without the [tokens x vocab] logits.

    settings form: select  (no gradient) -- the C most probable ids of each scored token (``fused_topk``, the
                   backend's selection pass), ``truncation_select.decide`` keeps a prefix of them; a token whose
                   kept set may reach past its C candidates is asked again with 16 C, then the whole vocabulary
                   (only those tokens, in row blocks of bounded size)
    replay form:   the kept ids as given
    then:          the kept (token, id) pairs and the (token, label) pairs as one flat list: their logits
                   (``kept_pairs``, differentiable; in the settings form the kept pairs' products come from the
                   selection's log-probs and one product per token, so only the labels outside their sets and the
                   replayed pairs are multiplied, P x H), and per token in float64: lse over the kept set, the
                   label's log-prob z_y - lse, the truncated entropy sum q (lse - z) (terms >= 0)

With the kept set fixed the gradient is that of z_y - lse_K: it touches the kept rows of the weight and the label's
row, nothing else (the backward costs P x H). Tokens whose settings keep the whole vocabulary run the plain op
(``function.fused_logprobs``), so settings that are all off give its numbers bit for bit. Under tensor parallelism
the selection is global (``fused_topk`` merges every rank's candidates), so the decisions and the pair lists are the
same on every rank; each rank multiplies the pairs its shard holds and one all-reduce sums them.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import knobs
from ..record import record_backend
from . import function, label_set_function, truncation_dense, truncation_wide
from .kept_pairs import pair_logits, pair_products
from .truncation_select import RowSettings, decide

# selection workspace: candidate rows x candidates per block (ids int64 + log-probs float32)
SELECT_ELEMENTS = 1 << 24
GROWTH = 16


class Kept(NamedTuple):
    """The kept sets as flat pairs: rows [P] int64 (token), ids [P] int64 (global id); kept_logprob [N] float32
    (log kept mass under the full softmax). From the selection (None in the replay form): logprobs [P] float32,
    each pair's log-prob under the full softmax as the selection pass formed it, and top_ids / top_logprobs [N]
    (each token's most probable id, always kept, and its log-prob): one product per token, raw(top), then gives
    every kept pair's raw product, raw(top) + (logprob - top_logprob) * temperature, without multiplying it."""
    rows: Tensor
    ids: Tensor
    kept_logprob: Optional[Tensor]
    logprobs: Optional[Tensor] = None
    top_ids: Optional[Tensor] = None
    top_logprobs: Optional[Tensor] = None
    # [N]: each token's kept-set boundary in tempered-logit units and whether it is clear
    # (``truncation_dense.boundary``)
    member: Optional[Tensor] = None
    clear: Optional[Tensor] = None
    # tokens decided without their ids (``truncation_wide.Direct``), no pairs of their own
    direct: Optional["DirectSets"] = None


class DirectSets(NamedTuple):
    """Per token [N]: mask bool (the tokens decided without their ids), count int64 (the kept set's size), inside
    bool (the label kept), lse float64 (the kept set's logsumexp, tempered-logit units), entropy float64."""
    mask: Tensor
    count: Tensor
    inside: Tensor
    lse: Tensor
    entropy: Tensor


def _first_candidates(s: RowSettings, rows: Tensor, vocab: int) -> Tensor:
    """[r] int64: each token's candidates in its first selection round: LOGITLESS_TRUNCATION_CANDIDATES, or one past
    its own top_k (a tie at the k-th value shows), at most V. Per token, never the batch's widest: the selection's
    lse, hence the token's log-probs, follow the candidates asked (batch invariance)."""
    k = s.top_k.index_select(0, rows)
    own = torch.where((k > 0) & (k < vocab), k + 1, torch.zeros_like(k))
    return own.clamp(min=knobs.truncation_candidates()).clamp(max=vocab)


class _Collected:
    """The decided tokens' kept pairs, gathered round by round."""

    def __init__(self, n: int, device):
        self.kept_lp = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_lp = torch.zeros(n, dtype=torch.float32, device=device)
        self.member = torch.zeros(n, dtype=torch.float32, device=device)
        self.clear = torch.zeros(n, dtype=torch.bool, device=device)
        self.rows, self.ids, self.lp = [], [], []
        self.direct = None

    def add(self, tokens: Tensor, ids: Tensor, lp: Tensor, keep: Tensor, lse: Tensor) -> None:
        """tokens [m] decided, their candidates ids / lp [m, L] (descending), kept ones keep [m, L] (a prefix),
        lse [m] (lp = z - lse)."""
        self.member[tokens], self.clear[tokens] = truncation_dense.boundary(lp, keep, lse)
        lp_kept = lp.masked_fill(~keep, float("-inf"))
        self.kept_lp[tokens] = torch.logsumexp(lp_kept.double(), dim=1).float().clamp(max=0.0)
        r, col = keep.nonzero(as_tuple=True)
        self.rows.append(tokens[r])
        self.ids.append(ids[r, col])
        self.lp.append(lp[r, col])
        self.top_ids[tokens] = ids[:, 0]
        self.top_lp[tokens] = lp[:, 0]

    def add_direct(self, tokens: Tensor, d: truncation_wide.Direct, lse: Tensor) -> None:
        """tokens [m] decided without their ids (``d``'s rows), lse [m] their full softmax's."""
        if self.direct is None:
            n, dev = self.kept_lp.shape[0], self.kept_lp.device
            self.direct = DirectSets(torch.zeros(n, dtype=torch.bool, device=dev),
                                     torch.zeros(n, dtype=torch.int64, device=dev),
                                     torch.zeros(n, dtype=torch.bool, device=dev),
                                     torch.zeros(n, dtype=torch.float64, device=dev),
                                     torch.zeros(n, dtype=torch.float64, device=dev))
        self.direct.mask[tokens] = True
        self.direct.count[tokens] = d.kept
        self.direct.inside[tokens] = d.inside
        self.direct.lse[tokens] = lse.double() + d.log_mass
        self.direct.entropy[tokens] = d.entropy
        self.member[tokens], self.clear[tokens] = d.member, True
        self.kept_lp[tokens] = d.log_mass.float().clamp(max=0.0)

    def kept(self) -> Kept:
        empty = torch.zeros(0, dtype=torch.int64, device=self.kept_lp.device)
        return Kept(_cat(self.rows, empty), _cat(self.ids, empty), self.kept_lp, _cat(self.lp, empty.float()),
                    self.top_ids, self.top_lp, self.member, self.clear, self.direct)


def select(hidden: Tensor, weight: Tensor, inv_temp: Tensor, rows: Tensor, s: RowSettings, vocab: int,
           options: function.OpOptions, labels: Tensor) -> Kept:
    """The kept pairs of the tokens ``rows`` [r] under the settings s (per token, [N]; labels [N]), from the backend's
    selection pass; no gradient. On the triton backend a token left undecided by its first candidates goes to
    ``truncation_wide`` (every logit above a bound its set cannot reach below) before more candidates."""
    out = _Collected(hidden.shape[0], hidden.device)
    wide_ok = truncation_wide.usable(options, hidden)
    # read (and checked) before any pass
    by_kernel = wide_ok and knobs.truncation_nucleus() == "kernel"
    # the tokens of each round by (candidates, first round): each token's rounds follow from its own settings
    first = _first_candidates(s, rows, vocab) if rows.numel() else rows
    groups = {(c, True): [rows[first == c]] for c in first.unique().tolist()}
    with torch.no_grad():
        while groups:
            c, is_first = key = min(groups)
            pending = torch.cat(groups.pop(key))
            wide = wide_ok and is_first     # one wide round, after a token's first candidates
            undecided = []
            step = max(1, SELECT_ELEMENTS // c)
            for start in range(0, pending.numel(), step):
                block = pending[start:start + step]
                h = hidden.index_select(0, block)
                t = inv_temp.index_select(0, block)
                ones = torch.ones(block.numel(), dtype=torch.bool, device=hidden.device)
                ids, lp, tail, lse = label_set_function.fused_topk(
                    h, weight, t, ones, c, options.backend, options.softcap, options.tp_group, True,
                    options.precision, options.grad_precision, True, with_lse=True)
                d = decide(lp, tail, vocab, s.rows(block))
                done = d.decided.nonzero().squeeze(1)
                out.add(block[done], ids.index_select(0, done), lp.index_select(0, done),
                        d.keep.index_select(0, done), lse.index_select(0, done))
                open_ = (~d.decided).nonzero().squeeze(1)
                if wide and open_.numel():
                    blk = block.index_select(0, open_)
                    decided, direct, left = truncation_wide.wide_round(
                        h.index_select(0, open_), weight, t.index_select(0, open_), lp.index_select(0, open_),
                        lse.index_select(0, open_), s.rows(blk), vocab, options.softcap, labels.index_select(0, blk),
                        by_kernel)
                    for part in decided:
                        out.add(block[open_[part.pos]], part.ids, part.lp, part.keep,
                                lse.index_select(0, open_[part.pos]))
                    for part in direct:
                        out.add_direct(block[open_[part.pos]], part, lse.index_select(0, open_[part.pos]))
                    open_ = open_.index_select(0, left)
                undecided.append(block.index_select(0, open_))
            undecided = torch.cat(undecided)
            if undecided.numel():
                if c >= vocab:
                    raise AssertionError("every token is decided once the whole vocabulary is seen")
                groups.setdefault((min(vocab, c * GROWTH), False), []).append(undecided)
    return out.kept()


def _cat(parts, empty: Tensor) -> Tensor:
    return torch.cat(parts) if parts else empty


def replayed(kept_ids: Tensor, valid: Tensor) -> Kept:
    """The pairs of kept_ids [N, K] (-1 pads) on the scored tokens."""
    r, col = ((kept_ids >= 0) & valid.unsqueeze(1)).nonzero(as_tuple=True)
    return Kept(r, kept_ids[r, col], None)


class Truncated(NamedTuple):
    logprobs: Tensor
    entropy: Optional[Tensor]
    inside: Tensor
    kept_count: Tensor


def _local(ids: Tensor, tp) -> Tensor:
    """Global ids as rows of this rank's shard, -1 for another rank's."""
    if tp is None:
        return ids
    local = ids - tp.vocab_offset
    return torch.where((local >= 0) & (local < tp.sizes[tp.rank]), local, torch.full_like(local, -1))


def _known_products(hidden: Tensor, weight: Tensor, inv_temp: Tensor, kept: Kept, scored: Tensor,
                    at_label: Tensor, inside: Tensor, options: function.OpOptions, tp):
    """(known [P + s], given [P + s]) for ``pair_logits``: the kept pairs' raw products from the selection's
    log-probs, and the label's where it is kept (so a label alone in its set gets log-prob 0 exactly); the labels
    outside their sets are multiplied (at_label [P]: the kept pairs at their token's label; inside [N]: the tokens
    whose label is kept). (None, None) in the replay form and under a softcap (whose inverse, an
    atanh near saturation, would not give the products back to float32 rounding)."""
    if kept.logprobs is None or options.softcap is not None:
        return None, None
    n = hidden.shape[0]
    with torch.no_grad():
        top = pair_products(hidden, weight, scored, _local(kept.top_ids.index_select(0, scored), tp))
        if tp is not None:
            dist.all_reduce(top, group=tp.group)
        anchor = torch.zeros(n, dtype=torch.float32, device=hidden.device).index_put((scored,), top)
        rows = kept.rows
        # z - z_top = logprob - top_logprob, and raw = z * temperature
        raw = anchor.index_select(0, rows) + (kept.logprobs - kept.top_logprobs.index_select(0, rows)) \
            / inv_temp.index_select(0, rows)
        label_raw = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        label_raw[rows[at_label]] = raw[at_label]
        known = torch.cat([raw, label_raw.index_select(0, scored)])
        given = torch.cat([torch.ones_like(at_label), inside.index_select(0, scored)])
    return known, given


def kept_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, kept: Kept, scored: Tensor,
                  options: function.OpOptions, tp) -> Truncated:
    """Per token [N]: z_y - lse over its kept ids (``scored`` [s] tokens; 0 elsewhere), the truncated entropy,
    whether the label is kept, the kept count. Differentiable w.r.t. hidden and weight."""
    n = hidden.shape[0]
    dev = hidden.device
    p = kept.rows.numel()
    pair_rows = torch.cat([kept.rows, scored])
    pair_ids = torch.cat([kept.ids, labels.index_select(0, scored)])
    at_label = kept.ids == labels.index_select(0, kept.rows)
    inside = torch.zeros(n, dtype=torch.bool, device=dev)
    inside[kept.rows[at_label]] = True
    pair_count = torch.bincount(kept.rows, minlength=n)
    group = tp.group if tp is not None else None
    # (the labels of tokens decided without their ids are multiplied: no pair of theirs is known)
    known, given = _known_products(hidden, weight, inv_temp, kept, scored, at_label, inside, options, tp)
    direct = kept.direct
    count = pair_count if direct is None else torch.where(direct.mask, direct.count, pair_count)
    if direct is not None:
        inside = inside | (direct.mask & direct.inside)
    dense = _dense_tokens(hidden, kept, options, count, weight.shape[0])

    def logits(idx: Optional[Tensor]) -> Tensor:
        pick = (lambda t: t) if idx is None else (lambda t: None if t is None else t.index_select(0, idx))  # noqa: E731
        return pair_logits(hidden, weight, pick(pair_rows), _local(pick(pair_ids), tp), inv_temp, options.softcap,
                           group, options.reduce_grad_hidden, pick(known), pick(given)).double()
    if dense is None:
        z = logits(None)
    else:
        # the dense tokens' pairs give values only: their gradient is ``truncation_dense``'s
        on = dense.index_select(0, pair_rows)
        sparse_at, dense_at = (~on).nonzero().squeeze(1), on.nonzero().squeeze(1)
        with torch.no_grad():
            z_dense = logits(dense_at)
        z = torch.zeros(pair_rows.shape, dtype=torch.float64, device=dev).index_put(
            (sparse_at,), logits(sparse_at)).index_put((dense_at,), z_dense)
    zk, zy = z[:p], z[p:]
    rows = kept.rows
    m = torch.full((n,), float("-inf"), dtype=torch.float64, device=dev)
    m = m.scatter_reduce(0, rows, zk.detach(), reduce="amax")
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(zk - m.index_select(0, rows))
    total = _token_sums(e, rows, n)
    has = pair_count > 0
    lse = m + torch.log(torch.where(has, total, torch.ones_like(total)))
    if direct is not None:
        lse = torch.where(direct.mask, direct.lse, lse)
    lp = torch.zeros(n, dtype=torch.float64, device=dev).index_put((scored,), zy - lse.index_select(0, scored))
    ent = None
    if options.with_entropy:
        lse_k = lse.index_select(0, rows)
        terms = torch.exp(zk - lse_k) * (lse_k - zk)
        ent = _token_sums(terms, rows, n)
        if direct is not None:
            ent = torch.where(direct.mask, direct.entropy, ent)
        ent = ent.float()
    lp = lp.float()
    if dense is not None:
        d = dense.nonzero().squeeze(1)
        ent_d = ent.index_select(0, d) if ent is not None else torch.zeros(d.shape, device=dev)
        lp_d, ent_out = truncation_dense.DenseBackward.apply(
            hidden, weight, lp.index_select(0, d), ent_d, d, labels.index_select(0, d), inv_temp.index_select(0, d),
            lse.index_select(0, d).float(), ent_d.detach(), kept.member.index_select(0, d), options.softcap)
        lp = lp.index_put((d,), lp_d)
        ent = None if ent is None else ent.index_put((d,), ent_out)
    return Truncated(lp, ent, inside, count)


def _token_sums(values: Tensor, rows: Tensor, n: int) -> Tensor:
    """[n] float64: the sum of values [P] over each token's pairs, rows [P] (a token's pairs contiguous, as the
    selection and the replay lay them out), in a fixed order: a segmented reduction per token (CUB's on CUDA), not
    index_add's atomics, whose order changes run to run (a token's bits would follow)."""
    out = torch.zeros(n, dtype=torch.float64, device=values.device)
    if rows.numel() == 0:
        return out
    tokens, lengths = torch.unique_consecutive(rows, return_counts=True)
    # (accumulated: one add an address where each token's pairs are contiguous, and still the sum where not)
    return out.index_put((tokens,), torch.segment_reduce(values, "sum", lengths=lengths), accumulate=True)


def _dense_tokens(hidden: Tensor, kept: Kept, options: function.OpOptions, count: Tensor,
                  vocab: int) -> Optional[Tensor]:
    """[N] bool: the tokens whose backward is ``truncation_dense``'s (kept sets of at least ``min_ids`` ids, count
    [N], whose boundary is clear, where the wide round runs), None for none."""
    if kept.member is None or not truncation_wide.usable(options, hidden):
        return None
    dense = kept.clear & (count >= truncation_dense.min_ids(vocab))
    if kept.direct is not None:       # (decided without their ids: only this backward has them)
        dense = dense | kept.direct.mask
    return dense if bool(dense.any()) else None


class Outputs(NamedTuple):
    logprobs: Tensor
    entropy: Optional[Tensor]
    inside: Tensor
    kept_count: Tensor
    kept_logprob: Optional[Tensor]


def truncated_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor,
                       options: function.OpOptions, settings: Optional[RowSettings] = None,
                       kept_ids: Optional[Tensor] = None) -> Outputs:
    """hidden [N, H], weight [V_local, H], labels [N] int64, inv_temp [N] float32; ``settings`` (per token) or
    ``kept_ids`` [N, K] (checked by the caller). The labels, temperatures and hidden states are checked here, before
    any product, as the plain op checks them."""
    tp = function._layout(options.tp_group, weight, options.reduce_grad_hidden)
    vocab = tp.vocab_size if tp is not None else weight.shape[0]
    valid = labels != options.ignore_index
    function._validate(labels, valid, inv_temp, vocab, options.ignore_index, hidden)
    if kept_ids is not None:
        off = torch.zeros_like(valid)
        kept = replayed(kept_ids, valid)
        scored = valid.nonzero().squeeze(1)
        # no vocabulary pass: the pairs' torch products are all that runs (IEEE float32 on float32 operands)
        products = "ieee" if hidden.dtype == torch.float32 else "native"
        record_backend(label_set_function._pass_name(options.backend), (products, products))
    else:
        off = settings.off(vocab) & valid
        scored = (valid & ~off).nonzero().squeeze(1)
        if scored.numel() == 0:       # nothing truncated: the plain op, bit for bit
            lp, ent = function.fused_logprobs(hidden, weight, labels, inv_temp, options)
            count = torch.where(valid, vocab, 0)
            return Outputs(lp, ent, valid.clone(), count, torch.zeros_like(lp))
        kept = select(hidden, weight, inv_temp, scored, settings, vocab, options, labels)
    t = kept_logprobs(hidden, weight, labels, inv_temp, kept, scored, options, tp)
    lp, ent, inside, count = t
    if bool(off.any()):
        plain_lp, plain_ent = function.fused_logprobs(
            hidden, weight, torch.where(off, labels, options.ignore_index), inv_temp, options)
        lp = torch.where(off, plain_lp, lp)
        ent = None if ent is None else torch.where(off, plain_ent, ent)
        inside = inside | off
        count = torch.where(off, vocab, count)
    return Outputs(lp, ent, inside, count, kept.kept_logprob)
