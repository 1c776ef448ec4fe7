"""The public policy losses: ``fused_policy_loss`` (three GEMMs, gradients formed in the forward) and
``policy_loss_reference`` (the same loss through ``fused_logprobs`` and autograd: four GEMMs).

Both take the LM head's last hidden states and weight, the labels and a ``PolicyLoss``'s inputs; both
return a ``PolicyLossOutput``; they agree within the op's tolerances.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

import torch
from torch import Tensor

from .. import checks
from ..api import check_head, fused_logprobs, vocab_layout
from ..ops.policy import max_chunk_rows_for, policy_pass_for, policy_terms_for
from ..ops.policy_terms import weighted_terms
from ..ops.registry import choose_backend
from ..record import record_backend
from .function import FusedPolicyLossFunction, PassOptions
from .policy import PolicyLoss
from .tokens import ScoredTokens, score_tokens


class PolicyLossOutput(NamedTuple):
    """loss: 0-d float32, differentiable (once) to hidden and weight.
    logprobs, entropy: float32 in the labels' shape, 0 where ignored; detached metrics.
    clip_fraction: 0-d float32, share of scored tokens whose clipped surrogate was the larger (verl's
        pg_clipfrac); detached.
    kl: 0-d float32, the KL estimate aggregated like the loss (verl's kl_loss), or None without
        ref_logprobs; detached."""
    loss: Tensor
    logprobs: Tensor
    entropy: Tensor
    clip_fraction: Tensor
    kl: Optional[Tensor]


def _prepare(hidden, weight, labels, policy, temperature, ignore_index, tp_group, reduce_grad_hidden, backend,
             seq_first):
    labels = checks.index_tensor(labels, "labels")
    if seq_first and labels.dim() != 2:
        raise ValueError(f"labels must be [b, s] here, got shape {tuple(labels.shape)}")
    # the rows of hidden are the labels' positions (in [s, b] order when seq_first)
    hidden, weight, _ = check_head(hidden, weight, labels.t() if seq_first else labels)
    if not isinstance(policy, PolicyLoss):
        raise TypeError(f"loss must be a logitless.losses.PolicyLoss, got {type(policy).__name__}")
    ignore_index = checks.ignore_index(ignore_index)
    checks.boolean(reduce_grad_hidden, "reduce_grad_hidden")
    mod, _ = choose_backend(hidden, weight, backend)
    tp, vocab = vocab_layout(weight, tp_group)
    if tp is not None:
        tp = tp.with_reduce(reduce_grad_hidden)
    tokens = score_tokens(labels, policy, temperature=temperature, ignore_index=ignore_index, vocab=vocab,
                          seq_first=seq_first)
    return hidden, weight, tokens, mod, tp


def _finish(tokens: ScoredTokens, loss, lp, ent, clipped, kl, with_kl: bool, seq_first: bool) -> PolicyLossOutput:
    def shaped(x):
        x = x.view(tokens.row_shape)
        return x.t().contiguous() if seq_first else x
    clip_fraction = clipped / max(tokens.count, 1)
    return PolicyLossOutput(loss, shaped(lp), shaped(ent), clip_fraction, kl if with_kl else None)


def policy_loss(policy: PolicyLoss, hidden: Tensor, weight: Tensor, labels: Tensor, *,
                temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                reduce_grad_hidden: bool = True, backend: str = "auto", fused: bool = True,
                seq_first: bool = False, softcap: Optional[float] = None) -> PolicyLossOutput:
    """``fused_policy_loss`` (fused=True) or ``policy_loss_reference`` (False) of a ``PolicyLoss``.

    seq_first: hidden is [s, b, H] while labels and the policy's per-token inputs are [b, s] (Megatron's
    layout; the outputs come back [b, s] and sequences are the rows of labels).
    softcap: None, or c > 0: the logits are c * tanh(raw / c) before the temperature (Gemma 2's
    final_logit_softcapping), as in ``fused_logprobs``.

    Which pass runs: a token-local loss with no softcap takes the one fused pass (three GEMMs, gradients
    formed in the forward). So does a loss coupled within sequences only (``TermSpec.sequence_coupled``:
    sequence-level ratios, VESPO, geo_mean, the off-policy mask) when every sequence fits one chunk of the
    backend: the chunks are then cut at sequence boundaries and each chunk's terms are differentiated
    whole. Otherwise a loss that couples tokens (``TermSpec.coupled``, including the batch-level entropy
    mask, clip_cov, kl_cov), a softcapped head, or the sequence-first layout with a coupled loss, take the
    statistics of every token first (``fused_logprobs``' forward), form the per-token coefficients
    dL/dlogprob, dL/dentropy of the whole batch in float64 (``ops/policy_terms.py``), and a second pass
    for the gradients (``fused_logprobs``' backward): exact, four GEMMs."""
    if softcap is not None:
        softcap = checks.finite_float(softcap, "softcap", minimum=0.0, above=True)
    hidden, weight, tokens, mod, tp = _prepare(hidden, weight, labels, policy, temperature, ignore_index,
                                               tp_group, reduce_grad_hidden, backend, seq_first)
    spec = policy.term_spec()
    bounds = None
    if fused and softcap is None and spec.sequence_coupled:
        bounds = _sequence_bounds(tokens, mod.name, weight, tp, hidden, seq_first)
    if not fused or softcap is not None or (spec.coupled and bounds is None):
        return _reference(hidden, weight, tokens, spec, temperature, ignore_index, tp_group, reduce_grad_hidden,
                          mod.name, labels, seq_first, softcap)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    grad = torch.is_grad_enabled()
    options = PassOptions(policy_pass=policy_pass_for(mod.name), terms=policy_terms_for(mod.name, spec), tp=tp,
                          need_dh=grad and hidden.requires_grad, need_dw=grad and weight.requires_grad,
                          bounds=bounds)
    loss, lp, ent, clipped, kl = FusedPolicyLossFunction.apply(h2, weight, tokens, spec, options)
    record_backend(mod.name)
    return _finish(tokens, loss, lp, ent, clipped, kl, spec.has_ref, seq_first)


def _sequence_bounds(tokens: ScoredTokens, backend_name: str, weight: Tensor, tp, hidden: Tensor,
                     seq_first: bool) -> Optional[list]:
    """Chunk boundaries [0, ..., n] at sequence boundaries, each chunk at most the backend's rows, so that
    a sequence-coupled loss keeps the one fused pass; None when that cannot be (a sequence longer than a
    chunk, sequences not contiguous in the rows: seq_first). One host read (the sequences' lengths)."""
    n = tokens.count
    seq = tokens.inputs.seq
    if seq_first or seq is None or n == 0:
        return None
    plan_vocab = max(tp.sizes) if tp is not None else weight.shape[0]
    limit = max_chunk_rows_for(backend_name)(n, plan_vocab, hidden.dtype, hidden.device)
    bounds, size, pos = [0], 0, 0
    for count in torch.unique_consecutive(seq, return_counts=True)[1].tolist():
        if count > limit:
            return None
        if size + count > limit:
            bounds.append(pos)
            size = 0
        size += count
        pos += count
    bounds.append(n)
    return bounds


def _reference(hidden, weight, tokens, spec, temperature, ignore_index, tp_group, reduce_grad_hidden, backend,
               labels, seq_first, softcap=None):
    """The loss through fused_logprobs (its own backward recomputes the logits) and torch autograd: the
    statistics pass, the whole batch's float64 terms and their per-token coefficients, the gradient pass."""
    labels_rows = labels.t() if seq_first else labels
    temp = temperature
    if seq_first and torch.is_tensor(temperature) and temperature.dim() == 2:
        temp = temperature.t()     # [b, s] or [b, 1] -> the rows' [s, b] layout
    out = fused_logprobs(hidden, weight, labels_rows, temperature=temp, with_entropy=True,
                         ignore_index=ignore_index, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden,
                         backend=backend, softcap=softcap)
    lp, ent = out.logprobs.reshape(-1), out.entropy.reshape(-1)
    if tokens.rows is not None:
        lp, ent = lp.index_select(0, tokens.rows), ent.index_select(0, tokens.rows)
    loss, clipped, kl = weighted_terms(lp.double(), ent.double(), tokens.inputs, spec)
    return _finish(tokens, loss.float(), out.logprobs.detach().reshape(-1), out.entropy.detach().reshape(-1),
                   clipped.float(), None if kl is None else kl.float(), spec.has_ref, seq_first)


def fused_policy_loss(hidden: Tensor, weight: Tensor, labels: Tensor, advantages: Tensor,
                      old_logprobs: Optional[Tensor] = None, *, clip_low: float = 0.2, clip_high: float = 0.28,
                      dual_clip: Optional[float] = None, ref_logprobs: Optional[Tensor] = None,
                      kl_coef: float = 0.0, kl_type: str = "k3", entropy_coef: float = 0.0,
                      loss_agg: str = "token-mean", cu_seqlens: Optional[Tensor] = None,
                      temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                      reduce_grad_hidden: bool = True, backend: str = "auto", **loss_settings) -> PolicyLossOutput:
    """The PPO / GRPO policy loss straight from the LM head, in three GEMMs, without the logits.

    Args:
        hidden, weight, labels, temperature, ignore_index, tp_group, reduce_grad_hidden, backend: as in
            ``logitless.fused_logprobs`` (hidden [..., H], weight [V, H], labels [...]); ``backend``
            "auto", "reference", "chunked" or "triton" (``logitless.last_backend()`` says which ran).
        advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type,
            entropy_coef, loss_agg, cu_seqlens: see ``logitless.losses.PolicyLoss``; per-token inputs
            broadcast to the labels (per token, or per sequence [b, 1]).
        loss_settings: the other ``PolicyLoss`` settings, by name: surrogate ("ppo", "cispo", "sapo",
            "gpg", "dro", "vespo", "dppo_tv", "dppo_kl"), ratio_level, delta, kl_ratio, the masks
            (entropy_quantile, off_policy_threshold), rollout correction (rollout_logprobs, rollout_is,
            rollout_is_min / _max, rollout_weights), entropy_agg and each surrogate's parameters; an
            unknown name is a TypeError naming it. docs/policy-loss.md defines each.

    Returns:
        PolicyLossOutput(loss, logprobs, entropy, clip_fraction, kl): ``loss`` is 0-d float32, to be
        minimised, differentiable once to hidden and weight (only those that require grad); the rest are
        detached float32 metrics.

    The loss is sum_i w_i f_i over the scored tokens (``ops/policy_terms.py`` for f, ``aggregate.py`` for
    w). For a token-local f (each token's term depends on its own log-prob and entropy only), the pass
    forms each token chunk's gradient as soon as its statistics are known: the logits are never
    recomputed (three GEMMs, against the four of fused_logprobs plus a loss). Memory beyond the gradient
    buffers: a per-chunk workspace (LOGITLESS_POLICY_WORKSPACE_BYTES on the triton backend,
    LOGITLESS_CHUNK_ELEMENTS on the chunked one). The gradient buffers are allocated in the forward.
    A loss that couples tokens (sequence-level ratios, VESPO, the masks) is exact too, in four GEMMs: see
    ``policy_loss``.
    """
    policy = _policy(advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type,
                     entropy_coef, loss_agg, cu_seqlens, loss_settings)
    return policy_loss(policy, hidden, weight, labels, temperature=temperature, ignore_index=ignore_index,
                       tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden, backend=backend)


def _policy(advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type, entropy_coef,
            loss_agg, cu_seqlens, loss_settings) -> PolicyLoss:
    known = {f.name for f in dataclasses.fields(PolicyLoss)}
    unknown = sorted(set(loss_settings) - known)
    if unknown:
        raise TypeError(f"unknown policy-loss setting(s) {', '.join(unknown)}; PolicyLoss takes {sorted(known)}")
    return PolicyLoss(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef, kl_type=kl_type,
                      entropy_coef=entropy_coef, loss_agg=loss_agg, cu_seqlens=cu_seqlens, **loss_settings)


def policy_loss_reference(hidden: Tensor, weight: Tensor, labels: Tensor, advantages: Tensor,
                          old_logprobs: Optional[Tensor] = None, *, clip_low: float = 0.2, clip_high: float = 0.28,
                          dual_clip: Optional[float] = None, ref_logprobs: Optional[Tensor] = None,
                          kl_coef: float = 0.0, kl_type: str = "k3", entropy_coef: float = 0.0,
                          loss_agg: str = "token-mean", cu_seqlens: Optional[Tensor] = None,
                          temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                          reduce_grad_hidden: bool = True, backend: str = "auto", **loss_settings
                          ) -> PolicyLossOutput:
    """``fused_policy_loss``'s loss through ``fused_logprobs`` (on ``backend``) and torch autograd: the same
    definition (``terms.py``), the usual four GEMMs. The baseline the fused loss is measured against."""
    policy = _policy(advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type,
                     entropy_coef, loss_agg, cu_seqlens, loss_settings)
    return policy_loss(policy, hidden, weight, labels, temperature=temperature, ignore_index=ignore_index,
                       tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden, backend=backend, fused=False)
