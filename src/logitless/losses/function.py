"""The fused policy loss as a ``torch.library`` custom op: gradients formed in the forward, handed out in
backward. A custom op (with a fake kernel for the output shapes) so that ``torch.compile(fullgraph=True)``
traces a function calling it without a break: every host synchronisation (the checks, the count of scored
tokens) happens inside the op, out of the tracer's sight.

    logitless::fused_policy_loss(hidden [N, H], weight [V_local, H], labels [...] int, inv_temp [...] float32,
                                 inputs: the PolicyLoss's tensors, **settings, need_dh, need_dw)
        -> (loss 0-d, logprobs [...], entropy [...], clip_fraction 0-d, kl 0-d, d_hidden [N, H] or [0],
            d_weight [V_local, H] or [0])
    logitless::scale_by_upstream_(grad, g): grad *= g in place (g 0-d)

forward: the checks and the scored tokens (``tokens.py``), then one fused pass (``logitless.ops.policy_parts``)
over them computes their log-probs and entropies, the loss sum_i w_i f_i, its metrics, and d_hidden /
d_weight of the loss (only those asked for: ``need_dh`` / ``need_dw``, which the caller derives from
requires_grad and the grad mode; without either, under no_grad or inference_mode, only the statistics and
the loss's value are computed: no gradient buffer, no gradient GEMM, no autograd).
backward: scales those buffers in place by the upstream gradient of the loss (the loss is 0-d; on CUDA the
factor is read by a kernel, so the backward does not wait for the GPU) and returns them. They exist once: a
second backward through the same loss raises RuntimeError (call the loss again instead). Gradient
accumulation over micro-batches works as usual: every call has its own buffers and autograd adds them into
``.grad``.

The op runs with autocast off (its operands were cast at the entry, as F.linear's would be).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import Tensor

from ..ops.function import _layout
from ..ops.maths import autograd_inside_custom_op, no_autocast, split_in_kernel, tf32_products
from ..ops.policy import policy_pass_for, policy_terms_for
from ..ops.policy_parts import scale_by_upstream
from ..ops.policy_terms import TermSpec, TermTotals, chunk_gradients, weighted_terms
from ..ops.precision import IN_KERNEL, choose, kernel_operands, make_operands, public_name, splits_in_kernel
from ..ops.registry import load_backend
from ..record import record_backend
from .policy import PolicyLoss
from .tokens import ScoredTokens, score_tokens

if TYPE_CHECKING:
    from ..parallel import VocabParallel


# ------------------------------------------------------------------------- PolicyLoss <-> op arguments
# A custom op takes tensors, numbers and strings, not a PolicyLoss: its fields travel by kind, in the order of
# its definition (so a field added to PolicyLoss travels without a change here). Numbers (float, int, bool
# fields, by their annotation) travel as floats, None as NaN (PolicyLoss refuses NaN values); strings (str and
# Optional[str] fields, None as a marker no setting equals) joined by a separator no setting contains.
_FIELDS = dataclasses.fields(PolicyLoss)
_TENSORS = tuple(f.name for f in _FIELDS if "Tensor" in str(f.type))
_STRINGS = tuple(f.name for f in _FIELDS if str(f.type) in ("str", "Optional[str]"))
_NUMBERS = tuple(f.name for f in _FIELDS if f.name not in _TENSORS and f.name not in _STRINGS)
_SEPARATOR = "\x1f"
_NONE = "\x1e"


def pack_policy(policy: PolicyLoss) -> tuple[list, list, str]:
    """(tensors, numbers, strings): the op's arguments for ``policy``."""
    tensors = [getattr(policy, name) for name in _TENSORS]
    numbers = [math.nan if getattr(policy, name) is None else float(getattr(policy, name)) for name in _NUMBERS]
    strings = (_NONE if getattr(policy, name) is None else getattr(policy, name) for name in _STRINGS)
    return tensors, numbers, _SEPARATOR.join(strings)


_NUMBER_TYPES = {f.name: {"bool": bool, "int": int}.get(str(f.type), float) for f in _FIELDS if f.name in _NUMBERS}


def unpack_policy(tensors: list, numbers: list, strings: str) -> PolicyLoss:
    fields = dict(zip(_TENSORS, tensors, strict=True))
    fields.update((name, None if math.isnan(v) else _NUMBER_TYPES[name](v))
                  for name, v in zip(_NUMBERS, numbers, strict=True))
    fields.update((name, None if v == _NONE else v)
                  for name, v in zip(_STRINGS, strings.split(_SEPARATOR), strict=True))
    return PolicyLoss(**fields)


# ------------------------------------------------------------------------------------------ the pass

@dataclass(frozen=True)
class PassOptions:
    """How the pass runs: the backend's ``policy_pass`` and its kernel for the per-token terms (None: torch
    autograd over ``policy_terms.py``), the vocab-parallel layout (None: whole vocabulary here), and which
    gradients to form."""
    policy_pass: Callable
    terms: Optional[ModuleType]
    tp: Optional["VocabParallel"]
    need_dh: bool
    need_dw: bool
    bounds: Optional[list] = None     # the chunks' boundaries when groups of tokens must stay whole
    precision: tuple = ("native", "native")   # (statistics, gradients): ``ops/precision.py``
    # the backend's kernels split float32 tiles in registers (triton): the split precisions make no split copy
    in_kernel: bool = False


@functools.lru_cache(maxsize=64)
def _settings(terms: ModuleType, spec: TermSpec, device: torch.device):
    """The terms kernel's settings (a small device tensor), made once per spec and device: a later call makes
    no host-to-device copy, which CUDA-graph capture could not replay safely."""
    return terms.TermSettings.make(spec, device)


class _Chunks:
    """The ``combine`` callback of the pass: per chunk, the global statistics, the log-probs and the loss
    gradients of its tokens (only its value when no gradient is formed); it keeps the per-token outputs
    and the running sums."""

    def __init__(self, tokens: ScoredTokens, spec: TermSpec, options: PassOptions, device):
        self.tokens, self.spec, self.tp, self.terms, self.device = tokens, spec, options.tp, options.terms, device
        self.with_grad = options.need_dh or options.need_dw

    # The outputs, the sums and the terms kernel's settings (an allocation, a fill and a copy to the device)
    # are made on first use: in the first chunk's callback, once its statistics kernel is queued, not before
    # it while the GPU waits.
    @cached_property
    def out(self) -> Tensor:
        """float32 [2, n]: the log-probs and entropies (the chunks cover all n rows and each writes its
        own: no fill)."""
        return torch.empty((2, self.tokens.count), dtype=torch.float32, device=self.device)

    @cached_property
    def totals(self) -> TermTotals:
        return TermTotals.zeros(self.device, with_kl=self.spec.has_ref)

    def __call__(self, start: int, stop: int, lse: Tensor, ent: Tensor, zy: Tensor):
        if self.tp is not None:
            lse, ent, zy = self.tp.combine_stats(lse, ent, zy)
        lp = zy - lse
        self.out[0, start:stop] = lp
        self.out[1, start:stop] = ent
        inputs = self.tokens.inputs.rows(start, stop)
        if self.terms is not None:
            g_lp, g_ent = self.terms.chunk_terms(lp, ent, inputs, _settings(self.terms, self.spec, lp.device),
                                                 self.totals.sums)
        elif self.with_grad:
            with autograd_inside_custom_op():
                g_lp, g_ent = chunk_gradients(lp, ent, inputs, self.spec, self.totals)
        else:   # the value only: no autograd (inference_mode allows none)
            loss, clipped, kl = weighted_terms(lp.double(), ent.double(), inputs, self.spec)
            self.totals.loss.add_(loss)
            self.totals.clipped.add_(clipped)
            if kl is not None:
                self.totals.kl.add_(kl)
            g_lp = g_ent = None
        return lse, ent, g_lp, g_ent


def _operands(h: Tensor, weight: Tensor, options: PassOptions, with_grad: bool):
    """A precision's operands of the scored rows, made here and dropped with the pass: on the triton backend the
    split precisions' float32 operands themselves, split in the kernels' registers, and the gradient products'
    bfloat16 parts (hidden's [n, H] once, the weight's per block of rows: ``precision.kernel_operands``); else the
    concatenated split (``precision.make_operands``: [V, kH] bfloat16)."""
    precision, grad_precision = options.precision
    if options.in_kernel and precision in IN_KERNEL:
        return kernel_operands(h, weight, precision, grad_precision, with_grad=with_grad)
    return make_operands(h, weight, precision, grad_precision, with_grad=with_grad)


def run_pass(hidden: Tensor, weight: Tensor, tokens: ScoredTokens, spec: TermSpec, options: PassOptions):
    """hidden [N, H] (every row; only ``tokens.rows`` are scored), weight [V_local, H].
    Returns (loss 0-d, logprobs [N], entropy [N], clipped count 0-d, weighted kl 0-d or 0) float32, and
    (d_hidden [N, H] hidden.dtype or None, d_weight or None) of the loss."""
    tp = options.tp
    dev = hidden.device
    h = hidden if tokens.rows is None else hidden.index_select(0, tokens.rows)
    # the labels lie in the vocabulary (or are -1 in an unchecked call); a shard's own ids, -1 for the others'
    local = tokens.labels
    if tp is not None:
        local = local - tp.vocab_offset
        local = torch.where((local >= 0) & (local < weight.shape[0]), local, torch.full_like(local, -1))

    n, k = h.shape
    dh = None
    if options.need_dh:
        # under tensor parallelism d_hidden is a partial sum: keep it float32 until it is reduced
        dh = torch.empty((n, k), dtype=torch.float32 if tp is not None else hidden.dtype, device=dev)
    dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if options.need_dw else None
    chunks = _Chunks(tokens, spec, options, dev)
    if n:
        plan_vocab = max(tp.sizes) if tp is not None else weight.shape[0]
        cut = {} if options.bounds is None else {"bounds": options.bounds}
        ops = _operands(h, weight, options, with_grad=dh is not None or dw is not None)
        if ops is not None:
            cut["grad_operands"] = ops.grad
        h_stats, w_stats = (h, weight) if ops is None else (ops.hidden, ops.weight)
        with tf32_products(ops is not None and ops.tf32), split_in_kernel(ops.split if ops is not None else None):
            options.policy_pass(h_stats, w_stats, local, tokens.inv_temp, chunks, dh, dw, plan_vocab=plan_vocab,
                                **cut)
        del ops, h_stats, w_stats
    else:
        if dh is not None:
            dh.zero_()
        if dw is not None:
            dw.zero_()
    if dh is not None:
        if tp is not None:
            dh = tp.reduce_grad_hidden(dh)
        if tokens.rows is not None:
            dh = torch.zeros(hidden.shape, dtype=dh.dtype, device=dev).index_copy_(0, tokens.rows, dh)
        dh = dh.to(hidden.dtype)

    totals = chunks.totals
    loss = totals.loss.float()
    logprobs, entropy = tokens.scatter(chunks.out[0]), tokens.scatter(chunks.out[1])
    clipped = totals.clipped.float()
    kl = totals.kl.float() if totals.kl is not None else torch.zeros((), device=dev)
    return (loss, logprobs, entropy, clipped, kl), (dh, dw)


# ------------------------------------------------------------------------------------------ the ops

@torch.library.custom_op("logitless::fused_policy_loss", mutates_args=())
def _policy_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, inputs: list[Optional[Tensor]], *,
               numbers: list[float], strings: str, backend: str, ignore_index: int, tp_group: Optional[str],
               reduce_grad_hidden: bool, seq_first: bool, check_inputs: bool, need_dh: bool, need_dw: bool,
               bounds: Optional[list[int]] = None, precision: str = "native",
               grad_precision: str = "native") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    with no_autocast(hidden):
        policy = unpack_policy(inputs, numbers, strings)
        mod = load_backend(backend)
        tp = _layout(tp_group, weight, reduce_grad_hidden)
        tokens = score_tokens(labels, policy, inv_temp=inv_temp, ignore_index=ignore_index,
                              vocab=tp.vocab_size if tp is not None else weight.shape[0], seq_first=seq_first,
                              check_inputs=check_inputs, hidden=hidden)
        spec = policy.term_spec()
        # the adaptive split's products (``precision.choose``); poison: NaN for an unchecked call's false claim
        precision, poison = choose(precision, hidden, weight, check_inputs, tp.group if tp is not None else None)
        options = PassOptions(policy_pass=policy_pass_for(mod.name), terms=policy_terms_for(mod.name, spec), tp=tp,
                              need_dh=need_dh, need_dw=need_dw, bounds=bounds,
                              precision=(precision, grad_precision),
                              in_kernel=splits_in_kernel(mod.name))
        (loss, lp, ent, clipped, kl), (dh, dw) = run_pass(hidden, weight, tokens, spec, options)
        if poison is not None:
            loss, lp, ent = loss + poison, lp + poison, ent + poison
            dh = dh + poison if dh is not None else None
            dw = dw + poison if dw is not None else None
        record_backend(mod.name, (public_name(precision), grad_precision), "fused_policy_loss")

        def shaped(x: Tensor) -> Tensor:     # a fresh tensor in the labels' layout (outputs may not alias)
            x = x.view(tokens.row_shape)
            return x.t().contiguous() if seq_first else x.clone()
        return (loss, shaped(lp), shaped(ent), tokens.share(clipped), kl,
                hidden.new_empty(0) if dh is None else dh, weight.new_empty(0) if dw is None else dw)


@_policy_op.register_fake
def _policy_fake(hidden, weight, labels, inv_temp, inputs, *, numbers, strings, backend, ignore_index, tp_group,
                 reduce_grad_hidden, seq_first, check_inputs, need_dh, need_dw, bounds=None, precision="native",
                 grad_precision="native"):
    def scalar():
        return hidden.new_empty((), dtype=torch.float32)
    return (scalar(), hidden.new_empty(labels.shape, dtype=torch.float32),
            hidden.new_empty(labels.shape, dtype=torch.float32), scalar(), scalar(),
            hidden.new_empty(hidden.shape if need_dh else (0,)), weight.new_empty(weight.shape if need_dw else (0,)))


@torch.library.custom_op("logitless::scale_by_upstream_", mutates_args=("grad",))
def _scale_op(grad: Tensor, g: Tensor) -> None:
    scale_by_upstream(grad, g)


@_scale_op.register_fake
def _scale_fake(grad, g):
    return None


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.need = (keyword_only_inputs["need_dh"], keyword_only_inputs["need_dw"])
    # the gradient of the list input: torch.library takes a list holding a None as one leaf (gradient None),
    # a list of tensors as one leaf per tensor
    listed = inputs[4]
    ctx.no_grad_of_list = None if any(t is None for t in listed) else [None] * len(listed)
    ctx.save_for_backward(output[5], output[6])
    ctx.mark_non_differentiable(*output[1:])
    # the outputs after the loss get no gradient: left None, not materialised (zeros the size of d_weight and
    # d_hidden, which the saved gradients are outputs too, a fill of each in every backward)
    ctx.set_materialize_grads(False)
    ctx.handed_out = False


def hand_out_gradients(ctx, g_loss, op_name: str) -> list:
    """The backward of a loss whose (d_hidden, d_weight) were formed in its forward and saved (``ctx.saved_tensors``,
    ``ctx.need``, ``ctx.handed_out``): each needed one scaled in place by the upstream gradient, once; a second
    backward is a RuntimeError. Shared by the fused policy loss and the fused distillation loss."""
    if ctx.handed_out:
        raise RuntimeError(f"{op_name}: a second backward through the same loss. Its gradients are "
                           f"formed in the forward and handed out once; call {op_name} again")
    ctx.handed_out = True
    if g_loss is None:      # no gradient reached the loss (``set_materialize_grads(False)``): none for the inputs
        return [None, None]
    grads = []
    for g, needed in zip(ctx.saved_tensors, ctx.need, strict=True):
        if needed:     # in place: no second gradient-sized buffer
            torch.ops.logitless.scale_by_upstream_(g, g_loss)
        grads.append(g if needed else None)
    return grads


def _backward(ctx, g_loss, *_):
    grads = hand_out_gradients(ctx, g_loss, "fused_policy_loss")
    return grads[0], grads[1], None, None, ctx.no_grad_of_list


_policy_op.register_autograd(_backward, setup_context=_setup_context)


def fused_policy_loss_op(hidden: Tensor, weight: Tensor, labels: Tensor, inv_temp: Tensor, policy: PolicyLoss, *,
                         backend: str, ignore_index: int, tp_group: Optional[str], reduce_grad_hidden: bool,
                         seq_first: bool, check_inputs: bool, need_dh: bool, need_dw: bool,
                         bounds: Optional[list] = None, precision: str = "native", grad_precision: str = "native"):
    """(loss, logprobs, entropy, clip_fraction, kl) of the op; hidden [N, H] in the rows' order, labels and
    inv_temp (float32) in the labels' layout; the arguments as checked by ``losses.api``. bounds: the chunks'
    boundaries among the scored tokens (a sequence-coupled loss: ``api._sequence_bounds``), or None.
    precision, grad_precision: as ``ops.precision.resolve`` returns them."""
    tensors, numbers, strings = pack_policy(policy)
    out = torch.ops.logitless.fused_policy_loss(
        hidden, weight, labels, inv_temp, tensors, numbers=numbers, strings=strings, backend=backend,
        ignore_index=ignore_index, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden, seq_first=seq_first,
        check_inputs=check_inputs, need_dh=need_dh, need_dw=need_dw, bounds=bounds, precision=precision,
        grad_precision=grad_precision)
    return out[:5]
