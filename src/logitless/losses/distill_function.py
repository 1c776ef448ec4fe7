"""The full-vocabulary distillation loss as a ``torch.library`` custom op with a fake kernel (so
``torch.compile(fullgraph=True)`` traces through it) and its autograd:

    logitless::fused_distillation_loss(s_hidden [N, H_s], s_weight [V_local, H_s], t_hidden [N, H_t],
        t_weight [V_local, H_t], labels [N] int64, inv_temp [N] float32, token_w [N] float32, **settings)
        -> (loss 0-d, divergence [N], student entropy [N], d_s_hidden [N, H_s] or [0], d_s_weight or [0])

Like the fused policy loss, the gradients are formed in the forward (``ops/distill_chunked.py``: four GEMMs,
nothing recomputed) and handed out once, scaled by the upstream gradient, in the backward; the teacher gets
none. Inside the op, one host synchronisation checks the labels, temperatures and per-token weights and counts
the scored tokens (label != ignore_index); only those reach the pass (ignored rows cost nothing). With
check_inputs=False there is none: every row runs, the rows not scored with weight 0 and outputs 0.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .. import checks
from ..ops.distill_chunked import Head, distill_pass_for
from ..ops.divergence_terms import Divergence, HeadTransform
from ..ops.function import _layout
from ..ops.maths import no_autocast
from ..ops.precision import choose, make_operands, resolve
from ..record import record_backend
from .function import hand_out_gradients  # (its module registers logitless::scale_by_upstream_)


def _none_if_nan(x: float) -> Optional[float]:
    return None if math.isnan(x) else x


def _scored_rows(labels: Tensor, inv_temp: Tensor, token_w: Tensor, vocab: int, ignore_index: int,
                 s_hidden: Tensor, t_hidden: Tensor) -> Optional[Tensor]:
    """ValueError for a label outside [0, vocab) that is not ignore_index, a temperature out of range, a
    non-finite or negative per-token weight or a non-finite student / teacher hidden state at a scored token; the
    scored rows (None: every row). One host read."""
    valid = labels != ignore_index
    if labels.numel() == 0:
        return None
    bad_label = checks.labels_out_of_range(labels, valid, vocab).any()
    bad_temp = ~checks.inverse_temperature_ok(inv_temp)
    bad_w = (valid & ~checks.weight_ok(token_w)).any()
    bad_s, bad_t = checks.non_finite_rows(s_hidden, valid), checks.non_finite_rows(t_hidden, valid)
    count = valid.sum()
    bad_label, bad_temp, bad_w, bad_s, bad_t, count = torch.stack(
        [bad_label, bad_temp, bad_w, bad_s, bad_t, count]).tolist()
    if bad_label:
        checks.check_label_range(labels, valid, vocab, ignore_index)
    if bad_temp:
        raise ValueError(f"{checks.TEMPERATURE_RULE} everywhere")
    if bad_w:
        raise ValueError(checks.TOKEN_WEIGHT_RULE)
    for bad, name in ((bad_s, "student_hidden"), (bad_t, "teacher_hidden")):
        if bad:
            raise ValueError(f"{name} holds a NaN or an infinity in a scored row (label != ignore_index): its "
                             f"divergence and every gradient would be NaN")
    count = int(count)
    return None if count == labels.numel() else torch.nonzero_static(valid, size=count).squeeze(1)


def precisions(precision, grad_precision, s_hidden: Tensor, t_hidden: Tensor) -> tuple[str, str, str]:
    """(student statistics, student gradients, teacher statistics) as ``ops.precision.resolve`` gives them:
    ``precision`` multiplies every float32 head's logits, ``grad_precision`` the student's gradient products.
    TypeError / ValueError (naming the argument) for a setting with no effect: ``precision`` when neither head
    is float32, ``grad_precision`` for a half-precision student."""
    dev = s_hidden.device
    if s_hidden.dtype == torch.float32:
        s_stats, s_grad = resolve(precision, grad_precision, torch.float32, dev)
        t_stats = s_stats if t_hidden.dtype == torch.float32 else "native"
        return s_stats, s_grad, t_stats
    resolve(None, grad_precision, s_hidden.dtype, dev)
    t_stats, _ = resolve(precision, None, t_hidden.dtype, dev)
    return "native", "native", t_stats


def products_ran(s_stats: str, s_grad: str, t_stats: str) -> tuple[str, str]:
    """(statistics, gradients) for ``last_precision()``: the float32 head's precision (the student's when both
    are float32: they share it), "native" for half-precision heads; the gradient products are the student's."""
    return (s_stats if s_stats != "native" else t_stats), s_grad


@torch.library.custom_op("logitless::checked_count", mutates_args=())
def checked_count(count: Tensor) -> Tensor:
    """A 0-d count (TRL's num_items_in_batch) as float64, ValueError naming num_items_in_batch unless it is finite
    and > 0 (a negative count would flip the loss's sign, inf zero it). One host read; a custom op, so that
    torch.compile(fullgraph=True) traces it without a graph break."""
    checks.finite_float(float(count), "num_items_in_batch", minimum=0.0, above=True)
    return count.double().clone()


@checked_count.register_fake
def _checked_count_fake(count):
    return count.new_empty(count.shape, dtype=torch.float64)


@torch.library.custom_op("logitless::fused_distillation_loss", mutates_args=())
def _distill_op(s_hidden: Tensor, s_weight: Tensor, t_hidden: Tensor, t_weight: Tensor, labels: Tensor,
                inv_temp: Tensor, token_w: Tensor, *, kind: str, beta: float, s_scale: float, s_softcap: float,
                t_scale: float, t_softcap: float, backend: str, ignore_index: int, tp_group: Optional[str],
                reduce_grad_hidden: bool, need_dh: bool, need_dw: bool, check_inputs: bool = True,
                precision: str = "native", grad_precision: str = "native", t_precision: str = "native"
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(s_hidden):
        tp = _layout(tp_group, s_weight, reduce_grad_hidden)
        if tp is not None and check_inputs:
            # compared on every call, on every rank (the layouts' sizes are cached per shape: a teacher shard
            # that differs on one rank after a first call would otherwise exchange alone)
            tp.check_same_rows(t_weight, "teacher_weight", "student_weight")
        elif tp is not None:
            # no host read: the cached layouts (a shard that changes on one rank only after the first call is
            # not seen: docs/distillation.md)
            t_tp = _layout(tp_group, t_weight, reduce_grad_hidden)
            if t_tp.sizes != tp.sizes:
                raise ValueError(f"teacher_weight's vocabulary shards {t_tp.sizes} differ from student_weight's "
                                 f"{tp.sizes} over tp_group: both heads must be sharded the same way")
        vocab = tp.vocab_size if tp is not None else s_weight.shape[0]
        if check_inputs:
            rows = _scored_rows(labels, inv_temp, token_w, vocab, ignore_index, s_hidden, t_hidden)
        else:
            # no host read: every row runs; a row not scored gets inverse temperature 1 (NaN padding of a
            # per-token temperature reaches nothing) and weight 0 (no gradient), its outputs 0 below
            rows, valid = None, labels != ignore_index
            inv_temp = inv_temp.masked_fill(~valid, 1.0)
            token_w = token_w.masked_fill(~valid, 0.0)

        def pick(t: Tensor) -> Tensor:
            return t if rows is None else t.index_select(0, rows)
        hs, ht = pick(s_hidden), pick(t_hidden)
        # the adaptive split ("split", CUDA's default for float32 heads) decides its products from each head's
        # operands (``choose``: one host read with check_inputs, else the general three products); no caller's
        # claim reaches this op, so there is no poison to add
        group = tp.group if tp is not None else None
        if precision != "native":
            precision, _ = choose(precision, hs, s_weight, check_inputs, group)
        if t_precision != "native":
            t_precision, _ = choose(t_precision, ht, t_weight, check_inputs, group)
        # a float32 head's precision operands (the split's parts), made here and dropped with the pass
        s_ops = make_operands(hs, s_weight, precision, grad_precision, with_grad=need_dh or need_dw) \
            if precision != "native" else None
        t_ops = make_operands(ht, t_weight, t_precision, "ieee", with_grad=False) if t_precision != "native" else None
        student = Head(hs, s_weight, HeadTransform(s_scale, _none_if_nan(s_softcap)), s_ops)
        teacher = Head(ht, t_weight, HeadTransform(t_scale, _none_if_nan(t_softcap)), t_ops)
        w = pick(token_w)
        n, dev = student.hidden.shape[0], s_hidden.device
        dh = None
        if need_dh:
            # under tensor parallelism d_hidden is a partial sum: float32 until it is reduced
            dh = torch.empty((n, s_hidden.shape[1]), dtype=torch.float32 if tp is not None else s_hidden.dtype,
                             device=dev)
        # the pass writes every element of both unless there is no token
        alloc = torch.zeros if n == 0 else torch.empty
        dw = alloc(s_weight.shape, dtype=s_weight.dtype, device=dev) if need_dw else None
        div, ent = distill_pass_for(backend)(student, teacher, pick(inv_temp), w,
                                             Divergence(kind, _none_if_nan(beta)), dh, dw, tp=tp)
        if not check_inputs:
            div, ent = div.masked_fill(~valid, 0.0), ent.masked_fill(~valid, 0.0)
        loss = (w.double() * div.double()).sum().float()
        record_backend(backend, products_ran(precision, grad_precision, t_precision), "fused_distillation_loss")
        if dh is not None:
            if tp is not None:
                dh = tp.reduce_grad_hidden(dh)
            if rows is not None:
                dh = torch.zeros(s_hidden.shape, dtype=dh.dtype, device=dev).index_copy_(0, rows, dh)
            dh = dh.to(s_hidden.dtype)

        def scatter(x: Tensor) -> Tensor:
            return x if rows is None else x.new_zeros(labels.shape[0]).index_copy_(0, rows, x)
        return (loss, scatter(div), scatter(ent), s_hidden.new_empty(0) if dh is None else dh,
                s_weight.new_empty(0) if dw is None else dw)


@_distill_op.register_fake
def _distill_fake(s_hidden, s_weight, t_hidden, t_weight, labels, inv_temp, token_w, *, kind, beta, s_scale,
                  s_softcap, t_scale, t_softcap, backend, ignore_index, tp_group, reduce_grad_hidden, need_dh,
                  need_dw, check_inputs=True, precision="native", grad_precision="native", t_precision="native"):
    n = labels.shape[0]
    return (s_hidden.new_empty((), dtype=torch.float32), s_hidden.new_empty(n, dtype=torch.float32),
            s_hidden.new_empty(n, dtype=torch.float32), s_hidden.new_empty(s_hidden.shape if need_dh else (0,)),
            s_weight.new_empty(s_weight.shape if need_dw else (0,)))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.need = (keyword_only_inputs["need_dh"], keyword_only_inputs["need_dw"])
    ctx.save_for_backward(output[3], output[4])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)    # no zero-filled gradients of the outputs after the loss (function.py)
    ctx.handed_out = False


def _backward(ctx, g_loss, *_):
    grads = hand_out_gradients(ctx, g_loss, "fused_distillation_loss")
    return grads[0], grads[1], None, None, None, None, None


_distill_op.register_autograd(_backward, setup_context=_setup_context)


def fused_distillation_loss_op(student: Head, teacher: Head, labels: Tensor, inv_temp: Tensor, token_w: Tensor,
                               divergence: Divergence, *, backend: str, ignore_index: int, tp_group: Optional[str],
                               reduce_grad_hidden: bool, need_dh: bool, need_dw: bool, check_inputs: bool = True,
                               precisions: tuple = ("native", "native", "native")):
    """(loss, divergence [N], entropy [N]) of the op; hidden [N, H] of each head, labels / inv_temp / token_w
    [N], as checked by ``losses.distillation``; precisions: ``precisions()``'s."""
    def number(x: Optional[float]) -> float:
        return math.nan if x is None else float(x)
    out = torch.ops.logitless.fused_distillation_loss(
        student.hidden, student.weight, teacher.hidden, teacher.weight, labels, inv_temp, token_w,
        kind=divergence.kind, beta=number(divergence.beta), s_scale=float(student.transform.scale),
        s_softcap=number(student.transform.softcap), t_scale=float(teacher.transform.scale),
        t_softcap=number(teacher.transform.softcap), backend=backend, ignore_index=ignore_index,
        tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden, need_dh=need_dh, need_dw=need_dw,
        check_inputs=check_inputs, precision=precisions[0], grad_precision=precisions[1], t_precision=precisions[2])
    return out[:3]
