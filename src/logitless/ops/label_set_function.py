"""k vocabulary ids per token as ``torch.library`` custom ops (fake kernels for ``torch.compile``), with one
backward for both:

    logitless::fused_logprobs_k(hidden [N, H], weight [V_local, H], labels [N, k] int64, inv_temp [N], **options)
        -> (logprobs [N, k], entropy [N] or [0], tail [N] or [0], lse [N]), float32
    logitless::fused_topk(hidden [N, H], weight [V_local, H], inv_temp [N], mask [N] bool, *, k, **options)
        -> (ids [N, k] int64, logprobs [N, k], tail [N], lse [N])
    logitless::fused_logprobs_k_backward(g_logprobs, g_entropy, g_tail, hidden, weight, labels, inv_temp, lse,
        entropy, logprobs, tail, **options, need_dh, need_dw) -> (d_hidden or [0], d_weight or [0])

The log-probs of given ids (``fused_logprobs_k``): the backend's own statistics pass with no label gives lse and
entropy; the ids' logits are a gathered product (``label_sets.set_logits``). With ``with_tail`` (the mass outside
the ids, for the tail bucket of a divergence) one pass over the vocabulary gives lse, the ids' logits and the tail
instead (no entropy then): the triton backend's kernels (``triton/given_set.py``), a torch pass on the others
(``label_sets.vocab_pass``). The student's own top k beside it (``select``): the selection kernels where they take
it (``triton/topk_select.py``; one GEMM for both, the selection kernel running the given set's epilogue, without
tensor parallelism), else the same torch pass.

The top-k (``fused_topk``): the selection kernels, or the torch pass, select the k largest logits per token (ties
to the lower id), with lse and the tail from positive sums only. Backward of the k ids' log-probs without a tail:
the backend's grads with no label and g_lp = G, plus the one-hot part at the ids (``label_sets``), d_hidden's part
added before the tensor-parallel all-reduce of each token chunk. An op with a tail output (``fused_topk``,
``with_tail``): the closed form of ``tail_backward.py`` (no cancellation at the ids), its dlogits formed in the
triton backend's kernel (``triton/tail_dlogits.py``; the plain backward's products after), in a torch pass on the
other backends.

A row of labels whose k ids all equal ignore_index is ignored (0 out, no gradient, no work); a row with only
some of them is refused, as are ids outside [0, V) and an id repeated within a row (with check_inputs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .. import checks, knobs
from ..record import record_backend
from . import chunked, label_sets, tail_backward, token_chunks
from .function import OpOptions, _layout, _operands
from .maths import no_autocast, split_in_kernel, tf32_products
from .precision import choose, make_operands, public_name
from .registry import load_backend

if TYPE_CHECKING:
    from ..parallel import VocabParallel


def fused_logprobs_k(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, options: OpOptions,
                     with_tail: bool = False, select: int = 0, labels_name: str = "labels"
                     ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(logprobs [N, k], entropy [N] or None, tail [N] or None, top ids [N, select] or None), float32 (ids
    int64), logprobs and tail differentiable w.r.t. hidden and weight, for hidden [N, H], labels [N, k] int64
    (global ids, or ignore_index on all k of an ignored row). ``select`` > 0: also the ids of the ``select``
    largest logits per token (ties to the lower id; -1 on ignored rows), from the same pass, not differentiable.
    ``labels_name``: the argument the checks' messages name."""
    lp, ent, tail, top, _ = torch.ops.logitless.fused_logprobs_k(
        hidden, weight, labels, inv_temp, backend=options.backend, with_entropy=options.with_entropy,
        with_tail=with_tail, select=select, ignore_index=options.ignore_index, softcap=options.softcap,
        tp_group=options.tp_group, reduce_grad_hidden=options.reduce_grad_hidden,
        check_inputs=options.check_inputs, labels_name=labels_name, precision=options.precision,
        grad_precision=options.grad_precision)
    return (lp, ent if options.with_entropy else None, tail if with_tail else None,
            top if select else None)


def fused_topk(hidden: Tensor, weight: Tensor, inv_temp: Tensor, mask: Tensor, k: int, backend: str,
               softcap: Optional[float], tp_group: Optional[str], reduce_grad_hidden: bool,
               precision: str = "native", grad_precision: str = "native",
               check_inputs: bool = True, with_lse: bool = False) -> tuple[Tensor, ...]:
    """(ids [N, k] int64, logprobs [N, k], tail [N]) of the rows where mask [N] is True (ids -1, logprobs 0,
    tail 0 elsewhere); logprobs and tail differentiable w.r.t. hidden and weight. precision / grad_precision as
    ``precision.resolve`` returns them. check_inputs=False: no host read (every row computed, the masked ones at
    inverse temperature 1 and zeroed; the temperatures are not checked). with_lse: also lse [N] (not
    differentiated; the logprobs are the selection's logits minus it)."""
    if not check_inputs:
        # every row runs: a masked one at inverse temperature 1, here so that the backward (which reads the op's
        # inputs) sees it too: NaN padding reaches nothing
        inv_temp = inv_temp.masked_fill(~mask, 1.0)
    ids, lp, tail, lse = torch.ops.logitless.fused_topk(hidden, weight, inv_temp, mask, k=k, backend=backend,
                                                         softcap=softcap, tp_group=tp_group,
                                                         reduce_grad_hidden=reduce_grad_hidden, precision=precision,
                                                         grad_precision=grad_precision, check_inputs=check_inputs)
    return (ids, lp, tail, lse.detach()) if with_lse else (ids, lp, tail)


# ------------------------------------------------------------------------------------------ checks and rows

def validate_sets(labels: Tensor, inv_temp: Tensor, vocab: int, ignore_index: int, name: str = "labels") -> bool:
    """ValueError (naming ``name``) for a row with only some ids equal to ignore_index, an id outside [0, vocab),
    an id repeated within a row, or a temperature outside the range; returns whether every row is kept.
    One host synchronisation."""
    if labels.numel() == 0:
        return True
    ign = labels == ignore_index
    ignored = ign.all(dim=1)
    partial = (ign.any(dim=1) & ~ignored).any()
    outside = (~ign & ((labels < 0) | (labels >= vocab))).any()
    ordered = labels.sort(dim=1).values
    repeated = ((ordered[:, 1:] == ordered[:, :-1]).any(dim=1) & ~ignored).any()
    bad_temp = ~checks.inverse_temperature_ok(inv_temp)
    partial, outside, repeated, bad_temp, every = torch.stack(
        [partial, outside, repeated, bad_temp, ~ignored.any()]).tolist()
    if partial:
        row = int((ign.any(dim=1) & ~ignored).nonzero()[0, 0])
        raise ValueError(f"{name}: token {row} has some but not all of its {labels.shape[1]} ids equal to "
                         f"ignore_index={ignore_index}; a token is ignored when all of its ids are")
    if outside:
        bad = labels[~ign & ((labels < 0) | (labels >= vocab))][0]
        raise ValueError(f"{name} must lie in [0, {vocab}) or equal ignore_index={ignore_index}; got {int(bad)}")
    if repeated:
        row = int(((ordered[:, 1:] == ordered[:, :-1]).any(dim=1) & ~ignored).nonzero()[0, 0])
        raise ValueError(f"{name}: token {row} repeats an id ({labels[row].tolist()}); the k ids of a token "
                         f"must differ")
    if bad_temp:
        raise ValueError(f"{checks.TEMPERATURE_RULE} everywhere")
    return bool(every)


def _kept(labels: Tensor, inv_temp: Tensor, weight: Tensor, tp: Optional["VocabParallel"], ignore_index: int,
          check_inputs: bool, validate: bool, labels_name: str = "labels"):
    """(valid [N] bool, rows [n] or None for every row, local ids [N, k]: the id's row in this weight, -1 where
    the row is ignored or another rank holds the id)."""
    valid = labels[:, 0] != ignore_index
    rows = None
    if check_inputs:
        vocab = tp.vocab_size if tp is not None else weight.shape[0]
        every = (validate_sets(labels, inv_temp, vocab, ignore_index, labels_name) if validate
                 else bool(valid.all()))
        if not every:
            rows = valid.nonzero().squeeze(1)
    local = labels - (tp.vocab_offset if tp is not None else 0)
    here = valid.unsqueeze(1) & (local >= 0) & (local < weight.shape[0])
    return valid, rows, torch.where(here, local, torch.full_like(local, -1))


def _blocks(n: int, step: int):
    for start in range(0, n, max(1, step)):
        yield start, min(start + max(1, step), n)


def _rows(hidden: Tensor, rows: Optional[Tensor], start: int, stop: int) -> Tensor:
    return hidden[start:stop] if rows is None else hidden.index_select(0, rows[start:stop])


def _scatter(values: Tensor, rows: Tensor, n: int) -> Tensor:
    return values.new_zeros((n,) + tuple(values.shape[1:])).index_copy_(0, rows, values)


def _pass_columns(backend: str, hidden: Tensor, weight: Tensor, n: int) -> tuple[int, int]:
    """(tokens per call, vocabulary columns per tile) of the torch vocabulary pass: the chunked backend's
    budget, or every token and column at once for the reference."""
    if backend == "reference":
        return max(1, n), weight.shape[0]
    return chunked.token_rows("forward", hidden, weight, False), chunked.stats_columns(n, weight.shape[0],
                                                                                         hidden.device)


def _products(backend: str):
    """The ids' raw products for this backend: the triton backend's kernel (a fixed summation order per token,
    so its log-probs keep the backend's batch invariance), torch's batched product elsewhere."""
    if backend == "triton":
        from .triton.set_products import set_products
        return set_products
    return label_sets.set_products


def _pass_name(backend: str) -> str:
    """What ran the torch vocabulary pass, for ``last_backend()``: the reference's one tile or the chunked
    backend's tiles (also for backend "triton", whose kernels run the backward only)."""
    return "reference" if backend == "reference" else "chunked"


def _set_pass(hidden, weight, inv_temp, softcap, rows, n, k, backend, offset, given=None, given_local=None,
              select=0, host_read=True):
    """label_sets.vocab_pass over the kept rows in token blocks -> (one SetPartial [n], the selection or None).
    host_read=False: no value read on the host (check_inputs=False)."""
    step, columns = _pass_columns(backend, hidden, weight, n)
    parts, sels = [], []
    for start, stop in _blocks(n, step):
        part, sel = label_sets.vocab_pass(
            _rows(hidden, rows, start, stop), weight, inv_temp[start:stop], softcap, columns, offset, k,
            None if given is None else given[start:stop], None if given_local is None else given_local[start:stop],
            select, host_read)
        parts.append(part)
        sels.append(sel)
    if len(parts) == 1:
        return parts[0], sels[0]
    if not parts:      # no token: the empty partial, for the collectives that follow
        f32 = dict(dtype=torch.float32, device=hidden.device)
        ids = given if given is not None else torch.empty((0, k), dtype=torch.int64, device=hidden.device)
        empty = torch.empty(0, **f32)
        sel = (torch.empty((0, select), **f32), torch.empty((0, select), dtype=torch.int64, device=hidden.device))
        return label_sets.SetPartial(empty, empty, torch.empty((0, k), **f32), ids), (sel if select else None)
    part = label_sets.SetPartial(*(torch.cat([getattr(p, f) for p in parts]) for f in label_sets.SetPartial._fields))
    return part, (None if sels[0] is None else (torch.cat([s[0] for s in sels]), torch.cat([s[1] for s in sels])))


def _kernel_usable(backend: str, check_inputs: bool, k: int, w_s: Tensor, h_s: Tensor, tp) -> bool:
    """Whether the triton backend's selection kernels take this top k (``topk_select.fast_path_ok``): they read
    on the host which rows need their exact second pass, so not under check_inputs=False (the torch pass then).
    Under tensor parallelism a decision of the global k and V, the same on every rank (their collectives follow
    it); a shard too small for the kernels runs the torch pass into the same partial (``_selection``)."""
    if backend != "triton" or not check_inputs:
        return False
    from .triton import topk_select
    if tp is not None:
        return 1 <= k <= topk_select.MAX_K and k < tp.vocab_size
    return topk_select.fast_path_ok(k, w_s.shape[0], h_s.dtype, h_s.device)


def _kernel_pass(h_s: Tensor, w_s: Tensor, inv_temp: Tensor, softcap, rows, n: int, k: int, offset: int):
    """The top k of this weight's rows by the selection kernels (``triton/topk_select.py``), in token chunks of
    bounded workspace -> (SetPartial [n] with global ids: the rest is the tail, lse [n] over this weight's rows)."""
    from .triton import topk_select
    sel = topk_select.select(h_s, w_s, inv_temp.contiguous(), k, softcap, rows)
    return label_sets.SetPartial(sel.m, sel.s, sel.vals, sel.ids + offset), sel.lse


def _selection(h_s, w_s, inv_temp, softcap, rows, n, k, backend, tp, check_inputs):
    """(global SetPartial of the top k, lse [n], whether the kernels ran): the selection kernels where
    ``_kernel_usable``, else the torch vocabulary pass; lse from the kernels' finish on one rank (a fixed order:
    batch invariant), from the merged partials across ranks."""
    offset = tp.vocab_offset if tp is not None else 0
    fast = _kernel_usable(backend, check_inputs, k, w_s, h_s, tp)
    if fast and tp is not None:
        from .triton import topk_select
        local = topk_select.fast_path_ok(k, w_s.shape[0], h_s.dtype, h_s.device)
    else:
        local = fast
    if local:
        part, lse = _kernel_pass(h_s, w_s, inv_temp, softcap, rows, n, k, offset)
    else:
        part, _ = _set_pass(h_s, w_s, inv_temp, softcap, rows, n, k, backend, offset, host_read=check_inputs)
    part = _global(part, tp, k, select=True)
    if not fast or tp is not None:
        lse, _ = part.lse_and_tail()
    return part, lse, fast


def _gather_partials(tp: "VocabParallel", part: label_sets.SetPartial, select: bool) -> list[label_sets.SetPartial]:
    """Every rank's partial, in rank order (one all-gather of the float statistics, one of the ids)."""
    from ..parallel import _gather_into
    n, k = part.vals.shape
    mine = torch.cat([part.m.unsqueeze(1), part.rest.unsqueeze(1), part.vals], 1).contiguous()
    every = mine.new_empty(tp.world_size * mine.numel())
    _gather_into(every, mine.view(-1), tp.group)
    every = every.view(tp.world_size, n, k + 2)
    if select:
        ids = part.ids.new_empty(tp.world_size * part.ids.numel())
        _gather_into(ids, part.ids.contiguous().view(-1), tp.group)
        ids = ids.view(tp.world_size, n, k)
    else:
        ids = part.ids.unsqueeze(0).expand(tp.world_size, n, k)
    return [label_sets.SetPartial(every[r, :, 0], every[r, :, 1], every[r, :, 2:], ids[r])
            for r in range(tp.world_size)]


def _global_selection(sel: tuple[Tensor, Tensor], tp: Optional["VocabParallel"], k: int) -> Tensor:
    """The global top-k ids from every rank's candidates (values and ids [n, k])."""
    vals, ids = sel
    if tp is None:
        return ids
    parts = _gather_partials(tp, label_sets.SetPartial(vals[:, 0], vals[:, 0], vals, ids), select=True)
    vals, ids = label_sets.order_by_value_then_id(torch.cat([p.vals for p in parts], 1),
                                                  torch.cat([p.ids for p in parts], 1))
    return ids[:, :k].contiguous()


def _set_logits(h_s, w_s, local, inv_temp, softcap, rows, n, tp, backend) -> Tensor:
    """The ids' logits zy [n, k] (local: their rows here, -1 elsewhere), gathered products of the statistics
    operands, summed across ranks (each id's logit comes from the one rank holding it)."""
    zy = torch.zeros((n, local.shape[1]), dtype=torch.float32, device=h_s.device)
    for start, stop in _blocks(n, label_sets.GATHER_ELEMENTS // max(1, h_s.shape[1])):
        # float32 products of the precision's parts (exact: bfloat16 parts, TF32-rounded values), IEEE
        zy[start:stop], _ = label_sets.set_logits(_rows(h_s, rows, start, stop), w_s, local[start:stop],
                                                  inv_temp[start:stop], softcap, _products(backend))
    if tp is not None and tp.world_size > 1:
        import torch.distributed as dist
        dist.all_reduce(zy, group=tp.group)
    return zy


def id_logits(hidden: Tensor, weight: Tensor, local: Tensor, inv_temp: Tensor, backend: str) -> Tensor:
    """The tempered logits [n, k] of ids local [n, k] (rows of this whole weight, no softcap) as the forward of
    ``fused_logprobs_k`` gathers them (the backend's gathered product), for a pass that has the lse."""
    return _set_logits(hidden, weight, local, inv_temp, None, None, hidden.shape[0], None, backend)


def top_ids(hidden: Tensor, weight: Tensor, inv_temp: Tensor, rows: Optional[Tensor], k: int, backend: str,
            precision: tuple) -> Tensor:
    """The ids [n, k] of the k largest logits (no softcap; ties to the lower id) of the kept rows (``rows``, None:
    every row; inv_temp of those rows) as ``fused_logprobs_k(select=k)`` selects them: the triton backend's
    selection kernels where they take this k, else the torch vocabulary pass. With the ids checked (a host read
    of which rows need the kernels' second pass)."""
    n = inv_temp.shape[0]
    h_s, w_s, tf32 = _stats_operands(hidden, weight, precision[0], precision[1], n)
    with tf32_products(tf32):
        part, _, _ = _selection(h_s, w_s, inv_temp, None, rows, n, k, backend, None, True)
    return part.ids


def selecting_stats(backend: str, k: int, hidden: Tensor, weight: Tensor):
    """The triton policy pass's stage 1 that also selects each token's top k in its GEMM
    (``triton/topk_select.SelectingStats``: the ids ``top_ids`` gives, ties to the lower id), or None where the
    selection kernels do not take this k (``fast_path_ok``), on the other backends, or with
    LOGITLESS_TOPK_DISTILL_SELECTION=separate. No softcap, one vocabulary shard."""
    if backend != "triton" or knobs.topk_distill_selection() != "shared":
        return None
    from .triton import topk_select
    if not topk_select.fast_path_ok(k, weight.shape[0], hidden.dtype, hidden.device):
        return None
    return topk_select.SelectingStats(weight, k, hidden.shape[0], hidden.dtype)


def _global(part, tp, k, select):
    if tp is None:
        return part
    return label_sets.combine_partials(_gather_partials(tp, part, select), k, select)


# ------------------------------------------------------------------------------------------ forward ops

@torch.library.custom_op("logitless::checked_logprobs", mutates_args=())
def checked_logprobs(logprobs: Tensor, scored: Tensor, name: str, allow_neg_inf: bool = True,
                     mass_slack: Optional[float] = None) -> Tensor:
    """float32 log-probs [..., k], 0 on the rows where scored [...] is False; ValueError naming ``name`` when a
    scored one is above 0 or NaN, -inf (unless ``allow_neg_inf``), or when a scored row's k probabilities sum to
    more than 1 + ``mass_slack`` (None: not checked). One host read. A custom op: its host synchronisation is
    opaque to torch.compile."""
    lp = logprobs.float()
    if not lp.numel():
        return torch.where(scored.unsqueeze(-1), lp, torch.zeros_like(lp))
    on = scored.unsqueeze(-1)
    bad = on & (torch.isnan(lp) | (lp > 0))
    neg_inf = on & (lp == float("-inf"))
    mass = torch.where(on, logprobs.double().exp(), 0.0).sum(dim=-1)
    over = (mass > 1.0 + (mass_slack if mass_slack is not None else float("inf"))) & scored
    any_bad, any_inf, any_over = torch.stack([bad.any(), neg_inf.any(), over.any()]).tolist()
    if any_bad:
        raise ValueError(f"{name} must be <= 0 and not NaN on scored tokens; got {float(lp[bad][0])!r}")
    if any_inf and not allow_neg_inf:
        raise ValueError(f"{name} holds -inf (a probability 0) on a scored token: its term 0 * (-inf - s) is NaN "
                         f"(verl's forward_kl_topk gives NaN there too); pass log_prob_min_clamp (verl's default "
                         f"-10.0) or finite log-probs")
    if any_over:
        raise ValueError(f"{name}: a scored token's k probabilities sum to {float(mass[over][0]):.6g} > 1 (beyond "
                         f"rounding): not the log-probs of one distribution (another temperature or normalisation, "
                         f"or logits?)")
    return torch.where(on, lp, torch.zeros_like(lp))


@checked_logprobs.register_fake
def _checked_logprobs_fake(logprobs, scored, name, allow_neg_inf=True, mass_slack=None):
    return logprobs.new_empty(logprobs.shape, dtype=torch.float32)


@torch.library.custom_op("logitless::fused_logprobs_k", mutates_args=())
def _forward_k_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, *, backend: str,
                  with_entropy: bool, with_tail: bool, select: int, ignore_index: int, softcap: Optional[float],
                  tp_group: Optional[str], reduce_grad_hidden: bool, check_inputs: bool, labels_name: str = "labels",
                  precision: str = "native", grad_precision: str = "native"
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(hidden):
        return _forward_k(hidden, weight, labels, inv_temp, backend, with_entropy, with_tail, select, ignore_index,
                          softcap, tp_group, reduce_grad_hidden, check_inputs, labels_name, precision, grad_precision)


def _tail_kernel(backend: str) -> bool:
    """Whether the backward of an op with a tail output runs in the backend's kernels (the triton backend's
    dlogits stage, ``triton/tail_dlogits.py``) rather than ``tail_backward``'s torch pass."""
    return backend == "triton"


def backward_precision(grad_precision: str, with_tail: bool, backend: str) -> str:
    """The gradient products the backward runs for an op asked for ``grad_precision`` on ``backend``: an op with a
    tail output runs, off the triton backend, ``tail_backward``'s torch pass (float32 IEEE products of the operands:
    "ieee", or "native" for half operands); on it, and for the other ops, the backend's with ``grad_precision``.
    Decided from the op's outputs, not from whether the tail gets a gradient, so that the forward's record
    (``last_precision()``, which a backward on another thread could not update) says what the backward runs."""
    if with_tail and not _tail_kernel(backend) and grad_precision != "native":
        return "ieee"
    return grad_precision


def _stats_operands(hidden: Tensor, weight: Tensor, precision: str, grad_precision: str, n: int):
    """(hidden, weight, tf32) the forward multiplies: a precision's statistics operands (``precision.py``; made
    here, dropped with the pass, never saved), or the operands themselves (none needed for no kept row)."""
    ops = make_operands(hidden, weight, precision, grad_precision, with_grad=False) if n else None
    return (hidden, weight, False) if ops is None else (ops.hidden, ops.weight, ops.tf32)


def _forward_k(hidden, weight, labels, inv_temp, backend, with_entropy, with_tail, select, ignore_index, softcap,
               tp_group, reduce_grad_hidden, check_inputs, labels_name, precision="native", grad_precision="native"):
    if (with_tail or select) and with_entropy:
        raise ValueError("with_entropy cannot be set with the tail or a selection: their pass computes no entropy")
    mod = load_backend(backend)
    tp = _layout(tp_group, weight, reduce_grad_hidden)
    N, k = labels.shape
    valid, rows, local = _kept(labels, inv_temp, weight, tp, ignore_index, check_inputs, validate=True,
                               labels_name=labels_name)
    # the adaptive split's products (``precision.choose``); poison: NaN for an unchecked call's false claim
    precision, poison = choose(precision, hidden, weight, check_inputs, tp.group if tp is not None else None)
    ids = labels
    if rows is not None:
        local, inv_temp, ids = local[rows], inv_temp[rows], labels[rows]
    n = local.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    ent = tail = top = None
    # the logits of every pass below, the ids' included, are products of the precision's operands: each id's
    # logit is the number the statistics summed for its column (docs/precision.md, "k ids per token")
    h_s, w_s, tf32 = _stats_operands(hidden, weight, precision, grad_precision, n)
    fast = bool(select) and not with_tail and _kernel_usable(mod.name, check_inputs, select, w_s, h_s, tp)
    # whether the torch vocabulary pass ran (the record names it)
    torch_pass = bool(with_tail or select) and not fast
    if with_tail and mod.name == "triton":
        # the given ids' logits and the mass outside them by the kernels (``triton/given_set.py``); the student's
        # own top k, when asked, by the selection kernels where they take it (``_selection``)
        from .triton import given_set, topk_select
        torch_pass = False
        with tf32_products(tf32):
            if (select and tp is None and _kernel_usable(mod.name, check_inputs, select, w_s, h_s, tp)
                    and topk_select.shares_given(select, w_s.shape[0], h_s.dtype, h_s.device)):
                # both from one GEMM: the selection kernel runs the given set's epilogue too
                sel, part = topk_select.select_with_given(h_s, w_s, inv_temp.contiguous(), select, local, ids,
                                                          softcap, rows)
                top = sel.ids
            else:
                part = given_set.given_set(h_s, w_s, inv_temp, local, ids, softcap, rows)
                if select:
                    sel_part, _, kernels = _selection(h_s, w_s, inv_temp, softcap, rows, n, select, mod.name, tp,
                                                      check_inputs)
                    top, torch_pass = sel_part.ids, not kernels
        part = _global(part, tp, k, select=False)
        lse, tail = part.lse_and_tail()
        lp = part.vals - lse.unsqueeze(1)
    elif fast:
        # the student's own top k by the selection kernels, lse from the same pass; the ids' logits gathered
        with tf32_products(tf32):
            part, lse, _ = _selection(h_s, w_s, inv_temp, softcap, rows, n, select, mod.name, tp, check_inputs)
        top = part.ids
        lp = _set_logits(h_s, w_s, local, inv_temp, softcap, rows, n, tp, mod.name) - lse.unsqueeze(1)
    elif with_tail or select:
        with tf32_products(tf32):
            part, sel = _set_pass(h_s, w_s, inv_temp, softcap, rows, n, k, mod.name,
                                  tp.vocab_offset if tp is not None else 0, given=ids, given_local=local,
                                  select=select, host_read=check_inputs)
        part = _global(part, tp, k, select=False)
        lse, tail = part.lse_and_tail()
        lp = part.vals - lse.unsqueeze(1)
        if select:
            top = _global_selection(sel, tp, select)
        tail = tail if with_tail else None
    else:
        if n == 0:
            lse = torch.zeros(0, **f32)
            ent = torch.zeros(0, **f32) if with_entropy else None
        else:
            with tf32_products(tf32):
                lse, ent, _ = token_chunks.stats(mod, h_s, w_s, torch.full_like(local[:, 0], -1), inv_temp, rows,
                                                 with_entropy, softcap)
        if tp is not None:
            lse, ent, _ = tp.combine_stats(lse, ent, torch.zeros_like(lse))
        lp = _set_logits(h_s, w_s, local, inv_temp, softcap, rows, n, tp, mod.name) - lse.unsqueeze(1)
    if rows is not None:
        lp, lse = _scatter(lp, rows, N), _scatter(lse, rows, N)
        ent = _scatter(ent, rows, N) if ent is not None else None
        tail = _scatter(tail, rows, N) if tail is not None else None
        top = (torch.full((N, select), -1, dtype=torch.int64, device=hidden.device).index_copy_(0, rows, top)
               if top is not None else None)
    elif not check_inputs:
        lp = torch.where(valid.unsqueeze(1), lp, torch.zeros_like(lp))
        ent = torch.where(valid, ent, torch.zeros_like(ent)) if ent is not None else None
        tail = torch.where(valid, tail, torch.zeros_like(tail)) if tail is not None else None
        top = torch.where(valid.unsqueeze(1), top, torch.full_like(top, -1)) if top is not None else None
    del h_s, w_s
    if poison is not None:
        lp = lp + poison
        ent = ent + poison if ent is not None else None
    record_backend(_pass_name(mod.name) if torch_pass else mod.name,
                   (public_name(precision), backward_precision(grad_precision, with_tail, mod.name)),
                   "fused_logprobs_k")
    empty = lp.new_empty(0)
    top = top if top is not None else torch.empty((N, 0), dtype=torch.int64, device=hidden.device)
    return lp, ent if ent is not None else empty, tail if tail is not None else empty.clone(), top, lse.clone()


@_forward_k_op.register_fake
def _forward_k_fake(hidden, weight, labels, inv_temp, *, backend, with_entropy, with_tail, select, ignore_index,
                    softcap, tp_group, reduce_grad_hidden, check_inputs, labels_name="labels", precision="native",
                    grad_precision="native"):
    n = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return (hidden.new_empty(labels.shape, **f), hidden.new_empty(n if with_entropy else 0, **f),
            hidden.new_empty(n if with_tail else 0, **f), hidden.new_empty((n, select), dtype=torch.int64),
            hidden.new_empty(n, **f))


@torch.library.custom_op("logitless::fused_topk", mutates_args=())
def _topk_op(hidden: Tensor, weight: Tensor, inv_temp: Tensor, mask: Tensor, *, k: int, backend: str,
             softcap: Optional[float], tp_group: Optional[str], reduce_grad_hidden: bool, precision: str = "native",
             grad_precision: str = "native", check_inputs: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(hidden):
        return _topk(hidden, weight, inv_temp, mask, k, backend, softcap, tp_group, reduce_grad_hidden, precision,
                     grad_precision, check_inputs)


def _topk(hidden, weight, inv_temp, mask, k, backend, softcap, tp_group, reduce_grad_hidden, precision="native",
          grad_precision="native", check_inputs=True):
    mod = load_backend(backend)
    tp = _layout(tp_group, weight, reduce_grad_hidden)
    N = hidden.shape[0]
    if check_inputs:
        every = True
        if N:
            # one host read: the temperatures, a non-finite hidden state in a row the mask keeps, the mask
            bad_temp, bad_hidden, every = torch.stack([~checks.inverse_temperature_ok(inv_temp),
                                                       checks.non_finite_rows(hidden, mask), mask.all()]).tolist()
            if bad_temp:
                raise ValueError(f"{checks.TEMPERATURE_RULE} everywhere")
            if bad_hidden:
                raise ValueError("hidden must be finite at every row where mask is True: a NaN or an infinity "
                                 "there gives NaN log-probs and arbitrary ids, and a NaN weight gradient")
    else:
        every = True        # no host read: every row runs (``fused_topk`` set the masked ones' temperature)
    rows = None if every else mask.nonzero().squeeze(1)
    precision, _ = choose(precision, hidden, weight, check_inputs, tp.group if tp is not None else None)
    if rows is not None:
        inv_temp = inv_temp[rows]
    n = inv_temp.shape[0]
    # the selection and the sums are over the precision's logits (its statistics operands)
    h_s, w_s, tf32 = _stats_operands(hidden, weight, precision, grad_precision, n)
    with tf32_products(tf32):
        part, lse, fast = _selection(h_s, w_s, inv_temp, softcap, rows, n, k, mod.name, tp, check_inputs)
    del h_s, w_s
    # the tail: every column outside the k, in log space from its own max and sum (-inf when k == V)
    tail = part.m + torch.log(part.rest) - lse
    lp, ids = part.vals - lse.unsqueeze(1), part.ids
    if not check_inputs:
        # the masked rows' outputs as the checked call leaves them (their lse stays: the backward's p of the row)
        ids = torch.where(mask.unsqueeze(1), ids, -1)
        lp = torch.where(mask.unsqueeze(1), lp, 0.0)
        tail = torch.where(mask, tail, 0.0)
    if rows is not None:
        lp, lse, tail = _scatter(lp, rows, N), _scatter(lse, rows, N), _scatter(tail, rows, N)
        ids = torch.full((N, k), -1, dtype=torch.int64, device=hidden.device).index_copy_(0, rows, ids)
    record_backend("triton" if fast else _pass_name(mod.name),
                   (public_name(precision), backward_precision(grad_precision, True, mod.name)), "fused_topk")
    return ids, lp, tail, lse


@_topk_op.register_fake
def _topk_fake(hidden, weight, inv_temp, mask, *, k, backend, softcap, tp_group, reduce_grad_hidden,
               precision="native", grad_precision="native", check_inputs=True):
    n = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return (hidden.new_empty((n, k), dtype=torch.int64), hidden.new_empty((n, k), **f), hidden.new_empty(n, **f),
            hidden.new_empty(n, **f))


# ------------------------------------------------------------------------------------------ backward op

@torch.library.custom_op("logitless::fused_logprobs_k_backward", mutates_args=())
def _backward_k_op(g_logprobs: Optional[Tensor], g_entropy: Optional[Tensor], g_tail: Optional[Tensor],
                   hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, lse: Tensor, entropy: Tensor,
                   logprobs: Tensor, tail: Tensor, *, backend: str, ignore_index: int, softcap: Optional[float],
                   tp_group: Optional[str], reduce_grad_hidden: bool, check_inputs: bool, need_dh: bool,
                   need_dw: bool, precision: str = "native", grad_precision: str = "native") -> tuple[Tensor, Tensor]:
    with no_autocast(hidden):
        return _backward_k(g_logprobs, g_entropy, g_tail, hidden, weight, labels, inv_temp, lse, entropy, logprobs,
                           tail, backend, ignore_index, softcap, tp_group, reduce_grad_hidden, check_inputs,
                           need_dh, need_dw, precision, grad_precision)


def _backward_k(g_logprobs, g_entropy, g_tail, hidden, weight, labels, inv_temp, lse, entropy, logprobs, tail,
                backend, ignore_index, softcap, tp_group, reduce_grad_hidden, check_inputs, need_dh, need_dw,
                precision="native", grad_precision="native"):
    mod = load_backend(backend)
    tp = _layout(tp_group, weight, reduce_grad_hidden)
    valid, rows, local = _kept(labels, inv_temp, weight, tp, ignore_index, check_inputs, validate=False)
    precision, poison = choose(precision, hidden, weight, check_inputs, tp.group if tp is not None else None)
    g_lp = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device) if g_logprobs is None \
        else g_logprobs.float()
    g_lp = g_lp + poison if poison is not None else g_lp
    g_ent = g_entropy.float() if g_entropy is not None and entropy.numel() else None
    g_t = g_tail.float() if g_tail is not None and tail.numel() else None
    ent, lp, tl = (entropy if g_ent is not None else None), logprobs, (tail if tail.numel() else None)
    if rows is not None:
        local, inv_temp, lse, g_lp, lp = local[rows], inv_temp[rows], lse[rows], g_lp[rows], lp[rows]
        ent, g_ent = (ent[rows], g_ent[rows]) if g_ent is not None else (None, None)
        tl = tl[rows] if tl is not None else None
        g_t = g_t[rows] if g_t is not None else None
    elif not check_inputs:
        g_lp = torch.where(valid.unsqueeze(1), g_lp, torch.zeros_like(g_lp))
        g_ent = torch.where(valid, g_ent, torch.zeros_like(g_ent)) if g_ent is not None else None
        g_t = torch.where(valid, g_t, torch.zeros_like(g_t)) if g_t is not None else None
    if tail.numel():
        # an op with a tail output: its closed form (``tail_backward``: no cancellation at the k ids)
        dh, dw = _tail_grads(mod, hidden, weight, local, inv_temp, lse, tl, lp, g_lp, g_t, rows, softcap, need_dh,
                             need_dw, precision, grad_precision, tp)
        return (dh if need_dh else hidden.new_empty(0)), (dw if need_dw else weight.new_empty(0))
    G, coef = g_lp.sum(dim=1), g_lp
    n = local.shape[0]
    # the precision's operands again (the forward's were dropped): the dense part recomputes the statistics'
    # logits from them and forms its products with their gradient parts
    ops = make_operands(hidden, weight, precision, grad_precision) if n else None
    h_s, w_s = (hidden, weight) if ops is None else (ops.hidden, ops.weight)
    raw = None
    if softcap is not None:
        # the cap's derivative at the raw products the forward used: the precision's
        raw = torch.zeros(local.shape, dtype=torch.float32, device=hidden.device)
        for start, stop in _blocks(n, label_sets.GATHER_ELEMENTS // max(1, h_s.shape[1])):
            raw[start:stop] = _products(mod.name)(_rows(h_s, rows, start, stop), w_s, local[start:stop])
    c = label_sets.onehot_coefficients(coef, raw, inv_temp, softcap, local)

    def add_dh(dh: Tensor, start: int, stop: int) -> None:
        # k float32 weight rows per token, IEEE float32 whatever the precision: exact, and too small to gain
        # from the tensor cores (also outside the TF32 block of a "tf32" precision: these rows are not rounded)
        with tf32_products(False):
            label_sets.add_onehot_dh(dh, weight, local[start:stop], c[start:stop])

    finish = tp.reduce_grad_hidden if tp is not None else (lambda dh: dh)
    with tf32_products(ops is not None and ops.tf32):
        dh, dw = token_chunks.grads(mod, hidden, weight, torch.full_like(local[:, 0], -1), inv_temp, lse, ent,
                                    G.contiguous(), None if g_ent is None else g_ent.contiguous(), rows, need_dh,
                                    need_dw, softcap, finish, operands=ops, add_dh=add_dh)
    del ops, h_s, w_s
    if need_dw and n:
        label_sets.add_onehot_dw(dw, hidden, local, c, rows, host_read=check_inputs)
    return (dh if need_dh else hidden.new_empty(0)), (dw if need_dw else weight.new_empty(0))


def _tail_grads(mod, hidden, weight, local, inv_temp, lse, tail, lp, g_lp, g_t, rows, softcap, need_dh, need_dw,
                precision, grad_precision, tp):
    """(d_hidden, d_weight) of an op with a tail output, for the kept rows: on the triton backend its dlogits
    kernel (``triton/tail_dlogits.py``) in the backend's backward pass, with the plain op's operands and gradient
    products (``function._operands``); elsewhere ``tail_backward``'s torch pass (IEEE float32 products)."""
    terms, G = tail_backward.terms(local, lse, tail, lp, g_lp, g_t)
    finish = tp.reduce_grad_hidden if tp is not None else (lambda d: d)
    n = local.shape[0]
    if _tail_kernel(mod.name):
        ops = _operands(mod, hidden, weight, precision, grad_precision) if n else None
        with tf32_products(ops is not None and ops.tf32), split_in_kernel(ops.split if ops is not None else None):
            return token_chunks.grads(mod, hidden, weight, torch.full_like(local[:, 0], -1), inv_temp.contiguous(),
                                      lse.contiguous(), None, G, None, rows, need_dh, need_dw, softcap, finish,
                                      operands=ops, tail=tail_backward.unique_ids(terms))
    h_s, w_s, tf32 = _stats_operands(hidden, weight, precision, grad_precision, n)
    step, columns = _pass_columns(mod.name, h_s, w_s, n)
    return tail_backward.grads(hidden, weight, h_s, w_s, tf32, terms, G, inv_temp, lse, rows, softcap, need_dh,
                               need_dw, step, columns, finish)


@_backward_k_op.register_fake
def _backward_k_fake(g_logprobs, g_entropy, g_tail, hidden, weight, labels, inv_temp, lse, entropy, logprobs, tail,
                     *, backend, ignore_index, softcap, tp_group, reduce_grad_hidden, check_inputs, need_dh, need_dw,
                     precision="native", grad_precision="native"):
    dh = hidden.new_empty(hidden.shape) if need_dh else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    return dh, dw


# ------------------------------------------------------------------------------------------ autograd

def _backward_call(ctx, g_lp, g_ent, g_tail, labels, ignore_index, check_inputs):
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dh or need_dw):
        return None, None
    hidden, weight, inv_temp, lse, entropy, logprobs, tail = ctx.saved_tensors[:7]
    o = ctx.options
    dh, dw = torch.ops.logitless.fused_logprobs_k_backward(
        g_lp, g_ent, g_tail, hidden, weight, labels, inv_temp, lse, entropy, logprobs, tail, backend=o["backend"],
        ignore_index=ignore_index, softcap=o["softcap"], tp_group=o["tp_group"],
        reduce_grad_hidden=o["reduce_grad_hidden"], check_inputs=check_inputs, need_dh=need_dh, need_dw=need_dw,
        precision=o.get("precision", "native"), grad_precision=o.get("grad_precision", "native"))
    return (dh if need_dh else None), (dw if need_dw else None)


def _setup_k(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, labels, inv_temp = inputs
    lp, entropy, tail, top, lse = output
    ctx.save_for_backward(hidden, weight, inv_temp, lse, entropy, lp, tail, labels)
    ctx.options = keyword_only_inputs
    ctx.mark_non_differentiable(lse, top)
    for flag, out in (("with_entropy", entropy), ("with_tail", tail)):
        if not keyword_only_inputs[flag]:
            ctx.mark_non_differentiable(out)
    ctx.set_materialize_grads(False)


def _backward_k_autograd(ctx, g_lp, g_ent, g_tail, _g_top, _g_lse):
    o = ctx.options
    dh, dw = _backward_call(ctx, g_lp, g_ent if o["with_entropy"] else None, g_tail if o["with_tail"] else None,
                            ctx.saved_tensors[7], o["ignore_index"], o["check_inputs"])
    return dh, dw, None, None


_forward_k_op.register_autograd(_backward_k_autograd, setup_context=_setup_k)


def _setup_topk(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, inv_temp, _ = inputs
    ids, lp, tail, lse = output
    empty = lse.new_empty(0)
    ctx.save_for_backward(hidden, weight, inv_temp, lse, empty, lp, tail, ids)
    ctx.options = dict(keyword_only_inputs)
    ctx.mark_non_differentiable(ids, lse)
    ctx.set_materialize_grads(False)


def _backward_topk_autograd(ctx, _g_ids, g_lp, g_tail, _g_lse):
    # masked rows hold ids -1 on all k: ignored rows of the k-label backward with ignore_index -1
    dh, dw = _backward_call(ctx, g_lp, None, g_tail, ctx.saved_tensors[7], -1,
                            ctx.options.get("check_inputs", True))
    return dh, dw, None, None


_topk_op.register_autograd(_backward_topk_autograd, setup_context=_setup_topk)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("the k-id log-probs are once-differentiable: second-order gradients are not supported")


def _no_context(ctx, inputs, keyword_only_inputs, output):
    pass


_backward_k_op.register_autograd(_refuse_double_backward, setup_context=_no_context)
