"""The public distillation loss, ``fused_distillation_loss``: a student's next-token distribution trained toward a
teacher's, from the student's last hidden states and LM-head weight, never building the logits.

Two families (docs/distillation.md defines each):
- full vocabulary, from the teacher's hidden states and head weight: "forward_kl", "reverse_kl", "jsd" (TRL's
  generalized JSD; ``ops/divergence_terms.py`` holds the one definition), through the custom op of
  ``distill_function.py`` (four GEMMs, gradients formed in the forward);
- top-k, from the teacher's top-k ids and log-probs: "forward_kl_topk" (verl's) and "forward_kl_topk_tail", in
  ``distill_topk.py``.

This module checks the arguments (TypeError / ValueError naming the argument, before any kernel runs), fixes the
per-token loss weights (``aggregate.py``'s loss_agg, TRL's ``num_items_in_batch``, an optional per-token weight)
and dispatches.
"""
from __future__ import annotations

import inspect
from numbers import Real
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from .. import checks
from ..api import check_head, inv_temperature, tp_group_name
from ..ops.distill_chunked import Head
from ..ops.divergence_terms import FULL_VOCAB_DIVERGENCES, TAKES_BETA, Divergence, HeadTransform
from .aggregate import check_agg_layout, check_cu_seqlens, check_loss_agg, cu_seqlens_error, token_weights
from .distill_function import checked_count, fused_distillation_loss_op, precisions
from .distill_topk import TOPK_DIVERGENCES, check_topk, clamp_loss, log_prob_clamp, topk_by_logprobs_k
from .distill_topk_function import one_pass_applies, topk_one_pass

DIVERGENCES = FULL_VOCAB_DIVERGENCES + TOPK_DIVERGENCES
DISTILLATION_BACKENDS = ("auto", "reference", "chunked", "triton")


class DistillationOutput(NamedTuple):
    """loss: 0-d float32, to be minimised, differentiable (once) to the student's hidden states and weight.
    divergence: float32 per token (the labels' shape), 0 where labels == ignore_index; detached.
    entropy: the student's entropy per token (full-vocabulary divergences; TRL logs its mean over the scored
        tokens as "entropy"), 0 where ignored; None for the top-k divergences.
    student_mass, teacher_mass: per token, the probability mass of the teacher's top-k ids under each model
        (verl's distillation/student_mass, teacher_mass); top-k divergences only, else None.
    overlap_count, overlap_token_advantage: per token, verl's top-k overlap diagnostics; top-k only, else None.
    metrics: detached 0-d float32 tensors under the trainers' names, over the scored tokens: "entropy" (the
        student's mean entropy, TRL's) for the full-vocabulary divergences; verl's "distillation/student_mass"
        (+ _min, _max), "distillation/teacher_mass" (+ _min, _max), "distillation/overlap_ratio",
        "distillation/overlap_token_advantage", "distillation/loss_min", "distillation/loss_max" for the top-k
        ones."""
    loss: Tensor
    divergence: Tensor
    entropy: Optional[Tensor] = None
    student_mass: Optional[Tensor] = None
    teacher_mass: Optional[Tensor] = None
    overlap_count: Optional[Tensor] = None
    overlap_token_advantage: Optional[Tensor] = None
    metrics: Optional[dict] = None


def _divergence(divergence, beta) -> Optional[Divergence]:
    """The checked divergence (None for a top-k one)."""
    if not isinstance(divergence, str):
        raise TypeError(f"divergence must be a str, got {type(divergence).__name__}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if divergence not in TAKES_BETA:
        if beta is not None:
            raise ValueError(f"beta is the mixture weight of divergence='jsd'; divergence={divergence!r} does not "
                             f"use it (got beta={beta!r}): leave it None")
    else:
        if beta is None:
            raise ValueError("divergence='jsd' needs beta in [0, 1] (TRL's generalized JSD: 0 is the forward KL, "
                             "1 the reverse KL)")
        if isinstance(beta, bool) or not isinstance(beta, Real):
            raise TypeError(f"beta must be a real number, got {type(beta).__name__}")
        beta = float(beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must lie in [0, 1], got {beta!r}")
    return Divergence.of(divergence, beta) if divergence in FULL_VOCAB_DIVERGENCES else None


def check_num_items(num_items_in_batch, loss_agg: str) -> None:
    """``num_items_in_batch`` only with token-mean, and as a number > 0 (a tensor's value is read with the op's
    other checks)."""
    if num_items_in_batch is None:
        return
    if loss_agg != "token-mean":
        raise ValueError(f"num_items_in_batch replaces token-mean's count of scored tokens (TRL's "
                         f"normalisation: sum / num_items_in_batch); loss_agg={loss_agg!r} does not use it")
    if not isinstance(num_items_in_batch, Tensor):
        checks.finite_float(num_items_in_batch, "num_items_in_batch", minimum=0.0, above=True)


def check_settings(divergence, beta, log_prob_min_clamp=None, loss_max_clamp=None) -> None:
    """The checks of ``fused_distillation_loss``'s settings that need no tensor (for callers that hold them
    before the student's forward, e.g. ``logitless.megatron.DistillationTarget``)."""
    _divergence(divergence, beta)
    log_prob_clamp(log_prob_min_clamp)
    if loss_max_clamp is not None:
        checks.finite_float(loss_max_clamp, "loss_max_clamp", minimum=0.0)


def _head(hidden, weight, labels, who: str) -> tuple[Tensor, Tensor]:
    """check_head's checks, its messages naming this head's arguments."""
    try:
        hidden, weight, _ = check_head(hidden, weight, labels)
    except (TypeError, ValueError) as exc:
        msg = str(exc).replace("hidden", f"{who}_hidden").replace("weight", f"{who}_weight")
        raise type(exc)(msg) from None
    return hidden, weight


def _logit_scale(value, name: str) -> float:
    # > 0, as topk_divergence's logit_scale: 0 makes every logit 0 (a uniform distribution, no gradient), a
    # negative scale turns the head's preferences upside down; no model's head scales that way
    return checks.finite_float(value, name, minimum=0.0, above=True)


def _softcap(value, name: str) -> Optional[float]:
    try:
        return checks.softcap(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(str(exc).replace("softcap", name)) from None


def _token_weights(labels: Tensor, ignore_index: int, loss_agg: str, cu_seqlens, num_items_in_batch,
                   token_weight, check_inputs: bool = True) -> Tensor:
    """float32 [N]: each token's weight in the loss (0 where ignored). check_inputs=False: cu_seqlens' values
    are not read on the host (not checked)."""
    valid = labels != ignore_index
    loss_agg = check_loss_agg(loss_agg)
    cu = None
    if cu_seqlens is not None:
        if loss_agg not in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
            raise ValueError(f"cu_seqlens delimits sequences for the sequence aggregations; loss_agg={loss_agg!r} "
                             "does not use them")
        cu, ok = check_cu_seqlens(cu_seqlens, labels)
        if check_inputs and not bool(ok):
            raise cu_seqlens_error(cu, labels.numel())
    check_agg_layout(labels, loss_agg, cu)
    if num_items_in_batch is not None:
        check_num_items(num_items_in_batch, loss_agg)
        if isinstance(num_items_in_batch, Tensor):
            count = checks.real_tensor(num_items_in_batch, "num_items_in_batch", device=labels.device, max_dim=0,
                                       check_values=False).double()
            if check_inputs:
                # the tensor TRL passes is checked as the number is (one host read; none without check_inputs)
                count = checked_count(count)
        else:
            count = float(num_items_in_batch)      # checked by check_num_items above
        w = valid.double() / count
    else:
        w = token_weights(valid, loss_agg, cu)
    if token_weight is not None:
        tw = checks.per_token_tensor(token_weight, "token_weight", labels)
        w = w * torch.where(valid, tw.double(), torch.zeros((), dtype=torch.float64, device=labels.device))
    return w.float().reshape(-1)


def _backend(backend, hidden: Tensor) -> str:
    """The backend that runs: "auto" takes "triton" for CUDA tensors where triton imports, else "chunked"."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend not in DISTILLATION_BACKENDS:
        raise ValueError(f"backend must be one of {DISTILLATION_BACKENDS}, got {backend!r}")
    if backend in ("auto", "triton"):
        try:
            from ..ops.triton.common import INTERPRETING
        except ImportError as exc:
            if backend == "triton":
                raise RuntimeError(f"backend 'triton' cannot be imported here: {exc}") from exc
            return "chunked"
        runs = hidden.is_cuda or INTERPRETING
        if backend == "triton" and not runs:
            raise RuntimeError(f"backend 'triton' runs on CUDA tensors (or under TRITON_INTERPRET=1); these are on "
                               f"{hidden.device}")
        if backend == "auto":
            return "triton" if hidden.is_cuda else "chunked"
    return backend


def fused_distillation_loss(student_hidden: Tensor, student_weight: Tensor, labels: Tensor, *,
                            divergence: str, teacher_hidden: Optional[Tensor] = None,
                            teacher_weight: Optional[Tensor] = None, teacher_topk_ids: Optional[Tensor] = None,
                            teacher_topk_logprobs: Optional[Tensor] = None, beta: Optional[float] = None,
                            temperature: Union[float, Tensor] = 1.0, loss_agg: str = "token-mean",
                            cu_seqlens: Optional[Tensor] = None,
                            num_items_in_batch: Union[None, float, Tensor] = None,
                            token_weight: Optional[Tensor] = None, student_logit_scale: float = 1.0,
                            teacher_logit_scale: float = 1.0, student_softcap: Optional[float] = None,
                            teacher_softcap: Optional[float] = None, ignore_index: int = -100, tp_group=None,
                            reduce_grad_hidden: bool = True, backend: str = "auto", check_inputs: bool = True,
                            precision: Optional[str] = None, grad_precision: Optional[str] = None,
                            **topk_settings) -> DistillationOutput:
    """The distillation loss straight from the LM heads, without the [tokens x vocab] logits.

    Args:
        student_hidden [..., H_s], student_weight [V, H_s], labels [...]: as ``hidden``, ``weight``, ``labels`` of
            ``logitless.fused_logprobs``; labels mark the scored tokens (label != ignore_index; their values are
            checked to lie in [0, V) but the full-vocabulary divergences do not otherwise read them).
        divergence: "forward_kl" KL(p_t || p_s), "reverse_kl" KL(p_s || p_t), "jsd" (TRL's generalized JSD with
            ``beta``), from ``teacher_hidden`` [..., H_t] and ``teacher_weight`` [V, H_t] (the same V; H and dtype
            may differ from the student's); or "forward_kl_topk" / "forward_kl_topk_tail" from
            ``teacher_topk_ids`` / ``teacher_topk_logprobs`` [..., k].
        beta: jsd's mixture weight in [0, 1] (0 = forward KL, 1 = reverse KL, TRL's ``beta``); None otherwise.
        temperature: a number, or a tensor per sequence [b, 1] or per token; divides both heads' logits for the
            full-vocabulary divergences (TRL's order: after the logit scale and softcap), the student's alone for
            the top-k ones (the teacher's log-probs are given). Not differentiated.
        loss_agg, cu_seqlens: the aggregations of ``fused_policy_loss`` (``LOSS_AGGS``).
        num_items_in_batch: TRL's normalisation: with loss_agg="token-mean", the loss is the sum of the scored
            tokens' divergences over this count (a number or 0-d tensor) instead of their mean; it must be finite
            and > 0 (ValueError naming it; a tensor's value is read on the host, not checked with
            check_inputs=False).
        token_weight: optional per-token (or per-sequence [b, 1]) weight multiplying each token's term; finite and
            >= 0 at every scored token (ValueError naming it; read with the op's other checks).
        student_logit_scale, teacher_logit_scale, student_softcap, teacher_softcap: each head's logits are
            softcap * tanh(scale * raw / softcap) (or scale * raw without softcap) before the temperature, as
            TRL's ``ChunkedDivergenceFunction`` takes them.
        ignore_index, tp_group, reduce_grad_hidden: as in ``fused_logprobs``; under ``tp_group`` both heads'
            weights are this rank's shard of the same vocabulary rows.
        backend: "auto" ("triton" on CUDA, else "chunked"), "triton" (cuBLAS products, the elementwise stages in
            three Triton kernels), "chunked" (the same pass in torch) or "reference" (every token's float32 logits at
            once, for tests). The top-k divergences take fused_logprobs' backends. ``logitless.last_backend()`` says
            which ran.
        check_inputs: True (default): labels, temperatures, per-token weights, cu_seqlens, the scored rows' hidden
            states (and the teacher's top-k ids and log-probs) are checked (ValueError) and only the scored tokens
            are computed: one host synchronisation (two on the top-k route), inside the ops. False: none at all
            (a whole step can be captured in a CUDA graph): nothing is checked, every row is computed, and the
            rows that are not scored get inverse temperature 1, weight 0 and outputs 0 (NaN padding in the
            per-token inputs there is harmless; a non-finite hidden state there reaches d_weight), as in
            ``fused_logprobs``.
        precision, grad_precision: how float32 operands are multiplied, as in ``logitless.fused_logprobs``
            (default: the three-product bfloat16 split on CUDA, IEEE float32 elsewhere): ``precision`` for the
            logits of every float32 head, ``grad_precision`` for the student's gradient products; an error for a
            setting with no effect (no float32 head, a half-precision student). ``logitless.last_precision()``
            says what ran. The top-k divergences: the student's products (its only head).
        topk_settings: the top-k divergences' settings (verl's clamps); refused for the full-vocabulary ones.

    Returns:
        ``DistillationOutput``. Gradients flow to the student's hidden states and weight only (the teacher's
        tensors get none), formed in the forward pass (handed out once by the backward).
    """
    div = _divergence(divergence, beta)
    ignore_index = checks.ignore_index(ignore_index)
    checks.reduce_grad_hidden(reduce_grad_hidden, tp_group)
    checks.boolean(check_inputs, "check_inputs")
    if div is None:
        for name, value in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
            if value is not None:
                raise ValueError(f"{name} is for the full-vocabulary divergences; divergence={divergence!r} "
                                 "takes teacher_topk_ids and teacher_topk_logprobs")
        return _topk(student_hidden, student_weight, labels, divergence, teacher_topk_ids, teacher_topk_logprobs,
                     temperature=temperature, loss_agg=loss_agg, cu_seqlens=cu_seqlens,
                     num_items_in_batch=num_items_in_batch, token_weight=token_weight,
                     student_logit_scale=student_logit_scale, student_softcap=student_softcap,
                     teacher_logit_scale=teacher_logit_scale, teacher_softcap=teacher_softcap,
                     ignore_index=ignore_index, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden,
                     backend=backend, check_inputs=check_inputs, settings=topk_settings, precision=precision,
                     grad_precision=grad_precision)
    if topk_settings:
        _refuse_settings(topk_settings, divergence)
    for name, value in (("teacher_topk_ids", teacher_topk_ids), ("teacher_topk_logprobs", teacher_topk_logprobs)):
        if value is not None:
            raise ValueError(f"{name} is for the top-k divergences; divergence={divergence!r} takes teacher_hidden "
                             "and teacher_weight")
    for name, value in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
        if value is None:
            raise ValueError(f"divergence={divergence!r} needs {name} (the teacher's full distribution)")
    labels = checks.index_tensor(labels, "labels")
    s_hidden, s_weight = _head(student_hidden, student_weight, labels, "student")
    t_hidden = checks.tensor(teacher_hidden, "teacher_hidden")
    t_weight = checks.tensor(teacher_weight, "teacher_weight")
    for name, t in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight)):
        if t.device != s_hidden.device:
            raise ValueError(f"{name} is on {t.device}, student_hidden on {s_hidden.device}: both heads must be on "
                             "one device")
    # under tp_group the op compares the two heads' shards on every rank alike (a refusal on some ranks only
    # would leave the others waiting in a collective)
    if tp_group is None and t_weight.dim() == 2 and t_weight.shape[0] != s_weight.shape[0]:
        raise ValueError(f"teacher_weight has {t_weight.shape[0]} vocabulary rows, student_weight "
                         f"{s_weight.shape[0]}: the two heads must share the vocabulary")
    t_hidden, t_weight = _head(t_hidden, t_weight, labels, "teacher")
    student = HeadTransform(_logit_scale(student_logit_scale, "student_logit_scale"),
                            _softcap(student_softcap, "student_softcap"))
    teacher = HeadTransform(_logit_scale(teacher_logit_scale, "teacher_logit_scale"),
                            _softcap(teacher_softcap, "teacher_softcap"))
    backend = _backend(backend, s_hidden)
    precision = precisions(precision, grad_precision, s_hidden, t_hidden)
    token_w = _token_weights(labels, ignore_index, loss_agg, cu_seqlens, num_items_in_batch, token_weight,
                             check_inputs)
    inv_temp = inv_temperature(temperature, labels, check_values=False)
    grad = torch.is_grad_enabled()
    loss, per_token, entropy = fused_distillation_loss_op(
        Head(s_hidden.reshape(-1, s_hidden.shape[-1]), s_weight, student),
        Head(t_hidden.detach().reshape(-1, t_hidden.shape[-1]), t_weight.detach(), teacher),
        labels.reshape(-1).long(), inv_temp, token_w, div, backend=backend, ignore_index=ignore_index,
        tp_group=tp_group_name(tp_group), reduce_grad_hidden=reduce_grad_hidden, check_inputs=check_inputs,
        need_dh=grad and s_hidden.requires_grad, need_dw=grad and s_weight.requires_grad, precisions=precision)
    valid = labels != ignore_index
    # TRL's logged entropy: the scored tokens' sum over their count (0 with none, as TRL logs it)
    mean_entropy = entropy.sum() / valid.sum().clamp_min(1)
    return DistillationOutput(loss, per_token.view(labels.shape), entropy.view(labels.shape),
                              metrics={"entropy": mean_entropy})


# the top-k divergences' own settings (verl's clamps), passed by name
TOPK_SETTINGS = ("log_prob_min_clamp", "loss_max_clamp", "with_overlap")
# fused_distillation_loss's named arguments (the suggestions for a misspelled one)
_ARGUMENTS = tuple(p for p in inspect.signature(fused_distillation_loss).parameters if p != "topk_settings")


def _refuse_settings(settings: dict, divergence: str) -> None:
    """TypeError for keywords that ``divergence`` does not take: a top-k setting given to a full-vocabulary
    divergence is said to be one; a misspelled name gets the suggestion every op gives."""
    full_vocab = divergence in FULL_VOCAB_DIVERGENCES
    misplaced = sorted(set(settings) & set(TOPK_SETTINGS)) if full_vocab else []
    if misplaced:
        raise TypeError(f"{', '.join(misplaced)} {'is' if len(misplaced) == 1 else 'are'} only for the top-k "
                        f"divergences {TOPK_DIVERGENCES} (verl's clamps); divergence={divergence!r} does not use "
                        f"{'it' if len(misplaced) == 1 else 'them'}")
    unknown = sorted(set(settings) - set(TOPK_SETTINGS))
    known = set(_ARGUMENTS) | (set() if full_vocab else set(TOPK_SETTINGS))
    hint = checks.did_you_mean(unknown[0], known) or f"fused_distillation_loss takes {sorted(known)}"
    raise TypeError(f"unknown argument(s) {', '.join(unknown)} for divergence={divergence!r}: {hint}")


def _topk(student_hidden, student_weight, labels, divergence, teacher_topk_ids, teacher_topk_logprobs, *,
          temperature, loss_agg, cu_seqlens, num_items_in_batch, token_weight, student_logit_scale, student_softcap,
          teacher_logit_scale, teacher_softcap, ignore_index, tp_group, reduce_grad_hidden, backend, check_inputs,
          settings, precision, grad_precision) -> DistillationOutput:
    """The top-k divergences: the per-token term of ``distill_topk.topk_divergence`` (verl's forward_kl_topk,
    its clamps and metrics; differentiable through the k-label log-probs), aggregated here."""
    if set(settings) - set(TOPK_SETTINGS):
        _refuse_settings(settings, divergence)
    for name, value in (("teacher_topk_ids", teacher_topk_ids), ("teacher_topk_logprobs", teacher_topk_logprobs)):
        if value is None:
            raise ValueError(f"divergence={divergence!r} needs {name} (the teacher's top-k)")
    for name, value, default in (("teacher_logit_scale", teacher_logit_scale, 1.0),
                                 ("teacher_softcap", teacher_softcap, None)):
        if not (value is default or value == default):
            raise ValueError(f"{name} has no effect on divergence={divergence!r} (the teacher's top-k log-probs "
                             f"are given; only the student's head takes a logit scale and softcap): leave it "
                             f"{default}")
    loss_max_clamp = settings.get("loss_max_clamp")
    if loss_max_clamp is not None:
        loss_max_clamp = checks.finite_float(loss_max_clamp, "loss_max_clamp", minimum=0.0)
    labels = checks.index_tensor(labels, "labels")
    token_w = _token_weights(labels, ignore_index, loss_agg, cu_seqlens, num_items_in_batch, token_weight,
                             check_inputs)
    if check_inputs and token_weight is not None and labels.numel():
        # the full-vocabulary route checks the weights in its op's host read; this route reads them here (one
        # more read, only with a token_weight)
        if bool((~checks.weight_ok(token_w) & (labels.reshape(-1) != ignore_index)).any()):
            raise ValueError(checks.TOKEN_WEIGHT_RULE)
    with_overlap = settings.get("with_overlap", True)
    x = check_topk(student_hidden, student_weight, labels, teacher_topk_ids, teacher_topk_logprobs,
                   divergence=divergence, temperature=temperature, ignore_index=ignore_index,
                   reduce_grad_hidden=reduce_grad_hidden, backend=backend, softcap=student_softcap,
                   log_prob_min_clamp=settings.get("log_prob_min_clamp"), with_overlap=with_overlap,
                   clamped_masses=False, check_inputs=check_inputs, logit_scale=checks.finite_float(
                       student_logit_scale, "student_logit_scale", minimum=0.0, above=True),
                   precision=precision, grad_precision=grad_precision)
    if one_pass_applies(divergence, x, tp_group, check_inputs):
        # the aggregation is known here: the gradients formed in the forward, three GEMMs (+ the overlap's
        # selection), ``distill_topk_function.py``
        loss, out = topk_one_pass(x, token_w, loss_max_clamp, with_overlap)
        d = clamp_loss(out.divergence, loss_max_clamp)
    else:
        out = topk_by_logprobs_k(x, divergence, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden,
                                 check_inputs=check_inputs, with_overlap=with_overlap, clamped_masses=False)
        # verl's distillation_loss: the terms clamped before the aggregation (its loss_min / loss_max metrics are
        # of the terms before)
        d = clamp_loss(out.divergence, loss_max_clamp)
        loss = (d.reshape(-1) * token_w).sum()
    stats = out.token_stats
    # with_overlap=False: no overlap diagnostics (None)
    return DistillationOutput(loss, d.detach(), None, stats["student_mass"], stats["teacher_mass"],
                              stats.get("overlap_count"), stats.get("overlap_token_advantage"), out.metrics)
