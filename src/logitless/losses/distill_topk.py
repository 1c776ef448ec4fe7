"""Top-k distillation divergences: the student, from its hidden states and LM head, against a teacher's top-k ids
and log-probs. One definition of each term, read by every caller.

Contract (what ``logitless.losses.fused_distillation_loss`` calls)::

    topk_divergence(student_hidden [..., H], student_weight [V, H], labels [...], teacher_topk_ids [..., k],
                    teacher_topk_logprobs [..., k], *, divergence="forward_kl_topk", temperature=1.0,
                    ignore_index=-100, tp_group=None, reduce_grad_hidden=True, backend="auto", softcap=None,
                    log_prob_min_clamp=None, with_overlap=True, clamped_masses=False, check_inputs=True,
                    logit_scale=1.0, precision=None, grad_precision=None)
                    -> TopKDivergence(divergence, metrics, token_stats)

- ``labels`` only marks the scored tokens (``labels != ignore_index``); the teacher's ids and log-probs of the
  other tokens are never read (padding may hold anything).
- ``divergence`` [...] float32, differentiable w.r.t. student_hidden and student_weight (those that require grad),
  0 on unscored tokens. Aggregation (token-mean, ...) is the caller's.
- ``metrics``: detached 0-d float32 tensors under verl's names, over the scored tokens:
  ``distillation/student_mass`` (+ ``_min``, ``_max``), ``distillation/teacher_mass`` (+ ``_min``, ``_max``),
  ``distillation/overlap_ratio``, ``distillation/overlap_token_advantage``, ``distillation/loss_min`` and
  ``distillation/loss_max`` (the range of ``divergence``, before any ``loss_max_clamp`` of the caller). With no
  scored token the means are NaN, the minima +inf and the maxima -inf; overlap_token_advantage is 0.
- ``token_stats``: the detached per-token tensors behind them ([...]: ``student_mass``, ``teacher_mass``,
  ``overlap_count`` int64, ``overlap_token_advantage``), for callers that aggregate across micro-batches.
- ``logit_scale``: the student's logit scale (Cohere's ``logit_scale``, Granite's ``logits_scaling`` as a
  multiplier, MuP's), applied to the raw products before the softcap, as the full-vocabulary divergences do.
- ``precision``, ``grad_precision``: how a float32 student's products are multiplied, as in
  ``logitless.fused_logprobs`` (default: the adaptive bfloat16 split on CUDA, IEEE float32 elsewhere;
  ``logitless.last_precision()`` says what ran); an error for a half-precision student (no effect).
- ``check_inputs=False``: no host synchronisation (nothing below is checked; every row runs, the unscored ones
  with zero outputs and no gradient), as in ``fused_logprobs``.
- ``with_overlap=False``: no overlap (the two overlap metrics and token stats are absent). The overlap needs the
  student's own top-k, which the selection kernels select in the statistics' GEMM (the torch vocabulary pass off
  the triton backend); without it ``"forward_kl_topk"``'s forward is the backend's statistics pass (Triton's kernels
  on CUDA) plus a gathered product for the k ids. The tail divergence sums the mass outside the ids in its pass
  (the given-set kernels on the triton backend, ``ops/triton/given_set.py``; the torch pass elsewhere).
- Bad input is a ValueError / TypeError naming the argument before any kernel runs: ids outside [0, V) or
  repeated within a token, teacher log-probs above 0 or NaN (on scored tokens), -inf without log_prob_min_clamp
  (its term is 0 * -inf = NaN, verl's too: the clamp makes it finite), k probabilities summing above 1 (beyond
  rounding: ``MASS_SLACK``; not one distribution's log-probs), mismatched shapes, an unknown divergence, a
  log_prob_min_clamp that is not finite and < 0.

The divergences, per scored token, with S the teacher's k ids, q_i = exp(teacher log-prob), s_i = the student's
log-prob at id i (softmax over the whole vocabulary, at ``temperature``):

- ``"forward_kl_topk"``: verl 0.9.1's forward_kl_topk (``verl.trainer.distillation.fsdp.losses``, with the
  clamp at 0 of ``verl.trainer.distillation.losses.compute_forward_kl_topk``): with c = log_prob_min_clamp,
  t_i = max(log q_i, c), u_i = max(s_i, c) (no clamp when c is None),
      D = max(0, sum_{i in S} exp(t_i) (t_i - u_i)),
  gradients as torch's autograd gives them through both clamps (0 where a clamp is active). student_mass =
  sum_S exp(s_i) and teacher_mass = sum_S q_i, both before the clamp; the overlap counts the teacher's ids among
  the student's own top-k (k = the teacher's k, ties to the lower id), and its advantage is the mean of
  -exp(t_i) (t_i - u_i) over the overlapping ids (0 where none). verl's Megatron path sums the masses after the
  clamp: the two differ only where a log-prob lies below c. ``clamped_masses=True`` sums them after the clamp,
  sum_S exp(u_i) and sum_S exp(t_i), as verl's Megatron path does (it needs a ``log_prob_min_clamp``: without one
  the two sums are the same, and the setting would have no effect).
- ``"forward_kl_topk_tail"``: the mass outside the top-k as one more bucket on both sides,
      D = sum_{i in S} exp(t_i) (t_i - u_i) + q_tail (log q_tail - log p_tail),
  q_tail = 1 - sum_S q_i (from the teacher's log-probs, in float64, 0 when they sum to 1 or more: the bucket then
  adds nothing), p_tail = the student's mass outside S, summed directly over the other ids by the fused pass
  (``fused_logprobs_k(with_tail=True)``), never as 1 - sum exp(s_i). The clamp applies to the k buckets as above;
  no clamp at 0 (a (k+1)-bucket KL is >= 0 without clamp).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from .. import checks
from ..api import check_head, inv_temperature, tp_group_name
from ..ops import function, label_set_function
from ..ops.precision import resolve
from ..ops.registry import choose_backend

__all__ = ["topk_divergence", "TopKDivergence", "TOPK_DIVERGENCES"]

TOPK_DIVERGENCES = ("forward_kl_topk", "forward_kl_topk_tail")


class TopKDivergence(NamedTuple):
    divergence: Tensor
    metrics: dict
    token_stats: dict


# how far above 1 a scored token's k teacher probabilities may sum (the tail divergence; more is refused): the
# rounding of k log-probs of a distribution, in half precision (bfloat16: 2^-8 relative per probability) and float32
MASS_SLACK = {False: 1e-2, True: 1e-4}


def log_prob_clamp(value) -> Optional[float]:
    """log_prob_min_clamp checked: None, or a finite number < 0 (ValueError naming it)."""
    if value is None:
        return None
    clamp = checks.finite_float(value, "log_prob_min_clamp")
    if clamp >= 0:
        raise ValueError(f"log_prob_min_clamp must be < 0 (a floor for log-probs, which are <= 0; verl's default is "
                         f"-10.0), got {clamp!r}: at or above 0 every log-prob is clamped to it and the loss is 0")
    return clamp


def _check_teacher(labels: Tensor, ids, logprobs, ignore_index: int, check_inputs: bool = True,
                   allow_neg_inf: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(scored [...] bool, ids [..., k] int64 with ignore_index on unscored tokens, teacher log-probs float32
    with 0 on unscored tokens). ValueError for a -inf log-prob on a scored token unless ``allow_neg_inf`` (a
    clamp makes it finite), and for k probabilities summing above 1 (beyond the rounding of their dtype:
    ``MASS_SLACK``): not one distribution's log-probs. check_inputs=False: the log-probs' values are not read on
    the host."""
    ids = checks.index_tensor(ids, "teacher_topk_ids")
    logprobs = checks.tensor(logprobs, "teacher_topk_logprobs")
    if not logprobs.is_floating_point():
        raise TypeError(f"teacher_topk_logprobs must be a floating-point tensor, got {logprobs.dtype}")
    if ids.dim() != labels.dim() + 1 or ids.shape[:-1] != labels.shape or ids.shape[-1] == 0:
        raise ValueError(f"teacher_topk_ids shape {tuple(ids.shape)} must be the labels' shape "
                         f"{tuple(labels.shape)} + [k], k >= 1")
    if logprobs.shape != ids.shape:
        raise ValueError(f"teacher_topk_logprobs shape {tuple(logprobs.shape)} must equal teacher_topk_ids' "
                         f"shape {tuple(ids.shape)}")
    for name, t in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", logprobs)):
        if t.device != labels.device:
            raise ValueError(f"{name} is on {t.device}, the student's tokens on {labels.device}")
    scored = labels != ignore_index
    if check_inputs:
        # probabilities of distinct ids of one distribution sum to at most 1, whether or not the tail is used
        slack = MASS_SLACK[logprobs.dtype in (torch.float32, torch.float64)]
        lp = label_set_function.checked_logprobs(logprobs.detach(), scored, "teacher_topk_logprobs",
                                                 allow_neg_inf=allow_neg_inf, mass_slack=slack)
    else:
        lp = torch.where(scored.unsqueeze(-1), logprobs.detach().float(), 0.0)
    ids = torch.where(scored.unsqueeze(-1), ids.long(), torch.full_like(ids, ignore_index, dtype=torch.int64))
    return scored, ids, lp


def _masked_stats(x: Tensor, scored: Tensor, name: str) -> dict:
    """mean / min / max of x over the scored tokens (NaN / +inf / -inf when none), detached float32."""
    x = x.detach().float()
    count = scored.sum()
    total = torch.where(scored, x, torch.zeros_like(x)).sum()
    inf = torch.full_like(x, float("inf"))
    return {name: total / count, f"{name}_min": torch.where(scored, x, inf).amin() if x.numel() else inf.sum(),
            f"{name}_max": torch.where(scored, x, -inf).amax() if x.numel() else -inf.sum()}


class TopKInputs(NamedTuple):
    """``topk_divergence``'s arguments as its checks leave them (``check_topk``), for either route."""
    hidden: Tensor          # [..., H]
    weight: Tensor          # [V, H]
    labels: Tensor          # [...]
    scored: Tensor          # [...] bool
    ids: Tensor             # [..., k] int64, ignore_index on unscored tokens
    t_lp: Tensor            # [..., k] float32, 0 on unscored tokens
    inv_temp: Tensor        # [N] float32, the logit scale folded in
    softcap: Optional[float]
    clamp: Optional[float]
    backend: str            # the backend's name (``registry.choose_backend``)
    precision: tuple        # (statistics, gradients) as ``ops.precision.resolve`` gives them
    ignore_index: int


def check_topk(student_hidden, student_weight, labels, teacher_topk_ids, teacher_topk_logprobs, *, divergence,
               temperature, ignore_index, reduce_grad_hidden, backend, softcap, log_prob_min_clamp, with_overlap,
               clamped_masses, check_inputs, logit_scale, precision=None, grad_precision=None) -> TopKInputs:
    """Every check of ``topk_divergence`` that runs before its op (TypeError / ValueError naming the argument);
    the op itself checks the ids (range, repeats) and the temperatures."""
    if divergence not in TOPK_DIVERGENCES:
        raise ValueError(f"divergence must be one of {TOPK_DIVERGENCES}, got {divergence!r}")
    hidden, weight, labels = check_head(student_hidden, student_weight, labels)
    ignore_index = checks.ignore_index(ignore_index)
    checks.boolean(reduce_grad_hidden, "reduce_grad_hidden")
    softcap = checks.softcap(softcap)
    checks.boolean(with_overlap, "with_overlap")
    checks.boolean(check_inputs, "check_inputs")
    clamp = log_prob_clamp(log_prob_min_clamp)
    checks.boolean(clamped_masses, "clamped_masses")
    if clamped_masses and clamp is None:
        raise ValueError("clamped_masses=True has no effect without log_prob_min_clamp (the masses are the same "
                         "sums then): leave it False")
    # a -inf teacher log-prob (probability 0) is a NaN term without a clamp (verl's too): refused then
    scored, ids, t_lp = _check_teacher(labels, teacher_topk_ids, teacher_topk_logprobs, ignore_index, check_inputs,
                                       allow_neg_inf=clamp is not None)
    inv_temp = inv_temperature(temperature, labels, check_values=False)
    scale = checks.finite_float(logit_scale, "logit_scale", minimum=0.0, above=True)
    if scale != 1.0:
        # the student's logits softcap(scale * raw) / T: c tanh(s raw / c) / T is the op's softcap c / s at
        # inverse temperature s / T (exact: the scale is applied before the cap, as TRL's heads take it)
        inv_temp = inv_temp * scale
        softcap = None if softcap is None else softcap / scale
    if not check_inputs:
        # every row runs (no host read): an unscored one at inverse temperature 1, so that NaN padding of a
        # per-token temperature reaches no gradient
        inv_temp = inv_temp.masked_fill(~scored.reshape(-1), 1.0)
    mod, _ = choose_backend(hidden, weight, backend)
    precision = resolve(precision, grad_precision, hidden.dtype, hidden.device)
    if (divergence == "forward_kl_topk_tail" and mod.name != "triton" and grad_precision not in (None, "auto")
            and precision[1] != "ieee"):
        # the tail's gradient off the triton backend is the torch pass's IEEE float32 products
        # (``ops/tail_backward.py``): another setting would not change it
        raise ValueError(f"grad_precision={grad_precision!r} has no effect on divergence={divergence!r} on the "
                         f"{mod.name} backend, whose tail gradient is IEEE float32 products (float32-exact): leave it "
                         "None or 'ieee'")
    return TopKInputs(hidden, weight, labels, scored, ids, t_lp, inv_temp, softcap, clamp, mod.name, precision,
                      ignore_index)


def topk_divergence(student_hidden: Tensor, student_weight: Tensor, labels: Tensor, teacher_topk_ids: Tensor,
                    teacher_topk_logprobs: Tensor, *, divergence: str = "forward_kl_topk",
                    temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                    reduce_grad_hidden: bool = True, backend: str = "auto", softcap: Optional[float] = None,
                    log_prob_min_clamp: Optional[float] = None, with_overlap: bool = True,
                    clamped_masses: bool = False, check_inputs: bool = True, logit_scale: float = 1.0,
                    precision: Optional[str] = None, grad_precision: Optional[str] = None) -> TopKDivergence:
    """Per-token top-k divergence of the student against the teacher's top-k; see the module docstring."""
    x = check_topk(student_hidden, student_weight, labels, teacher_topk_ids, teacher_topk_logprobs,
                   divergence=divergence, temperature=temperature, ignore_index=ignore_index,
                   reduce_grad_hidden=reduce_grad_hidden, backend=backend, softcap=softcap,
                   log_prob_min_clamp=log_prob_min_clamp, with_overlap=with_overlap, clamped_masses=clamped_masses,
                   check_inputs=check_inputs, logit_scale=logit_scale, precision=precision,
                   grad_precision=grad_precision)
    return topk_by_logprobs_k(x, divergence, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden,
                              check_inputs=check_inputs, with_overlap=with_overlap, clamped_masses=clamped_masses)


def topk_by_logprobs_k(x: TopKInputs, divergence: str, *, tp_group, reduce_grad_hidden: bool, check_inputs: bool,
                       with_overlap: bool, clamped_masses: bool) -> TopKDivergence:
    """``topk_divergence`` of checked inputs (``check_topk``) through ``fused_logprobs_k``: the student's log-probs at
    the ids differentiable (its backward recomputes the logits), every divergence, setting and backend."""
    k = x.ids.shape[-1]
    options = function.OpOptions(backend=x.backend, with_entropy=False, ignore_index=x.ignore_index,
                                 softcap=x.softcap, tp_group=tp_group_name(tp_group),
                                 reduce_grad_hidden=reduce_grad_hidden, check_inputs=check_inputs,
                                 precision=x.precision[0], grad_precision=x.precision[1])
    with_tail = divergence == "forward_kl_topk_tail"
    s_lp, _, s_tail, s_top = label_set_function.fused_logprobs_k(
        x.hidden.reshape(-1, x.hidden.shape[-1]), x.weight, x.ids.reshape(-1, k), x.inv_temp, options,
        with_tail=with_tail, select=k if with_overlap else 0, labels_name="teacher_topk_ids")
    return finish_topk(s_lp.view(x.ids.shape), x, s_tail, s_top, with_tail=with_tail, clamped_masses=clamped_masses)


def finish_topk(s_lp: Tensor, x: TopKInputs, s_tail: Optional[Tensor], s_top: Optional[Tensor], *, with_tail: bool,
                clamped_masses: bool) -> TopKDivergence:
    """The divergence, metrics and token stats from the student's log-probs at the teacher's ids s_lp [..., k]
    (differentiable or not), its tail log-mass [N] (the tail divergence) and its own top-k ids [N, k] (None:
    no overlap): the one definition both routes of ``fused_distillation_loss`` and ``topk_divergence`` share."""
    ids, scored, t_lp = x.ids, x.scored, x.t_lp
    terms = topk_terms(s_lp, t_lp, x.clamp, clamped_masses=clamped_masses)
    if with_tail:
        d = terms.kl + tail_term(s_tail.view(x.labels.shape), t_lp)
    else:
        d = forward_kl_topk_term(terms)
    d = torch.where(scored, d, torch.zeros_like(d))
    stats = {"student_mass": terms.student_mass, "teacher_mass": terms.teacher_mass}
    metrics = {**_masked_stats(terms.student_mass, scored, "distillation/student_mass"),
               **_masked_stats(terms.teacher_mass, scored, "distillation/teacher_mass")}
    if s_top is not None:
        _overlap(ids, s_top.view(ids.shape), terms.token_kl.detach(), scored, stats, metrics)
    loss_stats = _masked_stats(d, scored, "distillation/loss")
    metrics["distillation/loss_min"], metrics["distillation/loss_max"] = (loss_stats["distillation/loss_min"],
                                                                          loss_stats["distillation/loss_max"])
    return TopKDivergence(d, metrics, stats)


def _overlap(ids: Tensor, student_top: Tensor, token_kl: Tensor, scored: Tensor, stats: dict, metrics: dict) -> None:
    """verl's overlap diagnostics: how many of the teacher's ids are among the student's own top-k, and the mean
    of -token_kl over those ids (0 where none), per token and over the scored tokens."""
    k = ids.shape[-1]
    overlap = (ids.unsqueeze(-1) == student_top.unsqueeze(-2)).any(dim=-1) & scored.unsqueeze(-1)
    count = overlap.sum(dim=-1)
    adv = (-token_kl * overlap).sum(dim=-1) / count.clamp_min(1)
    adv = torch.where(count > 0, adv, torch.zeros_like(adv))
    stats["overlap_count"], stats["overlap_token_advantage"] = count, adv
    metrics["distillation/overlap_ratio"] = (torch.where(scored, count, 0).sum() / scored.sum()).float() / k
    some = scored & (count > 0)
    metrics["distillation/overlap_token_advantage"] = torch.where(
        some.any(), torch.where(some, adv, 0.0).sum() / some.sum().clamp_min(1), 0.0)


class TopKTerms(NamedTuple):
    kl: Tensor             # [...] sum_S exp(t) (t - u), differentiable through the student's log-probs
    token_kl: Tensor       # [..., k] exp(t) (t - u)
    student_mass: Tensor   # [...] sum_S exp(s), detached
    teacher_mass: Tensor   # [...] sum_S q, detached


def topk_terms(s_lp: Tensor, t_lp: Tensor, clamp: Optional[float], *, clamped_masses: bool = False) -> TopKTerms:
    """The k buckets of verl's forward_kl_topk, from the student's log-probs s_lp [..., k] at the teacher's ids
    and the teacher's t_lp [..., k] (float32): masses before the clamp (``clamped_masses``: after it, verl's
    Megatron convention), then both sides clamped from below at ``clamp`` (None: no clamp) and summed as
    sum exp(t) (t - u)."""
    student_mass = s_lp.detach().exp().sum(dim=-1)
    teacher_mass = t_lp.exp().sum(dim=-1)
    if clamp is not None:
        s_lp, t_lp = s_lp.clamp_min(clamp), t_lp.clamp_min(clamp)
        if clamped_masses:
            student_mass, teacher_mass = s_lp.detach().exp().sum(dim=-1), t_lp.exp().sum(dim=-1)
    token_kl = t_lp.exp() * (t_lp - s_lp)
    return TopKTerms(token_kl.sum(dim=-1), token_kl, student_mass, teacher_mass)


def forward_kl_topk_term(terms: TopKTerms) -> Tensor:
    """verl's forward_kl_topk per token: the k buckets' sum clamped at 0 (top-k masses do not sum to 1, so the
    sum can be negative)."""
    return terms.kl.clamp_min(0.0)


def clamp_loss(d: Tensor, loss_max_clamp: Optional[float]) -> Tensor:
    """verl's distillation_loss: the per-token terms clamped to [-c, c] before the aggregation (its loss_min /
    loss_max metrics are of the terms before)."""
    return d if loss_max_clamp is None else d.clamp(-loss_max_clamp, loss_max_clamp)


def tail_term(s_tail: Tensor, t_lp: Tensor) -> Tensor:
    """q_tail (log q_tail - log p_tail) [...], q_tail = 1 - sum exp(t_lp) in float64 (0 when the teacher's k
    probabilities sum to 1 or more: no term), s_tail = log p_tail (differentiable).

    p_tail is summed over the ids outside the k in log space from its own max, so it is never 0 by underflow:
    s_tail = -inf only where no id lies outside the k (k = V). The teacher's leftover q_tail is then rounding of
    k probabilities that cover the whole vocabulary (its true tail is 0 too): a bucket with no mass on either
    side adds nothing (not q_tail * (log q_tail + inf) = inf)."""
    q = (1.0 - t_lp.double().exp().sum(dim=-1)).clamp_min(0.0)
    has = (q > 0) & (s_tail > float("-inf"))
    log_q = torch.log(torch.where(has, q, torch.ones_like(q)))
    q, log_q = q.float(), log_q.float()
    s = torch.where(has, s_tail, torch.zeros_like(s_tail))
    return torch.where(has, q * (log_q - s), torch.zeros_like(s))
