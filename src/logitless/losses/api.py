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
from ..api import check_head, fused_logprobs, inv_temperature, tp_group_name, vocab_layout
from ..ops.policy import max_chunk_rows_for
from ..ops.policy_terms import weighted_terms
from ..ops.precision import resolve
from ..ops.registry import choose_backend
from ..truncation import Truncation
from .function import fused_policy_loss_op
from .policy import PolicyLoss
from .tokens import check_layout, score_tokens


class PolicyLossOutput(NamedTuple):
    """loss: 0-d float32, differentiable (once) to hidden and weight.
    logprobs, entropy: float32 in the labels' shape, 0 where ignored; detached metrics.
    clip_fraction: 0-d float32, share of scored tokens whose clipped surrogate was the larger (verl's
        pg_clipfrac); detached.
    kl: 0-d float32, the KL estimate aggregated like the loss, or by ``kl_agg`` (verl's kl_loss), or None without
        ref_logprobs; detached."""
    loss: Tensor
    logprobs: Tensor
    entropy: Tensor
    clip_fraction: Tensor
    kl: Optional[Tensor]


def _prepare(hidden, weight, labels, policy, temperature, ignore_index, tp_group, reduce_grad_hidden, backend,
             seq_first):
    """The checks that need no tensor's values (the op makes those), and the inverse temperature in the
    labels' layout (NaN where out of range: the op refuses it)."""
    labels = checks.index_tensor(labels, "labels")
    if seq_first and labels.dim() != 2:
        raise ValueError(f"labels must be [b, s] here, got shape {tuple(labels.shape)}")
    # the rows of hidden are the labels' positions (in [s, b] order when seq_first)
    hidden, weight, _ = check_head(hidden, weight, labels.t() if seq_first else labels)
    if not isinstance(policy, PolicyLoss):
        raise TypeError(f"loss must be a logitless.losses.PolicyLoss, got {type(policy).__name__}")
    ignore_index = checks.ignore_index(ignore_index)
    checks.reduce_grad_hidden(reduce_grad_hidden, tp_group)
    check_layout(labels, policy, seq_first)
    mod, _ = choose_backend(hidden, weight, backend)
    inv_temp = inv_temperature(temperature, labels, check_values=False).view(labels.shape)
    return hidden, weight, labels, inv_temp, mod


def policy_loss(policy: PolicyLoss, hidden: Tensor, weight: Tensor, labels: Tensor, *,
                temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                reduce_grad_hidden: bool = True, backend: str = "auto", fused: bool = True,
                seq_first: bool = False, softcap: Optional[float] = None,
                check_inputs: bool = True, precision: Optional[str] = None,
                grad_precision: Optional[str] = None, bf16_exact: Optional[str] = None,
                truncation: Optional[Truncation] = None) -> PolicyLossOutput:
    """``fused_policy_loss`` (fused=True) or ``policy_loss_reference`` (False) of a ``PolicyLoss``.

    seq_first: hidden is [s, b, H] while labels and the policy's per-token inputs are [b, s] (Megatron's
    layout; the outputs come back [b, s] and sequences are the rows of labels).
    softcap: None, or c in [1e-6, 1e6]: the logits are c * tanh(raw / c) before the temperature (Gemma 2's
    final_logit_softcapping), as in ``fused_logprobs``.
    check_inputs: as in ``fused_policy_loss`` (the fused pass of a token-local loss only; the other paths
    always check).
    precision, grad_precision, bf16_exact: as in ``fused_logprobs`` (how float32 operands are multiplied).
    truncation: None, or a ``logitless.Truncation`` (the rollout sampler's top_k / top_p / min_p, or its kept ids):
    the log-probs, the ratio and the entropy are then those of the truncated, renormalised distribution
    (``fused_logprobs(..., truncation=)``, docs/truncation.md). Per-token setting tensors (and kept_ids
    [..., K]) are laid out like the labels, as temperature is ([b, s] or [b, 1] also when seq_first). The
    caller's old_logprobs / ref_logprobs are taken as given: an integration scores them under the same
    truncation. Always the exact path below (four GEMMs); needs check_inputs=True.

    Which pass runs: a token-local loss with no softcap takes the one fused pass (three GEMMs, gradients
    formed in the forward), the custom op ``logitless::fused_policy_loss``. So does a loss coupled within
    sequences only (``TermSpec.sequence_coupled``: sequence-level ratios, VESPO, geo_mean, the off-policy
    mask) when every sequence fits one chunk of the backend: the chunks are then cut at sequence boundaries
    and each chunk's terms are differentiated whole. Otherwise a loss that couples tokens (``TermSpec.coupled``,
    including the batch-level entropy mask, clip_cov, kl_cov), a softcapped head, or the sequence-first layout
    with a coupled loss, take the statistics of every token first (``fused_logprobs``' forward), form the
    per-token coefficients dL/dlogprob, dL/dentropy of the whole batch in float64 (``ops/policy_terms.py``),
    and a second pass for the gradients (``fused_logprobs``' backward): exact, four GEMMs. The fused pass
    compiles under torch.compile(fullgraph=True); the coupled losses' routing reads the sequences' lengths on
    the host (a graph break)."""
    checks.boolean(check_inputs, "check_inputs")
    softcap = checks.softcap(softcap)
    truncation = _check_truncation(truncation, check_inputs)
    hidden, weight, labels, inv_temp, mod = _prepare(hidden, weight, labels, policy, temperature, ignore_index,
                                                     tp_group, reduce_grad_hidden, backend, seq_first)
    # checked before any kernel
    resolved = resolve(precision, grad_precision, hidden.dtype, hidden.device, bf16_exact)
    spec = policy.term_spec()
    if fused and not check_inputs and (spec.coupled or softcap is not None or policy.rollout_is is not None):
        what = ("a softcap" if softcap is not None else "rollout_is" if policy.rollout_is is not None
                else "a loss that couples tokens")
        raise ValueError(f"check_inputs=False (no host synchronisation) covers the fused pass of a token-local "
                         f"loss without softcap; {what} needs check_inputs=True")
    bounds = None
    if fused and softcap is None and truncation is None and spec.sequence_coupled:
        tokens = _scored(labels, policy, inv_temp, ignore_index, weight, tp_group, seq_first)
        bounds = _sequence_bounds(tokens, mod.name, weight, tp_group, hidden, seq_first)
    if not fused or softcap is not None or truncation is not None or (spec.coupled and bounds is None):
        return _reference(hidden, weight, labels, inv_temp, policy, temperature, ignore_index, tp_group,
                          reduce_grad_hidden, mod.name, seq_first, softcap, precision, grad_precision, bf16_exact,
                          truncation)
    grad = torch.is_grad_enabled()
    loss, lp, ent, clip_fraction, kl = fused_policy_loss_op(
        hidden.reshape(labels.numel(), hidden.shape[-1]), weight, labels, inv_temp, policy, backend=mod.name,
        ignore_index=ignore_index, tp_group=tp_group_name(tp_group), reduce_grad_hidden=reduce_grad_hidden,
        seq_first=seq_first, check_inputs=check_inputs, need_dh=grad and hidden.requires_grad,
        need_dw=grad and weight.requires_grad, bounds=bounds, precision=resolved[0], grad_precision=resolved[1])
    return PolicyLossOutput(loss, lp, ent, clip_fraction, kl if policy.ref_logprobs is not None else None)


def _check_truncation(truncation, check_inputs: bool) -> Optional[Truncation]:
    """The truncation checked; None when it truncates nothing by its numbers alone (every setting None or its
    off value: top_k -1, top_p 1, min_p 0), so that the loss takes the untruncated path, bit for bit."""
    if truncation is None:
        return None
    if not isinstance(truncation, Truncation):
        raise TypeError(f"truncation must be a logitless.Truncation or None, got {type(truncation).__name__}")
    truncation.check()
    if not check_inputs:
        raise ValueError("truncation needs check_inputs=True: the kept sets' sizes are read on the host, which "
                         "check_inputs=False (CUDA-graph capture) forbids")
    off = {"top_k": -1, "top_p": 1.0, "min_p": 0.0}
    if truncation.kept_ids is None and all(
            getattr(truncation, name) is None or (not torch.is_tensor(getattr(truncation, name))
                                                  and getattr(truncation, name) == value)
            for name, value in off.items()):
        truncation.row_settings(torch.zeros(1, dtype=torch.int64))    # the values' own checks, as the op makes them
        return None
    return truncation


def _rows_truncation(truncation: Optional[Truncation], seq_first: bool) -> Optional[Truncation]:
    """The truncation in the rows' layout: with seq_first the labels' [b, s] / [b, 1] setting tensors (and
    kept_ids [b, s, K]) transposed to the rows' [s, b], as the temperature is."""
    if truncation is None or not seq_first:
        return truncation

    def rows(x):
        return x.transpose(0, 1) if torch.is_tensor(x) and x.dim() >= 2 else x
    return dataclasses.replace(truncation, top_k=rows(truncation.top_k), top_p=rows(truncation.top_p),
                               min_p=rows(truncation.min_p), kept_ids=rows(truncation.kept_ids))


def _scored(labels, policy, inv_temp, ignore_index, weight, tp_group, seq_first):
    _, vocab = vocab_layout(weight, tp_group)
    return score_tokens(labels, policy, inv_temp=inv_temp, ignore_index=ignore_index, vocab=vocab,
                        seq_first=seq_first)


def _sequence_bounds(tokens, backend_name: str, weight: Tensor, tp_group, hidden: Tensor,
                     seq_first: bool) -> Optional[list]:
    """Chunk boundaries [0, ..., n] at sequence boundaries, each chunk at most the backend's rows (on triton grown
    to the longest sequence within LOGITLESS_POLICY_WORKSPACE_MAX_BYTES), so that a sequence-coupled loss keeps the
    one fused pass; None when that cannot be (a sequence longer than the largest chunk, sequences not contiguous
    in the rows: seq_first). One host read (the sequences' lengths)."""
    n = tokens.count
    seq = tokens.inputs.seq
    if seq_first or seq is None or n == 0:
        return None
    tp, _ = vocab_layout(weight, tp_group)
    plan_vocab = max(tp.sizes) if tp is not None else weight.shape[0]
    counts = torch.unique_consecutive(seq, return_counts=True)[1].tolist()
    # the backend's chunk, grown to the longest sequence where its bounded workspace allows (ops/policy.py)
    limit = max_chunk_rows_for(backend_name)(n, plan_vocab, hidden.dtype, hidden.device, longest=max(counts))
    bounds, size, pos = [0], 0, 0
    for count in counts:
        if count > limit:
            return None
        if size + count > limit:
            bounds.append(pos)
            size = 0
        size += count
        pos += count
    bounds.append(n)
    return bounds


def _reference(hidden, weight, labels, inv_temp, policy, temperature, ignore_index, tp_group, reduce_grad_hidden,
               backend, seq_first, softcap=None, precision=None, grad_precision=None, bf16_exact=None,
               truncation=None):
    """The loss through fused_logprobs (its own backward recomputes the logits) and torch autograd: the
    statistics pass, the whole batch's float64 terms and their per-token coefficients, the gradient pass. With
    ``truncation`` the log-probs and entropies are the truncated distribution's (the kept sets held fixed)."""
    tokens = _scored(labels, policy, inv_temp, ignore_index, weight, tp_group, seq_first)
    labels_rows = labels.t() if seq_first else labels
    temp = temperature
    if seq_first and torch.is_tensor(temperature) and temperature.dim() == 2:
        temp = temperature.t()     # [b, s] or [b, 1] -> the rows' [s, b] layout
    out = fused_logprobs(hidden, weight, labels_rows, temperature=temp, with_entropy=True,
                         ignore_index=ignore_index, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden,
                         backend=backend, softcap=softcap, precision=precision, grad_precision=grad_precision,
                         bf16_exact=bf16_exact, truncation=_rows_truncation(truncation, seq_first))
    lp, ent = out.logprobs.reshape(-1), out.entropy.reshape(-1)
    if tokens.rows is not None:
        lp, ent = lp.index_select(0, tokens.rows), ent.index_select(0, tokens.rows)
    spec = policy.term_spec()
    loss, clipped, kl = weighted_terms(lp.double(), ent.double(), tokens.inputs, spec)

    def shaped(x):
        x = x.detach().view(tokens.row_shape)
        return x.t().contiguous() if seq_first else x
    return PolicyLossOutput(loss.float(), shaped(out.logprobs), shaped(out.entropy),
                            tokens.share(clipped.float()), None if kl is None else kl.float())


def fused_policy_loss(hidden: Tensor, weight: Tensor, labels: Tensor, advantages: Tensor,
                      old_logprobs: Optional[Tensor] = None, *, clip_low: float = 0.2, clip_high: float = 0.28,
                      dual_clip: Optional[float] = None, ref_logprobs: Optional[Tensor] = None,
                      kl_coef: float = 0.0, kl_type: str = "k3", entropy_coef: float = 0.0,
                      loss_agg: str = "token-mean", cu_seqlens: Optional[Tensor] = None,
                      temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                      reduce_grad_hidden: bool = True, backend: str = "auto", check_inputs: bool = True,
                      precision: Optional[str] = None, grad_precision: Optional[str] = None,
                      bf16_exact: Optional[str] = None, truncation: Optional[Truncation] = None,
                      **loss_settings) -> PolicyLossOutput:
    """The PPO / GRPO policy loss straight from the LM head, in three GEMMs, without the logits.

    Args:
        hidden, weight, labels, temperature, ignore_index, tp_group, reduce_grad_hidden, backend: as in
            ``logitless.fused_logprobs`` (hidden [..., H], weight [V, H], labels [...]); ``backend``
            "auto", "reference", "chunked" or "triton" (``logitless.last_backend()`` says which ran).
        advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type,
            entropy_coef, loss_agg, cu_seqlens: see ``logitless.losses.PolicyLoss``; per-token inputs
            broadcast to the labels (per token, or per sequence [b, 1]).
        check_inputs: True (default): labels, temperatures, per-token inputs and cu_seqlens are checked
            (ValueError) and only the scored tokens (label != ignore_index) are computed: one host
            synchronisation, inside the op (``torch.compile`` sees none). False: none at all, so a whole
            step can be captured in a CUDA graph; nothing is checked, every row is computed, and the rows
            that are not scored get no label, inputs and weights 0, and outputs 0 (NaN padding in the
            per-token inputs there is harmless; a non-finite hidden state there reaches d_weight). Token-local
            losses only (no softcap, no rollout_is): others raise ValueError.
        precision, grad_precision: how float32 operands are multiplied, as in ``logitless.fused_logprobs``
            (default: the adaptive bfloat16 split on CUDA, IEEE float32 elsewhere); half-precision
            operands take only None.
        bf16_exact: which float32 operands hold bfloat16 values only, as in ``logitless.fused_logprobs``.
        truncation: None, or a ``logitless.Truncation``: the rollout sampler's top_k / top_p / min_p (numbers, or
            tensors laid out like the labels, as temperature) or its kept ids: the log-probs, hence the ratio,
            the KL and the entropy, are those of the truncated, renormalised distribution (docs/truncation.md),
            through the exact path (``fused_logprobs(..., truncation=)`` and torch autograd, four GEMMs).
            old_logprobs / ref_logprobs are the caller's: score them under the same truncation (the TRL
            integration does). Settings that are all off by their numbers take the untruncated path (bit for
            bit). Needs check_inputs=True (ValueError otherwise).
        loss_settings: the other ``PolicyLoss`` settings, by name: surrogate (``SURROGATES``: "ppo", "cispo",
            "sapo", "gpg", "dro", "vespo", "dppo_tv", "dppo_kl", "geo_mean", "clip_cov", "kl_cov"), ratio_level,
            ratio_log_clamp, delta, kl_ratio, the masks (entropy_quantile, entropy_quantile_group,
            off_policy_threshold), rollout correction (rollout_logprobs, rollout_is, rollout_is_min / _max,
            rollout_weights, rollout_is_batch_normalize, rollout_nan_is_missing), current_is (with
            current_is_min / _max), rejection sampling (rejection_*), entropy_agg, kl_agg and each surrogate's
            parameters; an unknown name is a TypeError naming it. docs/policy-loss.md defines each.

    Returns:
        PolicyLossOutput(loss, logprobs, entropy, clip_fraction, kl): ``loss`` is 0-d float32, to be
        minimised, differentiable once to hidden and weight (only those that require grad); the rest are
        detached float32 metrics. Under no_grad / inference_mode, or when neither hidden nor weight
        requires grad, only the statistics are computed (no gradient buffer or GEMM), for the same numbers.
        Under torch.autocast hidden and weight are cast as F.linear casts them, then computed on exactly;
        a function calling this compiles with torch.compile(fullgraph=True) (docs/contexts.md).

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
                       tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden, backend=backend,
                       check_inputs=check_inputs, precision=precision, grad_precision=grad_precision,
                       bf16_exact=bf16_exact, truncation=truncation)


# read once here: torch.compile does not trace dataclasses.fields
_POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyLoss))


def _policy(advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type, entropy_coef,
            loss_agg, cu_seqlens, loss_settings) -> PolicyLoss:
    unknown = sorted(set(loss_settings) - _POLICY_FIELDS)
    if unknown:
        raise TypeError(f"unknown policy-loss setting(s) {', '.join(unknown)}; {_where(unknown[0])}")
    return PolicyLoss(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                      clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef, kl_type=kl_type,
                      entropy_coef=entropy_coef, loss_agg=loss_agg, cu_seqlens=cu_seqlens, **loss_settings)


# names that are arguments elsewhere, not PolicyLoss settings: where they go
_ELSEWHERE = {
    "softcap": "a softcapped head's loss is logitless.losses.policy_loss(PolicyLoss(...), hidden, weight, labels, "
               "softcap=...) (exact, four GEMMs); logitless.transformers reads a model's own from its config",
}


def _where(name: str) -> str:
    if name in _ELSEWHERE:
        return _ELSEWHERE[name]
    return checks.did_you_mean(name, _POLICY_FIELDS) or f"PolicyLoss takes {sorted(_POLICY_FIELDS)}"


def policy_loss_reference(hidden: Tensor, weight: Tensor, labels: Tensor, advantages: Tensor,
                          old_logprobs: Optional[Tensor] = None, *, clip_low: float = 0.2, clip_high: float = 0.28,
                          dual_clip: Optional[float] = None, ref_logprobs: Optional[Tensor] = None,
                          kl_coef: float = 0.0, kl_type: str = "k3", entropy_coef: float = 0.0,
                          loss_agg: str = "token-mean", cu_seqlens: Optional[Tensor] = None,
                          temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, tp_group=None,
                          reduce_grad_hidden: bool = True, backend: str = "auto",
                          precision: Optional[str] = None, grad_precision: Optional[str] = None,
                          truncation: Optional[Truncation] = None, **loss_settings) -> PolicyLossOutput:
    """``fused_policy_loss``'s loss through ``fused_logprobs`` (on ``backend``) and torch autograd: the same
    definition (``terms.py``), the usual four GEMMs. The baseline the fused loss is measured against."""
    policy = _policy(advantages, old_logprobs, ref_logprobs, clip_low, clip_high, dual_clip, kl_coef, kl_type,
                     entropy_coef, loss_agg, cu_seqlens, loss_settings)
    return policy_loss(policy, hidden, weight, labels, temperature=temperature, ignore_index=ignore_index,
                       tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden, backend=backend, fused=False,
                       precision=precision, grad_precision=grad_precision, truncation=truncation)
