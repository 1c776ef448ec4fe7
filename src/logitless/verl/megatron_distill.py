"""``install(fused_loss=True)`` on verl's Megatron engine with verl's distillation (``distillation.enabled``: the
actor's loss is ``partial(distillation_ppo_loss, config=..., distillation_config=...)``); ``megatron_loss.py``'s
forward step calls in here for such a loss.

What verl does on that engine: with ``use_fused_kernels=False`` its logits processor
(``MegatronEngineWithLMHead._lm_head_logits_processor``) divides the vocab-parallel logits by the temperature and,
for ``forward_kl_topk``, calls ``distillation_ppo_loss(student_logits=...)``, which lays the teacher's top-k ids and
log-probs (nested [b, j, k]) out like the packed THD rows (``preprocess_thd_engine``) and computes, vocab-parallel,
the per-token divergence, both top-k masses and the overlap diagnostics; ``postprocess_thd_engine`` turns those rows
back into nested [b, j] model outputs, and ``distillation_ppo_loss`` then clamps, aggregates, logs and adds the
policy loss. verl's fused forward (``use_fused_kernels=True``) returns log-probs and entropy only: top-k
distillation has no fused path in verl.

Here, with verl's fused kernels on:
- ``forward_kl_topk``: verl's output processor (hook mode; on megatron-core < 0.18 reached through logitless'
  legacy patch, ``megatron_legacy.py``) computes verl's log-probs and entropy as usual (logitless' head) and, from
  the same final hidden states (gathered from sequence parallelism) and the output layer's vocabulary shard,
  logitless' ``topk_divergence`` over the TP group: the per-token divergence (verl's ``log_prob_min_clamp`` on both
  sides, the clamp at 0), the masses summed after that clamp (verl's Megatron convention,
  ``clamped_masses``), the overlap with the student's own top-k; only for the response tokens (verl's loss reads
  no other), on verl's packed rows (``cu_seqlens_q_padded``; under context parallelism the rank's rows of verl's
  zigzag split, ``megatron_cp.local_positions``). The loss function verl calls turns those rows into
  nested model outputs with verl's own ``postprocess_thd_engine`` (the names verl's logits processor gives them;
  under CP it all-gathers them over the CP group, the rank's own rows keeping their gradient, as for verl's) and
  runs verl's ``distillation_ppo_loss`` on them: loss_max_clamp, use_task_rewards with distillation_loss_coef,
  use_policy_gradient, the aggregation, the policy loss on the log-probs and every metric are verl's code. The
  divergence keeps its graph: the loss's backward reaches the hidden states and the head weight through
  logitless' pass, as the policy loss's does.
- estimator modes (k1, k3, ...): verl's loss reads only the sampled tokens' log-probs, which verl's fused forward
  computes on logitless' head; verl's loss runs on them unchanged, recorded as fused.

Recorded: path "hook" or "legacy", entry "verl.distillation". Not fused: without fused kernels verl's logits path
runs (recorded "unfused", raised under strict mode, ``fused_loss._distill_fallback``). A top-k configuration with
fused kernels that logitless does not run (``refusals``: CP with TP > 1, a model neither path reaches; a batch
``distill.make_plan`` cannot lay out) is
refused with ``FusedPathUnavailable`` naming it, strict mode or not: verl's own fused forward would fail on it (no
top-k outputs).

Under context parallelism every CP rank computes verl's whole loss from the gathered rows, and its model gets the
gradient of its own rows only: verl's own scheme, reproduced by running verl's code on the same rows.
"""
from __future__ import annotations

import functools
import threading
from typing import Optional

import torch

from ..api import head_operands
from ..losses.distill_topk import topk_divergence
from ..record import FusedPathUnavailable, last_backend, write_record
from . import distill, megatron_cp
from .megatron_legacy import forward_mode, planned_forward, unroutable
from .tokens import IGNORE, thd_destinations

ENTRY = distill.ENTRY


class _Pending(threading.local):
    plan: Optional[distill.DistillPlan] = None


_pending = _Pending()


def pending() -> Optional[distill.DistillPlan]:
    """The top-k plan of the micro-batch this thread's forward step runs (None outside one)."""
    return _pending.plan


def _context_parallel() -> tuple[int, int]:
    """(size, rank) of Megatron's context-parallel group ((1, 0) without model-parallel state)."""
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()


def refusals(engine, model) -> list:
    """Megatron settings a top-k distillation micro-batch does not run fused under, as "setting (why)"."""
    bad = []
    cp, _ = _context_parallel()
    tp = int(engine.engine_config.tensor_model_parallel_size or 1)
    if cp > 1 and tp > 1:
        bad.append(f"context_parallel_size={cp} with tensor_model_parallel_size={tp} and top-k distillation (not "
                   "tested)")
    if cp > 1 and getattr(getattr(_unwrapped(model), "config", None), "experimental_attention_variant", None) \
            == "dsv4_hybrid":      # verl's contiguous CP layout for that attention (_get_context_parallel_layout)
        bad.append("a context-parallel layout other than verl's zigzag split with top-k distillation (not wired)")
    why = unroutable(model)
    if why:
        bad.append(why)
    return bad


def _unwrapped(model):
    from verl.utils.megatron_utils import unwrap_model
    return unwrap_model(model)


def _rows(tokens, labels, cu_padded) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest, pick): the packed position p's row in verl's global padded THD layout is dest[p]; this rank's rows
    are the global rows ``pick`` (None: all of them, no context parallelism; under CP verl's zigzag split,
    ``megatron_cp.local_positions``). ValueError when the rows do not fit the micro-batch."""
    cp, rank = _context_parallel()
    if cp == 1:
        return thd_destinations(tokens, labels, cu_padded), None
    whole = labels.new_zeros(1, int(cu_padded[-1]))
    pick = megatron_cp.local_positions(cu_padded, cp, rank).to(labels.device)
    if labels.shape != (1, pick.numel()):
        raise ValueError(f"this context-parallel rank's labels {tuple(labels.shape)} are not its {pick.numel()} rows "
                         f"of cu_seqlens_q_padded {cu_padded.tolist()}")
    return thd_destinations(tokens, whole, cu_padded), pick


def _refused(why: str) -> FusedPathUnavailable:
    return FusedPathUnavailable(f"verl's top-k distillation cannot run fused on the Megatron engine: {why}; verl's "
                                "own fused forward has no top-k outputs either (use_fused_kernels=False runs verl's "
                                "logits path)")


def processor(original, plan: distill.DistillPlan, *, hidden_states, output_layer, output_weight, labels, context,
              config, **kwargs):
    """verl's output processor under a pending top-k ``plan``: verl's own outputs (log-probs, entropy) and the
    divergence's rows in ``plan.result`` (see the module docstring)."""
    out = original(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                   labels=labels, context=context, config=config, **kwargs)
    packed = kwargs.get("packed_seq_params")
    if packed is None or getattr(packed, "cu_seqlens_q_padded", None) is None:
        raise _refused("Megatron passed no packed_seq_params.cu_seqlens_q_padded (verl's THD layout)")
    try:
        dest, pick = _rows(plan.tokens, labels, packed.cu_seqlens_q_padded)
    except ValueError as exc:
        raise _refused(str(exc)) from exc
    from ..megatron.head import tp_group_and_size
    group, tp = tp_group_and_size(output_layer, config)
    hidden, reduce_grad_hidden = hidden_states, True
    if tp > 1 and getattr(config, "sequence_parallel", False):
        # the sequence shards gathered (the gather's backward reduce-scatters d_hidden), as verl's processor does
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden, reduce_grad_hidden = gather_from_sequence_parallel_region(hidden), False
    n, dev = labels.shape[1], labels.device
    weight = output_weight if output_weight is not None else output_layer.weight
    h, w = head_operands(hidden.reshape(n, hidden.shape[-1]), weight)

    def lay(values, fill):
        width = n if pick is None else int(packed.cu_seqlens_q_padded[-1])
        rows = values.new_full((width, *values.shape[1:]), fill).to(dev)
        rows[dest] = values.to(dev)
        return rows if pick is None else rows.index_select(0, pick)
    scored = lay(plan.tokens.scored, False)
    clamp = plan.log_prob_min_clamp
    with torch.autocast(h.device.type, enabled=False):
        res = topk_divergence(h, w, torch.where(scored, labels.reshape(-1), IGNORE), lay(plan.teacher_ids, 0),
                              lay(plan.teacher_logprobs, 0.0), divergence="forward_kl_topk",
                              temperature=float(context.temperature), tp_group=group if tp > 1 else None,
                              reduce_grad_hidden=reduce_grad_hidden, log_prob_min_clamp=clamp,
                              clamped_masses=clamp is not None)
    rows = {"distillation_losses": res.divergence}
    rows.update((name, res.token_stats[name]) for name in distill.TOPK_FIELDS[1:])
    plan.result = {"rows": {k: v.view(1, n) for k, v in rows.items()}, "packed": packed, "backend": last_backend()}
    return out


def loss_function(plan: distill.DistillPlan, verl_loss, path: str):
    """verl's ``distillation_ppo_loss`` on verl's model output plus the divergence's rows as nested outputs."""
    def run(model_output, data, dp_group=None):
        res = plan.result
        if res is None:
            raise RuntimeError("logitless.verl: the Megatron model's forward did not reach verl's output processor "
                               "(a model verl's fused forward does not hand its hidden states?): no top-k "
                               "divergence for verl's distillation loss")
        from verl.models.mcore.util import postprocess_thd_engine
        ids = data["input_ids"]
        extras = {name: postprocess_thd_engine(rows, res["packed"], ids, ids.shape[0], post_process=True)
                  for name, rows in res["rows"].items()}
        loss, metrics = verl_loss(model_output={**model_output, **extras}, data=data, dp_group=dp_group)
        write_record(path, res["backend"], ENTRY)
        return loss, metrics
    return run


def forward_step(original, engine, batch, model, logits_processor_func, postprocess_micro_batch_func):
    """One distillation micro-batch of ``MegatronEngineWithLMHead.forward_step`` (``batch`` already taken from
    the iterator); see the module docstring."""
    from verl.utils import tensordict_utils as tu

    from .fused_loss import _distill_fallback
    plan, why = distill.make_plan(engine, batch, logits_processor_func, model_output_flag=False)
    if plan is None and why:
        fused_kernels = tu.get_non_tensor_data(batch, key="use_fused_kernels",
                                               default=engine.engine_config.use_fused_kernels)
        if fused_kernels and distill.uses_topk(logits_processor_func):
            raise _refused(why)          # verl's fused forward would not produce the top-k outputs either
        _distill_fallback(why)           # raises under strict mode, before the model runs
        out = original(engine, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        write_record("unfused", None, ENTRY, why)        # again after the forward (its ops' records)
        return out
    path = forward_mode(model)
    if plan is None:                     # an estimator mode: verl's loss on the fused head's log-probs
        output, loss_func = original(engine, iter([batch]), model, logits_processor_func,
                                     postprocess_micro_batch_func)

        def estimator(model_output, data, dp_group=None):
            out = logits_processor_func(model_output=model_output, data=data, dp_group=dp_group)
            write_record("legacy" if path == "legacy" else "hook", last_backend(), ENTRY)
            return out
        return output, functools.partial(loss_func, loss_function=estimator)
    bad = refusals(engine, model)
    if bad:
        raise _refused("; ".join(bad))
    with planned_forward(_pending, plan, model, path):
        output, loss_func = original(engine, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
    return output, functools.partial(loss_func, loss_function=loss_function(plan, logits_processor_func, path))
