"""``install(fused_loss=True)`` on verl's Megatron engine: the actor's policy loss, KL loss and entropy bonus
computed by ``fused_policy_loss`` inside the model's forward, through Megatron-Core's output processor with a
``FusedOutputProcessorContext(loss=PolicyLoss(...))`` (``logitless.megatron.fused_output_processor``).

verl's actor update (``TrainingWorker.train_batch`` -> ``MegatronEngine.forward_backward_batch``) runs
Megatron's pipeline schedule, which calls, per micro-batch, ``MegatronEngineWithLMHead.forward_step(batch_iter,
model, logits_processor_func=loss_function, postprocess_micro_batch_func)``. With ``use_fused_kernels=True``
that forward step runs ``fused_forward_model_engine``: the batch packed as THD (``preprocess_thd_engine``),
the model called with verl's ``fused_output_processor`` (the log-probs and entropy on the final hidden
states, megatron-core 0.18+ "hook" mode), the outputs unpacked; it returns them with
``postprocess_micro_batch_func``, which the schedule calls next and which calls ``loss_function`` =
``partial(verl.workers.utils.losses.ppo_loss, config=actor_config)``.

Two sites change that under ``install(fused_loss=True)``:
- ``MegatronEngineWithLMHead.forward_step``: for a micro-batch whose settings map onto the fused loss
  (``fused_loss.make_plan``, and the Megatron settings of ``unfusable`` below) it lays out the response
  tokens' inputs (``tokens.py``), runs verl's forward step with the plan pending on this thread, and hands
  the schedule verl's post-processing with the fused loss function (``fused_loss._fused_loss_function``:
  the fused loss in verl's normalisation, verl's own ``ppo_loss`` for the metrics, without gradients).
- verl's ``fused_output_processor``: under a pending plan, ``logitless.megatron.fused_output_processor``
  with the policy loss in its context, the packed sequences delimited by Megatron's
  ``packed_seq_params.cu_seqlens_q_padded``; it returns verl's output type with the fused pass's detached
  log-probs (carrying the loss, see ``fused_loss.head``) and entropies, from which verl unpacks its model
  output as usual. Without a plan, verl's own processor runs (whose head is logitless' as well).

A micro-batch that cannot run fused runs verl's own loss, recorded (path "unfused", entry
"verl.policy_loss"), logged once per reason, and raised as ``FusedPathUnavailable`` under strict mode: the
settings of ``fused_loss.make_plan`` plus a sequence-coupled loss under context parallelism
(``megatron_cp.refusals``), dynamic context parallelism, a model neither hook nor legacy path reaches
(``megatron_legacy.unroutable``) and a loss mode outside ``MODES``. A fused micro-batch records path "hook"
(Megatron's output-processor hook) or "legacy" (megatron-core < 0.18: verl's legacy fused forward replaced by
logitless' legacy patch running the same processor, ``megatron_legacy.py``) and entry
"verl.policy_loss", with the backend that ran.

verl's distillation loss (``distillation_ppo_loss``) takes its own path through both sites: ``megatron_distill.py``.

Under ``install(truncation=True)`` the fused loss is not run here: the first training micro-batch raises
ValueError (``TRUNCATION_REFUSED``) before the model runs; the forward-only calls (old and reference log-probs)
and ``install(truncation=True)`` without ``fused_loss`` take the truncated head (``core.py``) as before.

Pipeline parallelism (with or without virtual stages): Megatron's schedule calls the forward step on every stage
and the loss function on the last one only. Each stage makes the same plan from the same micro-batch (verl
hands every pipeline rank the whole batch); on a stage without the output layer (``post_process=False``) the
processor never runs and verl's forward returns the stage's hidden states, which the schedule sends on; the
last stage's processor computes the fused loss, and its backward reaches the earlier stages through the
schedule's gradient sends, as verl's own loss does.
"""
from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from ..losses import PolicyLoss
from ..record import write_record
from . import megatron_cp, megatron_distill, truncation
from .distill import is_distillation
from .fused_loss import ENTRY, Plan, _fused_loss_function, fallback, make_plan
from .megatron_legacy import forward_mode, planned_forward, unroutable
from .policy import loss_mode
from .sites import Site, SiteState
from .tokens import IGNORE, ResponseTokens, Rows, thd_destinations

ENGINE = "verl.workers.engine.megatron.transformer_impl"
FUSED = "verl.models.mcore.model_forward_fused"
# install(fused_loss=True, truncation=True): the rollout's truncation is not threaded through the processor's
# PolicyLoss (logitless.megatron.fused_output_processor) yet; refused at the first training micro-batch, before
# the model runs, rather than computing a full-softmax loss beside truncated old log-probs
TRUNCATION_REFUSED = ("install(fused_loss=True, truncation=True) on verl's Megatron engine: the fused policy loss "
                      "does not take the rollout's truncation there (it does on the FSDP engine); use "
                      "install(truncation=True) without fused_loss on Megatron")


class _Pending(threading.local):
    plan: Optional[Plan] = None


_pending = _Pending()


def thd_rows(tokens: ResponseTokens, labels: torch.Tensor, cu_padded: torch.Tensor) -> Rows:
    """The inputs laid out like verl's packed THD labels [1, n]: sequence i at rows [cu_padded[i],
    cu_padded[i] + its length) (verl pads each sequence to a multiple of the TP size, and the tail),
    1-D [n], with the sequences' padded boundaries (the tail past cu_padded[-1] a segment of its own).
    ValueError when labels or cu_padded do not fit the micro-batch."""
    dest = thd_destinations(tokens, labels, cu_padded)
    n, dev = labels.shape[1], labels.device
    cu = cu_padded.to("cpu", torch.long)

    def lay(t, fill):
        if t is None:
            return None
        out = torch.full((n,), fill, dtype=t.dtype, device=dev)
        return out.index_copy(0, dest, t.to(dev))
    scored = lay(tokens.scored, False)
    bounds = cu if int(cu[-1]) == n else torch.cat([cu, cu.new_tensor([n])])
    return Rows(labels=torch.where(scored, labels.reshape(-1), IGNORE), advantages=lay(tokens.advantages, 0.0),
                old_logprobs=lay(tokens.old_logprobs, 0.0), ref_logprobs=lay(tokens.ref_logprobs, 0.0),
                rollout_weights=lay(tokens.rollout_weights, 0.0), cu_seqlens=bounds.to(dev))


# the loss modes whose fused loss on this engine has been checked against verl's (the PolicyLoss built in
# _make_processor carries their inputs); a mode the FSDP side learns later is refused here until wired
MODES = ("vanilla", "gspo", "sapo", "gpg", "cispo", "dro", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean",
         "bypass_mode")


def unfusable(engine, model, config) -> list:
    """Megatron engine settings (and the actor ``config``'s loss mode) the fused loss does not run under, as
    "setting (why)"."""
    cfg = engine.engine_config
    bad = []
    mode = loss_mode(config)
    if mode not in MODES:
        bad.append(f"policy_loss.loss_mode={mode!r} (not wired to the fused loss on verl's Megatron engine)")
    if getattr(cfg, "dynamic_context_parallel", False):
        bad.append("dynamic_context_parallel=True (not wired to the fused loss)")
    why = unroutable(model)      # megatron-core < 0.18: logitless' legacy patch (megatron_legacy.py)
    if why:
        bad.append(why)
    return bad


def _context_parallel():
    """(group, size, rank) of Megatron's context-parallel group when its size is > 1, else None."""
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        return None
    size = parallel_state.get_context_parallel_world_size()
    if size <= 1:
        return None
    return parallel_state.get_context_parallel_group(), size, parallel_state.get_context_parallel_rank()


def _make_processor(original):
    @functools.wraps(original)
    def fused_output_processor(*, hidden_states, output_layer, output_weight, labels, context, config, **kwargs):
        """verl's output processor; under a pending plan, the fused policy loss (see the module docstring), or
        under a pending top-k distillation plan the divergence beside verl's outputs (``megatron_distill.py``)."""
        distillation = megatron_distill.pending()
        if distillation is not None and distillation.result is None:
            return megatron_distill.processor(original, distillation, hidden_states=hidden_states,
                                              output_layer=output_layer, output_weight=output_weight, labels=labels,
                                              context=context, config=config, **kwargs)
        plan = _pending.plan
        if plan is None or plan.result is not None or plan.failure:
            return original(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                            labels=labels, context=context, config=config, **kwargs)
        packed = kwargs.get("packed_seq_params")
        try:
            if packed is None or getattr(packed, "cu_seqlens_q_padded", None) is None:
                raise ValueError("Megatron passed no packed_seq_params.cu_seqlens_q_padded (verl's THD layout)")
            cp = _context_parallel()
            if cp is None:
                rows = thd_rows(plan.tokens, labels, packed.cu_seqlens_q_padded)
            else:      # this rank's slice of verl's zigzag split (megatron_cp.py)
                cu = packed.cu_seqlens_q_padded
                whole = thd_rows(plan.tokens, labels.new_zeros(1, int(cu[-1])), cu)
                rows = megatron_cp.local_rows(whole, labels, cu, cp[1], cp[2])
        except ValueError as exc:
            plan.failure = str(exc)
            return original(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                            labels=labels, context=context, config=config, **kwargs)
        from ..megatron.processor import FusedOutputProcessorContext
        from ..megatron.processor import fused_output_processor as processor

        def row(t):
            return None if t is None else t.view(1, -1)
        policy = PolicyLoss(advantages=row(rows.advantages), old_logprobs=row(rows.old_logprobs),
                            ref_logprobs=row(rows.ref_logprobs) if plan.use_ref else None,
                            rollout_weights=row(rows.rollout_weights), cu_seqlens=rows.cu_seqlens,
                            **plan.settings_for(rows.sequences))
        ctx = FusedOutputProcessorContext(temperature=float(context.temperature), loss=policy)
        plan.rng = torch.get_rng_state()
        out = processor(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                        labels=rows.labels.view(1, -1), context=ctx, config=config, **kwargs)
        plan.result = out
        from verl.utils.model import CausalLMOutputForPPO
        result = CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None, hidden_states=hidden_states,
                                      attentions=None)
        # the log-probs carry the loss (+ L - L, 0 in value): the loss function takes its gradient path through
        # the model's output, as verl's own loss does (see fused_loss.head)
        result.log_probs = out.logprobs + (out.loss - out.loss.detach())
        result.entropy = out.entropy
        return result

    return fused_output_processor


def _make_forward_step(original):
    @functools.wraps(original)
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        # install(truncation=True): verl's logits path would give full-softmax log-probs (the batch's setting
        # must equal the engine's, which verl switches off without remove-padding)
        truncation.require_fused(bool(self.engine_config.use_fused_kernels))
        forward_only = getattr(postprocess_micro_batch_func, "keywords", {}).get("forward_only", False)
        if not SiteState.fused_loss or forward_only or logits_processor_func is None:
            return original(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        if truncation.current() is not None:
            raise ValueError(TRUNCATION_REFUSED)
        batch = next(batch_iter)
        if is_distillation(logits_processor_func):
            return megatron_distill.forward_step(original, self, batch, model, logits_processor_func,
                                                 postprocess_micro_batch_func)
        plan, why = make_plan(self, batch, logits_processor_func)
        cp = None
        if plan is not None:
            config = logits_processor_func.keywords["config"]
            bad = unfusable(self, model, config)
            cp = _context_parallel()
            if cp is not None:
                bad += megatron_cp.refusals(plan.settings, plan.micro_batch_mean, mode=loss_mode(config),
                                            agg=config.loss_agg_mode,
                                            tensor_parallel=int(self.engine_config.tensor_model_parallel_size or 1))
            if bad:
                plan, why = None, "; ".join(bad)
        if plan is None:
            if why:
                fallback(why)          # raises under strict mode, before the model runs
            out = original(self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
            if why:     # again after the forward, whose head (logitless') wrote a record of its own
                write_record("unfused", None, ENTRY, why)
            return out
        path = forward_mode(model)
        with planned_forward(_pending, plan, model, path):
            output, loss_func = original(self, iter([batch]), model, logits_processor_func,
                                         postprocess_micro_batch_func)
        # verl's post-processing (its loss scaling for Megatron's schedule, metrics, model output) with the
        # fused loss function in place of verl's; under CP this rank's share, summed over the group in value
        through = None if cp is None else (lambda model_output, loss: megatron_cp.carry(loss, cp[0]))
        return output, functools.partial(loss_func, loss_function=_fused_loss_function(plan, logits_processor_func,
                                                                                       path=path, through=through))

    return forward_step


SITES = (
    Site("megatron.engine.forward_step", ENGINE, "MegatronEngineWithLMHead", "forward_step", _make_forward_step,
         "the Megatron engine's forward step: the actor's policy loss fused into the output processor under "
         "install(fused_loss=True)"),
    Site("megatron.fused_output_processor", FUSED, None, "fused_output_processor", _make_processor,
         "verl's output processor (hook mode): the fused policy loss under a pending plan"),
)
