"""The scored tokens of one policy-loss call: per-token inputs broadcast to the labels, the
aggregation weights, and everything flattened in the row order of the hidden states.

Only scored tokens (label != ignore_index) reach a backend; their per-token inputs must be finite
(padding may hold anything, NaN included: it is never read).

Every value check of a call (label range, finite inputs, log-prob inputs <= 0, temperature, cu_seqlens, finite
scored hidden rows) and the number of scored tokens come back to the host together, in one synchronisation,
before any GEMM: when it
returns the GPU has nothing queued, so what the host does between it and the first GEMM is idle GPU
time. The per-token loss inputs (float64 casts, aggregation weights) are therefore built on first
use (``ScoredTokens.inputs``): the fused pass asks for them after its first statistics kernel is
queued, while that kernel runs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import checks
from ..ops.policy_terms import TokenInputs
from .aggregate import check_agg_layout, check_cu_seqlens, cu_seqlens_error, token_weights
from .policy import PolicyLoss


@dataclass(frozen=True)
class ScoredTokens:
    """The scored tokens of a call, in the row order of ``hidden.reshape(-1, H)``.

    rows: int64 [n] indices of the scored rows among all ``total`` rows (None: every row is passed).
    labels: int64 [n] global token ids, each in [0, vocab), or -1 for a row with no label (unchecked calls
    only). inv_temp: float32 [n].
    inputs: float64 per-token inputs [n], built on first use from ``make_inputs``.
    row_shape: the shape of the rows before flattening (the outputs are returned in it).
    unscored: None, or (unchecked calls: every row is passed, no host synchronisation) bool [total], the
    rows that are not scored: their label is -1, their per-token inputs and weights 0, their outputs 0.
    """
    rows: Optional[Tensor]
    total: int
    labels: Tensor
    inv_temp: Tensor
    make_inputs: Callable[[], TokenInputs]
    row_shape: tuple
    unscored: Optional[Tensor] = None

    @cached_property
    def inputs(self) -> TokenInputs:
        return self.make_inputs()

    @property
    def count(self) -> int:
        """Rows passed to the pass (all of them in an unchecked call)."""
        return self.labels.numel()

    def share(self, count: Tensor) -> Tensor:
        """count (0-d) / the number of scored tokens (1 when there are none)."""
        if self.unscored is None:
            return count / max(self.count, 1)
        return count / (~self.unscored).sum().clamp_min(1)

    def scatter(self, values: Tensor) -> Tensor:
        """values [n] of the passed rows -> [total] with zeros at the rows that are not scored."""
        if self.unscored is not None:
            return values.masked_fill(self.unscored, 0.0)
        if self.rows is None:
            return values
        return values.new_zeros(self.total).index_copy_(0, self.rows, values)


def check_layout(labels: Tensor, policy: PolicyLoss, seq_first: bool = False):
    """The checks of ``policy``'s tensors against ``labels`` that read no value (types, devices, shapes; the
    entry makes them before the op, so they hold under torch.compile too). Returns ([(name, per-token
    tensor broadcast to the labels)], int64 cu_seqlens or None, 0-d bool: cu_seqlens' values hold, or None)."""
    if seq_first and labels.dim() != 2:
        raise ValueError(f"labels must be [b, s] here, got shape {tuple(labels.shape)}")
    named = [(name, checks.per_token_tensor(value, name, labels))
             for name, value in (("advantages", policy.advantages), ("old_logprobs", policy.old_logprobs),
                                 ("ref_logprobs", policy.ref_logprobs), ("rollout_logprobs", policy.rollout_logprobs),
                                 ("rollout_weights", policy.rollout_weights)) if value is not None]
    cu, cu_ok = (None, None) if policy.cu_seqlens is None else check_cu_seqlens(policy.cu_seqlens, labels)
    check_agg_layout(labels, policy.loss_agg, cu)
    if policy.entropy_agg is not None:
        check_agg_layout(labels, policy.entropy_agg, cu)
    for needs, what in sequence_needs(policy):
        if needs and (labels.dim() == 0 or (labels.dim() == 1 and cu is None)):
            raise ValueError(f"{what} needs sequences: give labels [b, s] (a sequence per row) or cu_seqlens for "
                             "packed 1-D labels")
    return named, cu, cu_ok


# per-token inputs that are log-probabilities: above 0 they cannot be (probabilities passed by mistake); the
# margin allows float32 rounding of a log-prob near 0 (a dominating token's lse - logit)
LOGPROB_INPUTS = ("old_logprobs", "ref_logprobs", "rollout_logprobs")
LOGPROB_MAX = 1e-3


def score_tokens(labels: Tensor, policy: PolicyLoss, *, inv_temp: Tensor, ignore_index: int, vocab: int,
                 seq_first: bool = False, check_inputs: bool = True, hidden: Optional[Tensor] = None) -> ScoredTokens:
    """Check and flatten the per-token inputs of ``policy`` for ``labels`` [...] (checked by the caller).
    One host synchronisation (see the module's docstring); none with ``check_inputs=False`` (nothing is
    checked then, and every row is passed: see ``ScoredTokens.unscored``).

    inv_temp: float32 1 / temperature in the labels' shape (``api.inv_temperature``: NaN where out of range).
    seq_first: the hidden states are [s, b, H] while labels (and every per-token input, and the
    sequences of the aggregation) are [b, s] (Megatron's layout); rows are then taken in [s, b] order.
    hidden: None, or the hidden states [N, H] in the rows' order: checked finite at the scored rows, in the
    same synchronisation.
    """
    valid = labels != ignore_index
    named, cu, cu_ok = check_layout(labels, policy, seq_first)
    inv_t = inv_temp

    def rows_order(t: Tensor) -> Tensor:
        return (t.t() if seq_first else t).reshape(-1)
    flat_labels, flat_valid = rows_order(labels).long(), rows_order(valid)
    flat_inputs = {name: rows_order(t) for name, t in named}
    row_shape = tuple(labels.t().shape if seq_first else labels.shape)
    if not check_inputs:
        return _unchecked(labels, valid, flat_labels, flat_valid, flat_inputs, rows_order(inv_t), policy, cu,
                          vocab, rows_order, row_shape)

    # The call's checks and its scored-token count, fetched together as float64 (few kernels: on a GPU each
    # is host time while the GPU waits): the count; the smallest and largest scored label and value of each
    # per-token input (ignored tokens read as 0; a NaN or inf at a scored token makes that input's minimum or
    # maximum non-finite); the smallest and largest inverse temperature; whether cu_seqlens holds. The labels
    # join the inputs as floats: rounding is monotonic and the vocabulary's size exact in that float type, so
    # a label outside [0, vocab) stays outside.
    total = flat_labels.numel()
    fetch = [flat_valid.sum(dtype=torch.float64)]
    if total:
        as_float = torch.float32 if vocab <= 2 ** 24 else torch.float64
        checked = dict(flat_inputs)
        if policy.rollout_nan_is_missing and "rollout_logprobs" in checked:
            # NaN marks a token the rollout engine could not score (allowed); an infinity is still refused
            checked["rollout_logprobs"] = checked["rollout_logprobs"].nan_to_num(nan=0.0, posinf=math.inf,
                                                                               neginf=-math.inf)
        stacked = torch.stack([t.to(as_float) for t in (flat_labels, *checked.values())])   # [1 + k, total]
        fetch += torch.aminmax(torch.where(flat_valid, stacked, 0), dim=1)
        fetch += torch.aminmax(inv_t)
        if hidden is not None:
            fetch.append(checks.non_finite_rows(hidden, flat_valid))
    if cu_ok is not None:
        fetch.append(cu_ok)
    values = iter(torch.cat([f.reshape(-1) for f in fetch]).tolist())
    n = int(next(values))
    bad_label = bad_temp = bad_hidden = False
    bad_inputs = [False] * len(flat_inputs)
    above_zero = []
    if total:
        rows_checked = 1 + len(flat_inputs)
        lows, highs = [next(values) for _ in range(rows_checked)], [next(values) for _ in range(rows_checked)]
        bad_label = lows[0] < 0 or highs[0] >= vocab
        bad_inputs = [not (math.isfinite(lo) and math.isfinite(hi)) for lo, hi in zip(lows[1:], highs[1:], strict=True)]
        lowest, highest = next(values), next(values)
        # out-of-range temperatures have a NaN inverse (checks.inverse_temperature), which fails both
        bad_temp = not (lowest >= 0 and highest <= checks.MAX_INVERSE_TEMPERATURE)
        bad_hidden = hidden is not None and bool(next(values))
        above_zero = [name for name, hi in zip(flat_inputs, highs[1:], strict=True)
                      if name in LOGPROB_INPUTS and hi > LOGPROB_MAX]
    bad_cu = cu_ok is not None and not next(values)

    if bad_cu:
        raise cu_seqlens_error(cu, labels.numel())
    if bad_temp:
        raise ValueError(f"{checks.TEMPERATURE_RULE} everywhere")   # as fused_logprobs says it
    if bad_label:
        checks.check_label_range(flat_labels, flat_valid, vocab, ignore_index)
    bad = [name for name, b in zip(flat_inputs, bad_inputs, strict=True) if b]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be finite at every scored token (label != ignore_index), "
                         "as float32")
    if above_zero:
        raise ValueError(f"{', '.join(above_zero)} must be log-probabilities (<= 0) at every scored token; got values "
                         f"above 0 (probabilities given by mistake?)")
    if bad_hidden:
        raise ValueError(checks.NON_FINITE_HIDDEN)

    # nonzero_static: the count is known, so the indices need no second synchronisation
    rows = None if n == total else torch.nonzero_static(flat_valid, size=n).squeeze(1)

    def pick(t: Tensor, dtype) -> Tensor:
        t = t if rows is None else t.index_select(0, rows)
        return t.to(dtype)

    def make_inputs() -> TokenInputs:
        weights = rows_order(token_weights(valid, policy.loss_agg, cu))
        ent_weights, kl_weights = (
            None if agg is None or agg == policy.loss_agg
            else pick(rows_order(token_weights(valid, agg, cu)), torch.float64)
            for agg in (policy.entropy_agg, policy.kl_agg))
        given = {name: pick(t, torch.float64) for name, t in flat_inputs.items()}
        seq, n_seq, horizon = sequence_ids(labels, cu)
        seq = None if seq is None else pick(rows_order(seq), torch.long)
        rollout_weights = given.get("rollout_weights")
        if policy.rollout_is is not None:
            rollout_weights = rollout_is_weights(given["old_logprobs"], given["rollout_logprobs"], seq, n_seq, policy)
        return TokenInputs(given["advantages"], given.get("old_logprobs"), given.get("ref_logprobs"),
                           pick(weights, torch.float64), seq=seq, n_seq=n_seq, ent_weights=ent_weights,
                           rollout=given.get("rollout_logprobs"), rollout_weights=rollout_weights, horizon=horizon,
                           kl_weights=kl_weights)
    return ScoredTokens(rows=rows, total=total, labels=pick(flat_labels, torch.long),
                        inv_temp=pick(rows_order(inv_t), torch.float32), make_inputs=make_inputs,
                        row_shape=row_shape)


def _unchecked(labels, valid, flat_labels, flat_valid, flat_inputs, flat_inv_t, policy, cu, vocab, rows_order,
               row_shape) -> ScoredTokens:
    """Every row, no value read on the host (CUDA-graph capture): rows that are not scored (and labels out of
    range, which are not caught) get label -1, inverse temperature 1, inputs and weights 0, so that NaN
    padding there reaches no sum and no gradient."""
    unscored = ~flat_valid
    in_range = flat_valid & (flat_labels >= 0) & (flat_labels < vocab)

    def make_inputs() -> TokenInputs:
        weights = rows_order(token_weights(valid, policy.loss_agg, cu)).double()
        given = {name: t.double().masked_fill(unscored, 0.0) for name, t in flat_inputs.items()}
        ent_weights, kl_weights = (
            None if agg is None or agg == policy.loss_agg else rows_order(token_weights(valid, agg, cu)).double()
            for agg in (policy.entropy_agg, policy.kl_agg))
        seq, n_seq, horizon = sequence_ids(labels, cu)
        seq = None if seq is None else rows_order(seq)
        return TokenInputs(given["advantages"], given.get("old_logprobs"), given.get("ref_logprobs"), weights,
                           seq=seq, n_seq=n_seq, ent_weights=ent_weights, rollout=given.get("rollout_logprobs"),
                           rollout_weights=given.get("rollout_weights"), horizon=horizon, kl_weights=kl_weights)
    return ScoredTokens(rows=None, total=flat_labels.numel(), labels=flat_labels.masked_fill(~in_range, -1),
                        inv_temp=flat_inv_t.float().masked_fill(unscored, 1.0), make_inputs=make_inputs,
                        row_shape=row_shape, unscored=unscored)



ROLLOUT_LOG_CLAMP = 20.0     # verl's SAFETY_BOUND on the rollout log-ratio


def sequence_needs(policy: PolicyLoss) -> list:
    """(whether the setting is on, its name) for the settings that need the labels to delimit sequences."""
    return [(policy.ratio_level != "token", f"ratio_level={policy.ratio_level!r}"),
            (policy.surrogate in ("vespo", "geo_mean"), f"surrogate={policy.surrogate!r}"),
            (policy.off_policy_threshold is not None, "off_policy_threshold"),
            (policy.rollout_is is not None and policy.rollout_is.startswith("sequence"),
             f"rollout_is={policy.rollout_is!r}"),
            (policy.current_is is not None and policy.current_is.startswith("sequence"),
             f"current_is={policy.current_is!r}"),
            (any(getattr(policy, name) is not None for name in policy.__dataclass_fields__
                 if name.startswith("rejection_seq_")), "a sequence-level rejection (rejection_seq_*)")]


def sequence_ids(labels: Tensor, cu: Optional[Tensor]):
    """(int64 sequence index of every position in the labels' layout or None, the number of sequences,
    the horizon: the sequence axis' size, or the longest packed sequence)."""
    if cu is not None:
        lengths = cu[1:] - cu[:-1]
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=labels.device), lengths)
        return seq, lengths.numel(), lengths.max().clamp_min(1).double()   # a tensor: no host read
    if labels.dim() < 2:
        return None, 0, 1.0
    s = labels.shape[-1]
    n_seq = labels.numel() // max(s, 1)
    seq = torch.arange(n_seq, device=labels.device).repeat_interleave(s).view(labels.shape)
    return seq, n_seq, float(s)


def rollout_is_weights(old: Tensor, rollout: Tensor, seq: Optional[Tensor], n_seq: int, policy: PolicyLoss) -> Tensor:
    """float64 [n]: TRL's vLLM importance-sampling ratio of the scored tokens (``PolicyLoss.rollout_is``); a
    NaN rollout log-prob (``rollout_nan_is_missing``) gives a log-ratio of 0, as TRL's nan_to_num."""
    diff = (old - rollout).nan_to_num(nan=0.0)
    sequence = policy.rollout_is.startswith("sequence")
    if sequence:
        diff = diff.new_zeros(n_seq).index_add_(0, seq, diff)[seq]
    # verl clamps the log-ratio to +-20 (TRL does not: the same weights unless exp(+-20) is inside the band)
    rho = diff.clamp(-ROLLOUT_LOG_CLAMP, ROLLOUT_LOG_CLAMP).exp()
    lo = -math.inf if policy.rollout_is_min is None else policy.rollout_is_min
    hi = math.inf if policy.rollout_is_max is None else policy.rollout_is_max
    if policy.rollout_is.endswith("truncate"):
        rho = rho.clamp(min=policy.rollout_is_min, max=hi)
    else:
        rho = rho.masked_fill((rho < lo) | (rho > hi), 0.0)
    if policy.rollout_is_batch_normalize and rho.numel():
        # verl's rollout_is_batch_normalize: the mean weight over the tokens (or the sequences) made 1
        if sequence:
            per_seq = rho.new_zeros(n_seq).index_add_(0, seq, rho)
            count = rho.new_zeros(n_seq).index_add_(0, seq, torch.ones_like(rho))
            mean = (per_seq / count.clamp_min(1e-8))[count > 0].mean()
        else:
            mean = rho.mean()
        rho = torch.where(mean > 1e-8, rho / mean, rho)
    return rho
