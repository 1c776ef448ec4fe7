"""verl's forward_kl_topk as ``fused_distillation_loss`` aggregates it, in one pass: the fused policy loss's
skeleton (``ops/policy_parts.py``: statistics, combine, dlogits, gradient products), three GEMMs, gradients formed
in the forward and handed out once by the backward (``function.hand_out_gradients``), as a ``torch.library``
custom op with a fake kernel:

    logitless::fused_topk_distillation(hidden [N, H], weight [V, H], ids [N, k] int64, t_lp [N, k] float32,
        inv_temp [N], token_w [N], *, backend, ignore_index, clamp, loss_max_clamp, select, need_dh, need_dw,
        precision, grad_precision)
        -> (loss 0-d, student log-probs at the ids [N, k], the student's own top ids [N, select] or [N, 0],
            d_hidden or [0], d_weight or [0])

The aggregation is known (the tokens' weights, verl's clamps), so each chunk of scored tokens is finished in the
pass: the backend's statistics of the student over its vocabulary (lse), the ids' logits by the gathered product
of ``fused_logprobs_k`` (``label_set_function.id_logits``), s_i = z_i - lse, the per-token term of
``distill_topk`` (``topk_terms`` / ``forward_kl_topk_term`` / ``clamp_loss``, times the token weight) and its
gradient g_i = dL/ds_i by torch.autograd on the [c, k] log-probs, G = sum_i g_i. The pass's dlogits stage with no
label and g_lp = G writes -G p_j / T everywhere; the k ids' entries are then overwritten (``set_dlogits``) by
c_i / T, c_i = g_i - G exp(s_i) (``tail_backward.terms`` with no tail), computed in float32: never a correction
added to a rounded -G p_i. Then d_hidden and d_weight by the pass's products.

The overlap diagnostics need the student's own top k (ties to the lower id). On the triton backend, where the
selection kernels take this k, they come from the statistics' GEMM itself: the selection kernel also writes the
pass's statistics and e (``label_set_function.selecting_stats``, ``triton/topk_select.select_with_stats``; with
gradients). Elsewhere (the torch backends, a k the kernels do not take, no gradient wanted, or
LOGITLESS_TOPK_DISTILL_SELECTION=separate) ``label_set_function.top_ids`` selects them first (the selection of
``fused_logprobs_k(select=k)``): one more product of the logits in the same forward. The metrics are
``distill_topk.finish_topk``'s, from the op's log-probs.

Scope (``one_pass_applies``): "forward_kl_topk" without tensor parallelism, without a softcap (the policy pass has
no softcap stage: its kernels read the products times the inverse temperature), with check_inputs (an unchecked
call may repeat an id within a token, which the overwrite cannot take, and must not read the ids on the host),
half-precision or IEEE float32 products (a split precision's products run on the other route, whose passes take
them). Everything else takes ``distill_topk.topk_divergence``'s route (the tail divergence sums the mass outside the ids
in its own pass).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..ops import label_set_function, label_sets, tail_backward
from ..ops.maths import autograd_inside_custom_op, no_autocast, tf32_products
from ..ops.policy import policy_pass_for
from ..record import record_backend
from .distill_topk import TopKDivergence, TopKInputs, clamp_loss, finish_topk, forward_kl_topk_term, topk_terms
from .function import hand_out_gradients

# the backends with a policy pass
ONE_PASS_BACKENDS = ("reference", "chunked", "triton")


def one_pass_applies(divergence: str, x: TopKInputs, tp_group, check_inputs: bool) -> bool:
    """Whether ``fused_distillation_loss`` takes the one-pass route (module docstring: its scope)."""
    return (divergence == "forward_kl_topk" and tp_group is None and x.softcap is None and check_inputs
            and x.backend in ONE_PASS_BACKENDS and x.precision in (("native", "native"), ("ieee", "ieee")))


def _none_if_nan(x: float) -> Optional[float]:
    return None if math.isnan(x) else x


@torch.library.custom_op("logitless::fused_topk_distillation", mutates_args=())
def _topk_distill_op(hidden: Tensor, weight: Tensor, ids: Tensor, t_lp: Tensor, inv_temp: Tensor, token_w: Tensor,
                     *, backend: str, ignore_index: int, clamp: float, loss_max_clamp: float, select: int,
                     need_dh: bool, need_dw: bool, precision: str = "native", grad_precision: str = "native"
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(hidden):
        return _forward(hidden, weight, ids, t_lp, inv_temp, token_w, backend, ignore_index, _none_if_nan(clamp),
                        _none_if_nan(loss_max_clamp), select, need_dh, need_dw, (precision, grad_precision))


def _forward(hidden, weight, ids, t_lp, inv_temp, token_w, backend, ignore_index, clamp, loss_max_clamp, select,
             need_dh, need_dw, precision):
    N, k = ids.shape
    vocab, dev = weight.shape[0], hidden.device
    # the checks of fused_logprobs_k's forward (ids in range, none repeated within a token, the temperatures),
    # with its messages; one host read
    every = label_set_function.validate_sets(ids, inv_temp, vocab, ignore_index, "teacher_topk_ids")
    valid = ids[:, 0] != ignore_index
    rows = None if every else valid.nonzero().squeeze(1)

    def pick(t: Tensor) -> Tensor:
        return t if rows is None else t.index_select(0, rows)
    h, it, local, q, w = pick(hidden).contiguous(), pick(inv_temp).contiguous(), pick(ids), pick(t_lp), pick(token_w)
    n = local.shape[0]
    top = None
    with_grad = need_dh or need_dw
    # the triton pass selects the top k in its statistics' GEMM where the selection kernels take this k (with
    # gradients: a chunk of the pass is the workspace's, not the larger statistics-only one); else a selection
    # pass of its own first
    stage = label_set_function.selecting_stats(backend, select, h, weight) if select and n and with_grad else None
    if select and n and stage is None:
        top = label_set_function.top_ids(hidden, weight, it, rows, select, backend, precision)
    f32 = dict(dtype=torch.float32, device=dev)
    s_lp = torch.zeros((n, k), **f32)
    at_ids = torch.zeros((n, k), **f32)        # the dlogits at the ids, c_i / T
    losses = []

    def combine(start: int, stop: int, lse: Tensor, ent, zy) -> tuple[Tensor, Tensor, Tensor, None]:
        loc, it_c = local[start:stop], it[start:stop]
        s = label_set_function.id_logits(h[start:stop], weight, loc, it_c, backend) - lse.unsqueeze(1)
        if not with_grad:
            d = forward_kl_topk_term(topk_terms(s, q[start:stop], clamp))
            losses.append((clamp_loss(d, loss_max_clamp) * w[start:stop]).sum())
            s_lp[start:stop] = s
            return lse, ent, torch.zeros_like(lse), None
        with autograd_inside_custom_op():
            sg = s.detach().requires_grad_(True)
            d = forward_kl_topk_term(topk_terms(sg, q[start:stop], clamp))
            loss = (clamp_loss(d, loss_max_clamp) * w[start:stop]).sum()
            g, = torch.autograd.grad(loss, sg)
        losses.append(loss.detach())
        s_lp[start:stop] = s
        no_tail = torch.full_like(lse, float("-inf"))
        terms, G = tail_backward.terms(loc, lse, no_tail, s, g, None)
        at_ids[start:stop] = label_sets.onehot_coefficients(terms.at_ids, s, it_c, None, loc)
        return lse, ent, G, None

    def set_at_ids(start: int, stop: int, dl: Tensor) -> None:
        # overwrite, in the dlogits' dtype, the values formed in float32 (no id repeats: validate_sets)
        dl.scatter_(1, local[start:stop], at_ids[start:stop].to(dl.dtype))

    dh = torch.empty((n, hidden.shape[1]), dtype=hidden.dtype, device=dev) if need_dh else None
    dw = (torch.zeros if n == 0 else torch.empty)(weight.shape, dtype=weight.dtype, device=dev) if need_dw else None
    if n:
        with tf32_products(False):
            policy_pass_for(backend)(h, weight, torch.full((n,), -1, dtype=torch.int64, device=dev), it, combine,
                                     dh, dw, set_dlogits=set_at_ids,
                                     **({} if stage is None else {"stats_stage": stage}))
        if stage is not None:
            top = stage.ids
    loss = torch.stack(losses).sum() if losses else torch.zeros((), **f32)
    record_backend(backend, precision, "fused_distillation_loss")
    if rows is not None:
        s_lp = s_lp.new_zeros((N, k)).index_copy_(0, rows, s_lp)
        if dh is not None:
            dh = dh.new_zeros(hidden.shape).index_copy_(0, rows, dh)
    top_out = torch.full((N, select), -1, dtype=torch.int64, device=dev)
    if top is not None:
        top_out = top if rows is None else top_out.index_copy_(0, rows, top)
    return (loss, s_lp, top_out, hidden.new_empty(0) if dh is None else dh,
            weight.new_empty(0) if dw is None else dw)


@_topk_distill_op.register_fake
def _topk_distill_fake(hidden, weight, ids, t_lp, inv_temp, token_w, *, backend, ignore_index, clamp, loss_max_clamp,
                       select, need_dh, need_dw, precision="native", grad_precision="native"):
    n, k = ids.shape
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty((n, k), dtype=torch.float32),
            hidden.new_empty((n, select), dtype=torch.int64), hidden.new_empty(hidden.shape if need_dh else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.need = (keyword_only_inputs["need_dh"], keyword_only_inputs["need_dw"])
    ctx.save_for_backward(output[3], output[4])
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.handed_out = False


def _backward(ctx, g_loss, *_):
    grads = hand_out_gradients(ctx, g_loss, "fused_distillation_loss")
    return grads[0], grads[1], None, None, None, None


_topk_distill_op.register_autograd(_backward, setup_context=_setup_context)


def topk_one_pass(x: TopKInputs, token_w: Tensor, loss_max_clamp: Optional[float], with_overlap: bool
                  ) -> tuple[Tensor, TopKDivergence]:
    """(loss 0-d, the per-token divergence before ``loss_max_clamp`` with verl's metrics and token stats) of
    "forward_kl_topk" by the one-pass op; x: ``distill_topk.check_topk``'s inputs, token_w [N] float32 the
    tokens' loss weights (0 where not scored)."""
    hidden = x.hidden.reshape(-1, x.hidden.shape[-1])
    k = x.ids.shape[-1]
    grad = torch.is_grad_enabled()
    loss, s_lp, top, _, _ = torch.ops.logitless.fused_topk_distillation(
        hidden, x.weight, x.ids.reshape(-1, k), x.t_lp.reshape(-1, k), x.inv_temp, token_w,
        backend=x.backend, ignore_index=x.ignore_index, clamp=math.nan if x.clamp is None else x.clamp,
        loss_max_clamp=math.nan if loss_max_clamp is None else float(loss_max_clamp),
        select=k if with_overlap else 0, need_dh=grad and hidden.requires_grad,
        need_dw=grad and x.weight.requires_grad, precision=x.precision[0], grad_precision=x.precision[1])
    out = finish_topk(s_lp.view(x.ids.shape), x, None, top if with_overlap else None, with_tail=False,
                      clamped_masses=False)
    return loss, out
