"""``install(fused_loss=True)`` on verl's FSDP engine: the actor's policy loss, KL loss and entropy bonus
computed by ``fused_policy_loss`` inside the model's forward, from the final hidden states and the LM head.

verl's actor update (``TrainingWorker.train_batch`` -> ``FSDPEngine.forward_backward_batch``) calls, per
micro-batch, ``FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)``: the model's
forward (verl's fused forward with ``use_fused_kernels=True``: backbone, then the fused head on the hidden
states), ``prepare_model_outputs`` (log-probs and entropy per token), then ``loss_function`` =
``partial(verl.workers.utils.losses.ppo_loss, config=actor_config)``, which sees only those log-probs.

Here ``forward_step`` is replaced. For a micro-batch whose settings map onto the fused loss (``policy.py``)
it lays out the response tokens' inputs (``tokens.py``) and runs verl's own ``forward_step`` with a plan
pending on this thread: the fused head (``fsdp.py``'s sites call ``head``) then computes
``fused_policy_loss`` instead of the log-probs alone (its gradients are formed in that pass) and returns
its detached log-probs and entropies, from which verl builds its model output as usual. The loss function
verl then calls returns that loss, times the constant that gives verl's normalisation, and verl's own
metrics: ``ppo_loss`` itself, run without gradients on those detached log-probs and entropies, so every
metric keeps verl's name, aggregation type and formula (pg_loss, pg_clipfrac, pg_clipfrac_lower, ppo_kl,
entropy_loss, kl_loss, kl_coef). verl's micro-batching, gradient accumulation, dynamic batch size,
remove-padding and loss scaling run unchanged around it; under Ulysses sequence parallelism the head gathers
the sp group's rows first (``ulysses.py``).

A micro-batch that cannot run fused (bypass_mode's sequence-level rejection sampling and batch-normalised IS weights,
``use_fused_kernels=False``, ...; ``policy.unfusable``, ``bypass.py`` and ``make_plan`` list them)
runs verl's own loss: recorded (``last_path()``: path "unfused", entry "verl.policy_loss", the reason),
logged once per reason, and under strict mode raised as ``FusedPathUnavailable`` instead. A fused
micro-batch records path "fsdp" with the backend that ran.

Under ``install(truncation=True)`` (``truncation.py``) the fused loss is that of the rollout's truncated
distribution: ``head`` passes the worker call's ``Truncation`` to ``policy_loss`` (the log-probs, ratio and
entropy of the truncated, renormalised distribution; the exact four-GEMM path), so the loss, its gradients and
verl's metrics are those of verl's own loss on logitless' truncated log-probs. A micro-batch that falls back
computes truncated log-probs in the head as usual (``core.py``); either way ``truncation.check_ran`` makes sure
a truncated head ran. verl's Megatron engine refuses the combination (``megatron_loss.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import torch

from ..api import head_operands
from ..losses import PolicyLoss, PolicyLossOutput, policy_loss
from ..record import FusedPathUnavailable, last_backend, write_record
from . import distill, truncation, ulysses
from .bypass import rejection_counts_missing
from .policy import (
    MICRO_BATCH_MEAN,
    loss_mode,
    loss_scale,
    micro_batch_mean,
    pg_agg_mode,
    separate_terms,
    settings,
    unfusable,
    uses_batch_is_weights,
)
from .sites import Site, SiteState, strict_mode
from .tokens import ResponseTokens, for_rows, response_tokens

ENGINE = "verl.workers.engine.fsdp.transformer_impl"
ENTRY = "verl.policy_loss"
logger = logging.getLogger("logitless.verl")
_logged: set = set()


@dataclass
class Plan:
    """One micro-batch's fused loss: its inputs, settings and scale; ``result`` once the head ran, or
    ``failure`` saying why it could not (then verl's own loss runs)."""
    tokens: ResponseTokens
    settings: dict            # PolicyLoss keyword arguments but the per-token tensors
    use_ref: bool
    scale: float              # the fused loss times this is verl's (a micro-batch-mean mode: ``settings_for``)
    micro_batch_mean: bool = False     # policy.MICRO_BATCH_MEAN (geo_mean): settings and scale follow the rows
    sequence_parallel: bool = False    # verl's Ulysses: the head gathers the sp group's rows (ulysses.py)
    shard: Optional[object] = None     # then this rank's slice of them (ulysses.Shard), set by ``head``
    result: Optional[PolicyLossOutput] = None
    failure: str = ""
    rng: Optional[torch.Tensor] = None     # the CPU generator's state when the loss drew (clip_cov's randperm)

    def settings_for(self, sequences: int) -> dict:
        """The PolicyLoss settings for rows that delimit ``sequences`` sequences (packed: cu_seqlens' segments;
        padded: the rows). Call once, as the head builds the loss: for a micro-batch-mean mode (geo_mean) this
        also sets ``scale`` (``policy.micro_batch_mean``)."""
        if not self.micro_batch_mean:
            return self.settings
        kwargs, self.scale = micro_batch_mean(self.settings, self.scale, loss_sequences=sequences,
                                              batch_sequences=self.tokens.batch)
        return kwargs


class _Pending(threading.local):
    plan: Optional[Plan] = None


_pending = _Pending()


def fallback(reason: str, entry: str = ENTRY, loss: str = "policy loss") -> None:
    """verl computes this micro-batch's ``loss`` itself: record under ``entry``, then raise (strict) or log once."""
    write_record("unfused", None, entry, reason)
    if strict_mode():
        raise FusedPathUnavailable(f"verl's {loss} cannot run fused: {reason} (logitless.verl strict mode: "
                                   "install(strict=True) or LOGITLESS_STRICT=1)")
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("logitless.verl: verl computes the %s itself (unfused): %s", loss, reason)


def head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature, flat: bool = False):
    """For the FSDP head sites: under a pending plan, the fused policy loss of ``hidden`` [..., H] against
    ``labels`` (the model's next-token labels, [1, n] packed or [b, S]); returns (log-probs, entropy)
    float32 shaped like labels (flat: 1-D), 0 at positions outside the loss, the log-probs carrying the
    loss (see below). None when no plan is pending (or it cannot use these rows: the plan records why and
    the head computes the log-probs as usual)."""
    plan = _pending.plan
    if plan is None or plan.result is not None or plan.failure:
        return None
    h, w = head_operands(hidden.reshape(-1, hidden.shape[-1]), weight)
    rows_labels, shard = labels, None
    grp = ulysses.group() if plan.sequence_parallel else None
    if grp is not None:
        # the whole micro-batch's rows, on every sp rank (ulysses.py); every rank takes this branch
        h, rows_labels, shard = ulysses.gather(h, labels.reshape(-1), grp)
        rows_labels = rows_labels.view(1, -1)
    try:
        rows = for_rows(plan.tokens, rows_labels)
    except ValueError as exc:
        if shard is not None:
            raise          # the model's output would miss the gathered rows: no fallback after the gather
        plan.failure = str(exc)
        return None
    policy = PolicyLoss(advantages=rows.advantages, old_logprobs=rows.old_logprobs,
                        ref_logprobs=rows.ref_logprobs if plan.use_ref else None,
                        rollout_weights=rows.rollout_weights, cu_seqlens=rows.cu_seqlens,
                        **plan.settings_for(rows.sequences))
    trunc = truncation.current()       # install(truncation=True): the rollout's truncated distribution
    plan.rng = torch.get_rng_state()
    with torch.autocast(h.device.type, enabled=False):
        out = policy_loss(policy, h.view(*rows.labels.shape, h.shape[-1]), w, rows.labels,
                          temperature=float(temperature), truncation=trunc)
    if trunc is not None:
        truncation.note_head()
    plan.result = out
    plan.shard = shard
    lp, ent = out.logprobs, out.entropy
    if shard is not None:
        lp, ent = lp.reshape(-1)[shard.start:shard.stop], ent.reshape(-1)[shard.start:shard.stop]
    # The loss leaves the model through its output: the log-probs carry it (+ L - L, exactly 0 in value),
    # and the loss function takes its gradient path through them, so the backward hooks that wrappers
    # register on the model's outputs (FSDP's pre-backward unshard of the root's parameters) run before
    # the backward reaches the head, as for verl's own loss.
    carrier = out.loss - out.loss.detach()
    shape = (-1,) if flat else labels.shape
    return lp.reshape(shape) + carrier, ent.reshape(shape)


def _policy_config(loss_function):
    """The ActorConfig of ``partial(verl.workers.utils.losses.ppo_loss, config=...)``, else None."""
    from verl.workers.utils import losses
    if isinstance(loss_function, functools.partial) and loss_function.func is losses.ppo_loss:
        return loss_function.keywords.get("config")
    return None


def make_plan(engine, micro_batch, loss_function) -> tuple[Optional[Plan], str]:
    """(Plan, "") when this micro-batch's loss runs fused; (None, why) when it cannot; (None, "") when
    there is no policy loss to fuse (a critic's value loss)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead
    if isinstance(engine, FSDPEngineWithValueHead):
        return None, ""

    def get(key, default=None):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)
    config = _policy_config(loss_function)
    if config is None:
        name = getattr(getattr(loss_function, "func", loss_function), "__qualname__", type(loss_function).__name__)
        return None, f"the loss function {name} is not verl's ppo_loss"
    entropy = bool(get("calculate_entropy", False))
    bad = unfusable(config, with_entropy=entropy)
    if not get("use_fused_kernels", False):
        bad.append("use_fused_kernels=False (the model would build the logits; set "
                   "actor_rollout_ref.model.use_fused_kernels=True)")
    if get("distillation_use_topk", False) or get("distillation_only", False):
        bad.append("top-k distillation (its loss needs the logits)")
    if get("return_model_output", False):
        bad.append("return_model_output=True (the fused loss computes the log-probs of the response tokens only)")
    if bad:
        return None, "; ".join(bad)
    tokens, why = response_tokens(micro_batch, with_ref=bool(config.use_kl_loss))
    if tokens is None:
        return None, why
    if not uses_batch_is_weights(config):
        tokens = dataclasses.replace(tokens, rollout_weights=None)
    sequence_parallel = bool(getattr(engine, "use_ulysses_sp", False))
    if sequence_parallel:
        bucket = getattr(engine, "_get_packed_pad_size", None)     # verl's pad_to_length bucket padding
        why = ulysses.empty_rank(tokens.total, int(engine.ulysses_sequence_parallel_size),
                                 int(bucket(tokens.total)) if bucket is not None else 0)
        if why:
            return None, why
    kwargs = settings(config, calculate_entropy=entropy)
    why = rejection_counts_missing(kwargs, config.loss_agg_mode, batch_num_tokens=get("batch_num_tokens"),
                                   global_batch_size=get("global_batch_size"))
    if why:
        return None, why
    counts = dict(dp_size=get("dp_size", 1), batch_num_tokens=get("batch_num_tokens"),
                  global_batch_size=get("global_batch_size"), scored_tokens=tokens.count,
                  scored_sequences=tokens.sequences, response_width=tokens.width)
    scale = loss_scale(config, **counts)
    if pg_agg_mode(config) != config.loss_agg_mode:      # sapo: one aggregation per term
        kwargs = separate_terms(kwargs, scale, loss_scale(config, agg_mode=config.loss_agg_mode, **counts))
    return Plan(tokens, kwargs, bool(config.use_kl_loss), scale, loss_mode(config) in MICRO_BATCH_MEAN,
                sequence_parallel), ""


def _through_output(model_output, loss: torch.Tensor, shard=None) -> torch.Tensor:
    """``loss`` in value, with its gradient path through the model's output log-probs (which carry it,
    see ``head``) rather than straight to the head: their first element, or under Ulysses (``shard``) the
    first element of this rank's slice over the sp size (verl's gather multiplies its gradient back)."""
    lp = model_output["log_probs"]
    flat = (lp.values() if lp.is_nested else lp).reshape(-1)
    start = 0 if shard is None else shard.start
    first = flat[start:start + 1].sum()
    if not first.requires_grad:
        raise RuntimeError("logitless.verl: the model's log-probs lost the fused loss they carry (verl's "
                           "prepare_model_outputs detached them?)")
    carried = first - first.detach()
    return (carried if shard is None else carried / shard.size) + loss.detach()


def _fused_loss_function(plan: Plan, verl_loss, path: str = "fsdp", through=None):
    """``through(model_output, loss)``: the loss with its gradient path (default ``_through_output``; the
    Megatron engine's context parallelism passes ``megatron_cp.carry``)."""
    def loss_function(model_output, data, dp_group=None):
        """The fused loss in verl's normalisation, and verl's metrics of the same log-probs."""
        if plan.result is None:
            fallback(plan.failure or "the model's forward did not reach the fused head (is it verl's fused "
                     "forward, use_fused_kernels=True?)")
            return verl_loss(model_output=model_output, data=data, dp_group=dp_group)
        # verl's metrics draw what the loss drew (clip_cov's random token choice): the generator is set back
        # to its state when the fused loss drew, and then to where the fused loss left it
        after = torch.get_rng_state()
        torch.set_rng_state(plan.rng)
        try:
            with torch.no_grad():
                _, metrics = verl_loss(model_output=model_output, data=data, dp_group=dp_group)
        finally:
            torch.set_rng_state(after)
        write_record(path, last_backend(), ENTRY)
        loss = (through(model_output, plan.result.loss) if through is not None
                else _through_output(model_output, plan.result.loss, plan.shard))
        return loss * plan.scale, metrics
    return loss_function


def _distill_fallback(reason: str) -> None:
    """verl computes this distillation micro-batch's loss itself (from the logits)."""
    fallback(reason, distill.ENTRY, "distillation loss")


def _distillation_step(original, engine, micro_batch, loss_function, forward_only):
    """A micro-batch of verl's distillation loss (``distill.py``)."""
    plan, why = distill.make_plan(engine, micro_batch, loss_function)
    if plan is None:
        if why:
            _distill_fallback(why)
            out = original(engine, micro_batch, loss_function, forward_only)
            write_record("unfused", None, distill.ENTRY, why)      # again after the forward (its ops' records)
            return out

        def estimator(model_output, data, dp_group=None):      # verl's loss on the fused head's log-probs
            out = loss_function(model_output=model_output, data=data, dp_group=dp_group)
            write_record("fsdp", last_backend(), distill.ENTRY)
            return out
        return original(engine, micro_batch, estimator, forward_only)
    with distill.planned(plan):
        return original(engine, micro_batch, distill.loss_function(plan, loss_function, _distill_fallback),
                        forward_only)


def _make_forward_step(original):
    def step(self, micro_batch, loss_function, forward_only):
        if not SiteState.fused_loss or forward_only or loss_function is None:
            return original(self, micro_batch, loss_function, forward_only)
        if distill.is_distillation(loss_function):
            if truncation.current() is not None:     # the worker refuses it first; distill.head is not truncated
                raise ValueError("truncation=True with verl's distillation loss: the teacher's log-probs are not "
                                 "truncated; install(truncation=False) for distillation")
            return _distillation_step(original, self, micro_batch, loss_function, forward_only)
        plan, why = make_plan(self, micro_batch, loss_function)
        if plan is None:
            if why:
                fallback(why)
            out = original(self, micro_batch, loss_function, forward_only)
            if why:     # again after the forward, whose ops (logitless' head) wrote records of their own
                write_record("unfused", None, ENTRY, why)
            return out
        outer, _pending.plan = _pending.plan, plan
        try:
            return original(self, micro_batch, _fused_loss_function(plan, loss_function), forward_only)
        finally:
            _pending.plan = outer

    @functools.wraps(original)
    def forward_step(self, micro_batch, loss_function, forward_only):
        if truncation.current() is None:
            return step(self, micro_batch, loss_function, forward_only)
        # install(truncation=True): every head of this micro-batch, the fused loss's (``head``) or the log-probs'
        # (core.py), is the rollout's truncated distribution; verl's logits path would be the full softmax's
        from verl.utils import tensordict_utils as tu
        truncation.require_fused(bool(tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels",
                                                             default=False)))
        with truncation.check_ran("this micro-batch's forward"):
            return step(self, micro_batch, loss_function, forward_only)

    return forward_step


SITES = (
    Site("fsdp.engine.forward_step", ENGINE, "FSDPEngineWithLMHead", "forward_step", _make_forward_step,
         "the FSDP engine's forward step: the actor's policy loss fused into the head under "
         "install(fused_loss=True)"),
)
