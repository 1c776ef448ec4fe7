"""The op as two ``torch.library`` custom ops, so that ``torch.compile(fullgraph=True)`` traces through it
(fake kernels give the output shapes; the real ones run opaquely) and autograd links them.

    logitless::fused_logprobs(hidden [N, H], weight [V_local, H], labels [N] int64, inv_temp [N] float32,
                              **options) -> (logprobs [N], entropy [N] or [0], lse [N]), float32
    logitless::fused_logprobs_backward(g_logprobs, g_entropy, hidden, weight, labels, inv_temp, lse, entropy,
                                       **options, need_dh, need_dw) -> (d_hidden [N, H] or [0], d_weight or [0])

forward:  local stats (backend, in token chunks) -> [combine across the vocab-parallel group] -> logprob, entropy
backward: backend grads from the saved global lse / entropy (in token chunks, each chunk's d_hidden
          all-reduced under tensor parallelism) -> d_hidden in the input dtype, d_weight
Saved between the two: the inputs and float32 [N] vectors (lse, entropy). Nothing [N x V]; lse is an
output only so that backward gets it (it is not differentiable).

With ``check_inputs`` (the default) the op validates labels, temperatures and the scored rows' hidden states
(finite), and rows whose label is
ignore_index never reach a backend: they cost nothing (prompt and padding tokens in RL batches), and a
non-finite hidden state there cannot leak into d_weight through 0 * inf. That needs host
synchronisations (one for the checks, one more to list the kept rows when some are ignored, again in
backward), all inside the op, so compiled callers see none. With ``check_inputs=False`` there are none:
every row is computed, ignored rows with no label and their outputs and gradient coefficients set to 0
(a non-finite hidden state on an ignored row is then NOT isolated: it reaches d_weight), which is what
CUDA-graph capture needs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from .. import checks
from ..record import record_backend
from . import token_chunks
from .maths import no_autocast, split_in_kernel, tf32_products
from .precision import IN_KERNEL, choose, kernel_operands, make_operands, public_name, splits_in_kernel
from .registry import load_backend

if TYPE_CHECKING:
    from ..parallel import VocabParallel


@dataclass(frozen=True)
class OpOptions:
    """What one call computes, besides its tensors (the custom ops' keyword arguments).

    backend: name of the backend that runs both stages ("reference", "chunked", "triton"; already chosen).
    with_entropy: also compute the entropy (else the op's entropy output is empty and None is returned).
    ignore_index: label value of rows that get logprob 0, entropy 0 and no gradient.
    softcap: None or c > 0, the tanh cap of the logits, applied per logit before the temperature.
    tp_group: None, or the ``group_name`` of the process group the weight's vocabulary rows are sharded over.
    reduce_grad_hidden: under ``tp_group``, all-reduce d_hidden in backward (else leave it partial).
    check_inputs: validate labels / temperatures and skip ignored rows (host synchronisations; see above).
    precision, grad_precision: how the products of float32 operands run, as ``precision.resolve`` returns them
    ("native" for half-precision operands); the split operands are made inside each op (``precision.py``).
    """
    backend: str
    with_entropy: bool
    ignore_index: int = -100
    softcap: Optional[float] = None
    tp_group: Optional[str] = None
    reduce_grad_hidden: bool = True
    check_inputs: bool = True
    precision: str = "native"
    grad_precision: str = "native"


def fused_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor,
                   options: OpOptions) -> tuple[Tensor, Optional[Tensor]]:
    """(logprobs [N], entropy [N] or None), float32, for hidden [N, H], weight [V_local, H], labels [N] int64
    (global ids or ignore_index), inv_temp [N] float32; differentiable w.r.t. hidden and weight."""
    lp, ent, _ = torch.ops.logitless.fused_logprobs(
        hidden, weight, labels, inv_temp, backend=options.backend, with_entropy=options.with_entropy,
        ignore_index=options.ignore_index, softcap=options.softcap, tp_group=options.tp_group,
        reduce_grad_hidden=options.reduce_grad_hidden, check_inputs=options.check_inputs,
        precision=options.precision, grad_precision=options.grad_precision)
    return lp, ent if options.with_entropy else None


# ------------------------------------------------------------------------------------------ helpers

def _layout(tp_group: Optional[str], weight: Tensor, reduce: bool) -> Optional["VocabParallel"]:
    """The vocab-parallel layout for the group named ``tp_group`` (None: no tensor parallelism). The first
    call per group and shard shape exchanges the shard sizes (a host synchronisation)."""
    if tp_group is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ..parallel import VocabParallel
    return VocabParallel.for_group(_resolve_process_group(tp_group), weight).with_reduce(reduce)


def _validate(labels: Tensor, valid: Tensor, inv_temp: Tensor, vocab: int, ignore_index: int,
              hidden: Tensor) -> bool:
    """Raise ValueError for a label outside [0, vocab) that is not ignore_index, a temperature outside
    the supported range (``checks.temperature``), or a non-finite hidden state in a scored row (its log-prob
    would be NaN and so would every entry of d_weight); return whether every row is kept. One host
    synchronisation for all four."""
    if labels.numel() == 0:
        return True
    bad_label = checks.labels_out_of_range(labels, valid, vocab).any()
    bad_temp = ~checks.inverse_temperature_ok(inv_temp)
    bad_hidden = checks.non_finite_rows(hidden, valid)
    bad_label, bad_temp, bad_hidden, every = torch.stack([bad_label, bad_temp, bad_hidden, valid.all()]).tolist()
    if bad_label:
        checks.check_label_range(labels, valid, vocab, ignore_index)
    if bad_temp:
        raise ValueError(f"{checks.TEMPERATURE_RULE} everywhere")
    if bad_hidden:
        raise ValueError(checks.NON_FINITE_HIDDEN)
    return bool(every)


def _kept_rows(labels: Tensor, inv_temp: Tensor, weight: Tensor, tp: Optional["VocabParallel"],
               ignore_index: int, check_inputs: bool, validate: bool, hidden: Tensor):
    """(valid [N] bool, rows int64 [n] or None for every row, local labels [N] int64): the label's row in
    this weight, -1 where the row is ignored or (under tensor parallelism) another rank holds it."""
    valid = labels != ignore_index
    rows = None
    if check_inputs:
        every = (_validate(labels, valid, inv_temp, tp.vocab_size if tp else weight.shape[0], ignore_index, hidden)
                 if validate else bool(valid.all()))
        if not every:
            rows = valid.nonzero().squeeze(1)
    offset = tp.vocab_offset if tp is not None else 0
    local = labels - offset
    here = valid & (local >= 0) & (local < weight.shape[0])
    return valid, rows, torch.where(here, local, torch.full_like(local, -1))


def _operands(mod, hidden: Tensor, weight: Tensor, precision: str, grad_precision: str, with_grad: bool = True):
    """A precision's operands (``precision.make_operands``); for the triton backend's split precisions the float32
    operands themselves, split in its kernels' registers (``precision.kernel_operands``: no split copy; unless
    LOGITLESS_SPLIT_IN_KERNEL=0)."""
    if precision in IN_KERNEL and splits_in_kernel(mod.name):
        return kernel_operands(hidden, weight, precision, grad_precision, with_grad=with_grad)
    return make_operands(hidden, weight, precision, grad_precision, with_grad=with_grad)


def _scatter(values: Tensor, rows: Tensor, n: int) -> Tensor:
    return values.new_zeros(n).index_copy_(0, rows, values)


# ------------------------------------------------------------------------------------------ forward op

@torch.library.custom_op("logitless::fused_logprobs", mutates_args=())
def _forward_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, *, backend: str,
                with_entropy: bool, ignore_index: int, softcap: Optional[float], tp_group: Optional[str],
                reduce_grad_hidden: bool, check_inputs: bool, precision: str = "native",
                grad_precision: str = "native") -> tuple[Tensor, Tensor, Tensor]:
    with no_autocast(hidden):
        return _forward(hidden, weight, labels, inv_temp, backend, with_entropy, ignore_index, softcap, tp_group,
                        reduce_grad_hidden, check_inputs, precision, grad_precision)


def _forward(hidden, weight, labels, inv_temp, backend, with_entropy, ignore_index, softcap, tp_group,
             reduce_grad_hidden, check_inputs, precision, grad_precision):
    mod = load_backend(backend)
    tp = _layout(tp_group, weight, reduce_grad_hidden)
    n = hidden.shape[0]
    valid, rows, local = _kept_rows(labels, inv_temp, weight, tp, ignore_index, check_inputs, validate=True,
                                    hidden=hidden)
    # the adaptive split's products (the operands tested inside the checks' synchronisation, or the caller's claim)
    precision, poison = choose(precision, hidden, weight, check_inputs, tp.group if tp is not None else None)
    if rows is not None:
        local, inv_temp = local[rows], inv_temp[rows]
    if local.shape[0] == 0:   # no scored tokens: no kernel launch
        lse = zy = torch.zeros(0, dtype=torch.float32, device=hidden.device)
        ent = lse if with_entropy else None
    else:
        # a precision's statistics operands (the split, made here and dropped after: never saved for backward)
        ops = _operands(mod, hidden, weight, precision, grad_precision, with_grad=False)
        h_stats, w_stats = (hidden, weight) if ops is None else (ops.hidden, ops.weight)
        with tf32_products(ops is not None and ops.tf32), split_in_kernel(ops.split if ops is not None else None):
            lse, ent, zy = token_chunks.stats(mod, h_stats, w_stats, local, inv_temp, rows, with_entropy, softcap)
        del ops, h_stats, w_stats
    if poison is not None:   # NaN where an unchecked call's bf16_exact claim is false (every rank's, under TP)
        lse = lse + poison
        ent = ent + poison if ent is not None else None
    if tp is not None:
        lse, ent, zy = tp.combine_stats(lse, ent, zy)
    lp = zy - lse
    if rows is not None:
        lp, lse = _scatter(lp, rows, n), _scatter(lse, rows, n)
        ent = _scatter(ent, rows, n) if with_entropy else None
    elif not check_inputs:
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lp = torch.where(valid, lp, zero)
        ent = torch.where(valid, ent, zero) if with_entropy else None
    elif lse is ent:   # the outputs must not alias each other
        ent = ent.clone()
    record_backend(mod.name, (public_name(precision), grad_precision), "fused_logprobs")
    return lp, ent if with_entropy else lp.new_empty(0), lse


@_forward_op.register_fake
def _forward_fake(hidden, weight, labels, inv_temp, *, backend, with_entropy, ignore_index, softcap, tp_group,
                  reduce_grad_hidden, check_inputs, precision="native", grad_precision="native"):
    n = hidden.shape[0]
    return (hidden.new_empty(n, dtype=torch.float32), hidden.new_empty(n if with_entropy else 0, dtype=torch.float32),
            hidden.new_empty(n, dtype=torch.float32))


# ------------------------------------------------------------------------------------------ backward op

@torch.library.custom_op("logitless::fused_logprobs_backward", mutates_args=())
def _backward_op(g_logprobs: Optional[Tensor], g_entropy: Optional[Tensor], hidden: Tensor, weight: Tensor,
                 labels: Tensor, inv_temp: Tensor, lse: Tensor, entropy: Tensor, *, backend: str, with_entropy: bool,
                 ignore_index: int, softcap: Optional[float], tp_group: Optional[str], reduce_grad_hidden: bool,
                 check_inputs: bool, need_dh: bool, need_dw: bool, precision: str = "native",
                 grad_precision: str = "native") -> tuple[Tensor, Tensor]:
    with no_autocast(hidden):
        return _backward_impl(g_logprobs, g_entropy, hidden, weight, labels, inv_temp, lse, entropy, backend,
                              with_entropy, ignore_index, softcap, tp_group, reduce_grad_hidden, check_inputs,
                              need_dh, need_dw, precision, grad_precision)


def _backward_impl(g_logprobs, g_entropy, hidden, weight, labels, inv_temp, lse, entropy, backend, with_entropy,
                   ignore_index, softcap, tp_group, reduce_grad_hidden, check_inputs, need_dh, need_dw, precision,
                   grad_precision):
    mod = load_backend(backend)
    tp = _layout(tp_group, weight, reduce_grad_hidden)
    valid, rows, local = _kept_rows(labels, inv_temp, weight, tp, ignore_index, check_inputs, validate=False,
                                    hidden=hidden)
    # contiguous: the gradient of a sum arrives as a stride-0 expand, and the kernels index [N] vectors densely
    g_lp = torch.zeros_like(lse) if g_logprobs is None else g_logprobs.float().contiguous()
    g_ent = g_entropy.float().contiguous() if with_entropy and g_entropy is not None else None
    ent = entropy if with_entropy else None
    if rows is not None:
        local, inv_temp, lse, g_lp = local[rows], inv_temp[rows], lse[rows], g_lp[rows]
        ent = ent[rows] if ent is not None else None
        g_ent = g_ent[rows] if g_ent is not None else None
    elif not check_inputs:
        # every row is computed: an ignored row's coefficients are 0, so its dlogits are 0 (for finite hidden)
        g_lp = torch.where(valid, g_lp, 0.0)
        g_ent = torch.where(valid, g_ent, 0.0) if g_ent is not None else None
    # the forward's products again (the same operands: the same choice)
    precision, poison = choose(precision, hidden, weight, check_inputs, tp.group if tp is not None else None)
    if poison is not None:
        g_lp = g_lp + poison
        g_ent = g_ent + poison if g_ent is not None else None
    finish = tp.reduce_grad_hidden if tp is not None else (lambda dh: dh)
    # the split again (forward and backward each make their own: nothing but hidden and weight is saved)
    ops = _operands(mod, hidden, weight, precision, grad_precision)
    with tf32_products(ops is not None and ops.tf32), split_in_kernel(ops.split if ops is not None else None):
        dh, dw = token_chunks.grads(mod, hidden, weight, local, inv_temp, lse, ent, g_lp, g_ent, rows, need_dh,
                                    need_dw, softcap, finish, operands=ops)
    return (dh if need_dh else hidden.new_empty(0)), (dw if need_dw else weight.new_empty(0))


@_backward_op.register_fake
def _backward_fake(g_logprobs, g_entropy, hidden, weight, labels, inv_temp, lse, entropy, *, backend, with_entropy,
                   ignore_index, softcap, tp_group, reduce_grad_hidden, check_inputs, need_dh, need_dw,
                   precision="native", grad_precision="native"):
    dh = hidden.new_empty(hidden.shape) if need_dh else hidden.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_dw else weight.new_empty(0)
    return dh, dw


# ------------------------------------------------------------------------------------------ autograd

def _setup_context(ctx, inputs, keyword_only_inputs, output):
    hidden, weight, labels, inv_temp = inputs
    _, entropy, lse = output
    ctx.save_for_backward(hidden, weight, labels, inv_temp, lse, entropy)
    ctx.options = keyword_only_inputs
    ctx.mark_non_differentiable(lse)
    if not keyword_only_inputs["with_entropy"]:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)   # an unused output's gradient stays None: no entropy term then


def _backward(ctx, g_logprobs, g_entropy, _g_lse):
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dh or need_dw):
        return None, None, None, None
    hidden, weight, labels, inv_temp, lse, entropy = ctx.saved_tensors
    opts = ctx.options
    dh, dw = torch.ops.logitless.fused_logprobs_backward(
        g_logprobs, g_entropy if opts["with_entropy"] else None, hidden, weight, labels, inv_temp, lse, entropy,
        **opts, need_dh=need_dh, need_dw=need_dw)
    return (dh if need_dh else None), (dw if need_dw else None), None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError("fused_logprobs is once-differentiable: second-order gradients (a backward through "
                       "its backward) are not supported")


def _no_context(ctx, inputs, keyword_only_inputs, output):
    pass


_backward_op.register_autograd(_refuse_double_backward, setup_context=_no_context)
