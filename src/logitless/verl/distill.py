"""``install(fused_loss=True)`` with verl's distillation (``distillation.enabled``): the actor's loss
``partial(verl.trainer.distillation.distillation_ppo_loss, config=..., distillation_config=...)``.

verl computes forward_kl_topk in its logits processor from the student's full logits (``log_softmax`` over
[tokens x V] against the teacher's top-k ids and log-probs, ``verl.trainer.distillation.fsdp.losses``), puts the
per-token results in the model output ("distillation_losses", "student_mass", "teacher_mass", "overlap_count",
"overlap_token_advantage", nested [b, j] like the log-probs), and then ``distillation_ppo_loss`` clamps,
aggregates, logs and adds the policy loss. With its fused kernels (``use_fused_kernels=True``) it has no top-k
path at all (only veomni's engine fills ``fused_linear_aux``).

Here, for a distillation micro-batch on the FSDP engine (``use_fused_kernels=True``):
- top-k modes: the fused head computes the per-token divergence and its statistics with logitless'
  ``topk_divergence`` (the student's log-probs at the teacher's ids from its hidden states and head, never
  the logits; verl's log_prob_min_clamp and clamp at 0), only for the response tokens (verl's loss reads no
  other), plus the log-probs and entropy of the sampled tokens (``fused_logprobs``) when verl's loss or the
  engine read them. The loss function verl calls puts those tensors in the model output where verl's logits
  processor puts its own, and runs verl's ``distillation_ppo_loss`` itself: loss_max_clamp, use_task_rewards,
  distillation_loss_coef, use_policy_gradient, the aggregation, the policy loss on the log-probs, and every
  metric, by verl's code (same names, same formulas).
- estimator modes (k1, k3, ...): verl's loss reads only the sampled tokens' log-probs, which the fused head
  already computes (``fsdp.py``); the micro-batch runs verl's loss on them, recorded as fused.

Gradient path: the divergence reaches verl's loss as a detached leaf; its per-token gradient
(``torch.autograd.grad``) is handed to the head's graph by ``_Carry``, a node on the log-probs the model returns,
so the backward enters the model through its output (FSDP's pre-backward hooks on the root's outputs run first,
as for verl's own loss) and reaches the head's hidden states and weight once.

The policy term (use_task_rewards) is verl's ``ppo_loss`` on logitless' log-probs, not ``fused_policy_loss``.
Under Ulysses sequence parallelism each rank's head computes its own slice of the rows, as verl's logits
processor does; the loss function gathers the detached per-token tensors, runs verl's loss on the whole
micro-batch, and hands each rank its slice of the divergence's gradient times sp (verl's gather does the same).

Not fused (recorded, verl's own loss runs): a layout ``tokens.py`` does not know, ``use_fused_kernels=False``,
``return_model_output=True``.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..api import head_operands
from ..losses.distill_topk import topk_divergence
from ..record import last_backend, write_record
from . import ulysses
from .core import fused_linear_for_ppo
from .tokens import IGNORE, ResponseTokens, response_tokens

ENTRY = "verl.distillation"
TOPK_FIELDS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")


@dataclass
class DistillPlan:
    """One distillation micro-batch: the response tokens, the teacher's top-k by packed position (None for an
    estimator mode), the settings; ``result`` once the head ran, ``failure`` when it could not."""
    tokens: ResponseTokens
    teacher_ids: Optional[Tensor]          # [total, k] int64
    teacher_logprobs: Optional[Tensor]     # [total, k]
    log_prob_min_clamp: Optional[float]
    need_logprobs: bool                    # verl's loss (or the engine) reads the sampled tokens' log-probs
    sequence_parallel: bool = False        # verl's Ulysses: each rank's head holds a slice of the packed rows
    result: Optional[dict] = None          # "divergence" [rows] detached, "stats", "output": the returned log-probs
    failure: str = ""
    grad: dict = field(default_factory=dict)   # "divergence": d loss / d divergence [rows], set by the loss function


class _Pending(threading.local):
    plan: Optional[DistillPlan] = None


_pending = _Pending()


def pending() -> Optional[DistillPlan]:
    """The plan of the micro-batch this thread's forward step runs (None outside one)."""
    return _pending.plan


@contextlib.contextmanager
def planned(plan: DistillPlan):
    """While open, the fused head computes ``plan``'s divergence (``head``)."""
    outer, _pending.plan = _pending.plan, plan
    try:
        yield
    finally:
        _pending.plan = outer


class _Carry(torch.autograd.Function):
    """Returns the log-probs unchanged; its backward passes their gradient through and hands the divergence the
    gradient verl's loss gave it (``plan.grad``, set before the backward runs)."""

    @staticmethod
    def forward(ctx, logprobs, divergence, plan):
        ctx.plan = plan
        ctx.shape = divergence.shape
        return logprobs.clone()

    @staticmethod
    def backward(ctx, grad):
        g = ctx.plan.grad.get("divergence")
        return grad, (g.reshape(ctx.shape) if g is not None else None), None


def _positions(tokens: ResponseTokens, labels: Tensor, shard: Optional[tuple]) -> Optional[Tensor]:
    """int64 [rows...]: the packed position of each of the head's rows, -1 for the engine's padding; None when
    the rows fit no layout. Packed [1, n] (the first ``total`` rows; under Ulysses ``shard`` = (rank, sp) the
    rank's slice [rank * n, (rank + 1) * n) of the sp-padded sequence) or padded [b, S] (each row's first
    length)."""
    total, dev = tokens.total, labels.device
    if shard is not None or (labels.dim() == 2 and labels.shape[0] == 1 and labels.shape[1] >= total):
        if labels.dim() != 2 or labels.shape[0] != 1:
            return None
        start = 0 if shard is None else shard[0] * labels.shape[1]
        pos = torch.arange(start, start + labels.shape[1], device=dev).view(1, -1)
        return torch.where(pos < total, pos, -1)
    b = tokens.offsets.numel() - 1
    offsets = tokens.offsets.to(dev)
    lengths = offsets.diff()
    if labels.dim() == 2 and labels.shape[0] == b and labels.shape[1] >= int(lengths.max()):
        col = torch.arange(labels.shape[1], device=dev)[None]
        return torch.where(col < lengths[:, None], offsets[:-1, None] + col, -1)
    return None


def _to_rows(values: Tensor, positions: Tensor, fill) -> Tensor:
    """values [total, ...] (by packed position) laid out on the head's rows, ``fill`` on padding rows."""
    out = values.new_full((*positions.shape, *values.shape[1:]), fill)
    valid = positions >= 0
    out[valid] = values.to(out.device)[positions[valid]]
    return out


def _to_packed(rows: Tensor, positions: Tensor, total: int) -> Tensor:
    """The inverse of ``_to_rows``: [total] by packed position."""
    out = rows.new_zeros((total, *rows.shape[positions.dim():]))
    valid = positions >= 0
    out[positions[valid]] = rows[valid]
    return out


def head(hidden: Tensor, weight: Tensor, labels: Tensor, temperature, *, entropy_dtype=None, flat: bool = False):
    """For the FSDP head sites: under a pending top-k plan, (log-probs, entropy) shaped like labels (flat: 1-D)
    with the divergence computed alongside (see the module docstring); None when no such plan is pending or
    these rows do not fit it (the plan records why)."""
    plan = pending()
    if plan is None or plan.teacher_ids is None or plan.result is not None or plan.failure:
        return None
    h, w = head_operands(hidden.reshape(-1, hidden.shape[-1]), weight)
    rows_labels = labels.view(1, -1) if labels.dim() == 1 else labels
    grp = ulysses.group() if plan.sequence_parallel else None
    shard = None
    if grp is not None:
        import torch.distributed as dist
        shard = (dist.get_rank(grp), dist.get_world_size(grp))
    positions = _positions(plan.tokens, rows_labels, shard)
    if positions is None:
        plan.failure = (f"labels of shape {tuple(labels.shape)} match neither the packed nor the padded layout of "
                        "this micro-batch")
        return None
    dev = rows_labels.device
    scored = _to_rows(plan.tokens.scored.to(dev), positions, False)
    ids = _to_rows(plan.teacher_ids.to(dev), positions, 0)
    t_lp = _to_rows(plan.teacher_logprobs.to(dev), positions, 0.0)
    score_labels = torch.where(scored, rows_labels, IGNORE)
    t = float(temperature)
    h = h.view(*rows_labels.shape, h.shape[-1])
    with torch.autocast(h.device.type, enabled=False):
        out = topk_divergence(h, w, score_labels, ids, t_lp, divergence="forward_kl_topk", temperature=t,
                              log_prob_min_clamp=plan.log_prob_min_clamp)
        backend = last_backend()
        if plan.need_logprobs:
            lp_ent = fused_linear_for_ppo(h, w, rows_labels, t, entropy_dtype=entropy_dtype)
            lp, ent = lp_ent.logprobs, lp_ent.entropy
        else:
            lp = torch.zeros(rows_labels.shape, dtype=torch.float32, device=dev)
            ent = torch.zeros(rows_labels.shape, dtype=entropy_dtype or torch.float32, device=dev)
    shape = (-1,) if flat else labels.shape
    # the very tensor the model returns (not a view of it): wrappers hook the model's outputs for the backward
    lp_out = _Carry.apply(lp.reshape(shape), out.divergence, plan)
    plan.result = {"divergence": out.divergence.detach(), "stats": out.token_stats, "positions": positions,
                   "group": grp, "output": lp_out, "backend": backend}
    return lp_out, ent.reshape(shape)


def _distillation_configs(loss_function):
    """(actor config, distillation config) of ``partial(distillation_ppo_loss, ...)``, else None."""
    try:
        from verl.trainer.distillation.losses import distillation_ppo_loss
    except Exception:  # noqa: BLE001 - a verl without distillation
        return None
    if isinstance(loss_function, functools.partial) and loss_function.func is distillation_ppo_loss:
        kw = loss_function.keywords
        if kw.get("distillation_config") is not None:
            return kw.get("config"), kw["distillation_config"]
    return None


def is_distillation(loss_function) -> bool:
    return _distillation_configs(loss_function) is not None


def uses_topk(loss_function) -> bool:
    """Whether verl's distillation loss ``loss_function`` is a top-k one (its per-token terms from the logits)."""
    configs = _distillation_configs(loss_function)
    return configs is not None and bool(getattr(configs[1].distillation_loss.loss_settings, "use_topk", False))


def make_plan(engine, micro_batch, loss_function, *, model_output_flag: bool = True
              ) -> tuple[Optional[DistillPlan], str]:
    """(plan, "") for a top-k micro-batch that runs fused, (None, "") for an estimator mode (verl's loss on the
    fused head's log-probs: nothing to plan), (None, why) when it cannot run fused. ``model_output_flag``: the
    engine reads the batch's return_model_output (the FSDP engine; the Megatron engine does not)."""
    from verl.utils import tensordict_utils as tu

    def get(key, default=None):
        return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)
    _, dcfg = _distillation_configs(loss_function)
    loss_cfg = dcfg.distillation_loss
    if not get("use_fused_kernels", False):
        return None, ("use_fused_kernels=False (the model would build the logits; set "
                      "actor_rollout_ref.model.use_fused_kernels=True)")
    if model_output_flag and get("return_model_output", False):
        return None, "return_model_output=True with distillation"
    settings = loss_cfg.loss_settings
    if not getattr(settings, "use_topk", False):
        return None, ""
    if loss_cfg.loss_mode != "forward_kl_topk":
        return None, f"top-k distillation loss_mode={loss_cfg.loss_mode!r} (logitless fuses 'forward_kl_topk')"
    for name in ("teacher_ids", "teacher_logprobs"):
        if name not in micro_batch.keys() or not getattr(micro_batch[name], "is_nested", False):
            return None, f"the micro-batch has no nested {name} (verl's top-k distillation layout)"
    tokens, why = response_tokens(micro_batch, with_ref=False)
    if tokens is None:
        return None, why
    ids, lps = micro_batch["teacher_ids"].values(), micro_batch["teacher_logprobs"].values()
    if ids.dim() != 2 or ids.shape[0] != tokens.total or lps.shape != ids.shape:
        return None, (f"teacher_ids {tuple(ids.shape)} / teacher_logprobs {tuple(lps.shape)} are not "
                      f"[{tokens.total} packed positions, k]")
    need_lp = not get("distillation_only", False) or bool(get("calculate_entropy", False))
    clamp = loss_cfg.log_prob_min_clamp
    return DistillPlan(tokens, ids.long(), lps, None if clamp is None else float(clamp), need_lp,
                       bool(getattr(engine, "use_ulysses_sp", False))), ""


def _gathered(rows: Tensor, res: dict, total: int) -> Tensor:
    """A per-row tensor of the head [by position], whole: [total] by packed position (under Ulysses the sp
    group's slices gathered first, without gradient)."""
    grp = res["group"]
    if grp is None:
        return _to_packed(rows, res["positions"], total)
    import torch.distributed as dist
    parts = [torch.empty_like(rows) for _ in range(dist.get_world_size(grp))]
    dist.all_gather(parts, rows.contiguous(), group=grp)
    full = torch.cat(parts, dim=-1)
    pos = torch.arange(full.shape[-1], device=full.device).view(1, -1)
    return _to_packed(full, torch.where(pos < total, pos, -1), total)


def loss_function(plan: DistillPlan, verl_loss, fallback):
    """verl's ``distillation_ppo_loss`` on the fused head's tensors (see the module docstring)."""
    def run(model_output, data, dp_group=None):
        if plan.result is None:
            fallback(plan.failure or "the model's forward did not reach the fused head (is it verl's fused "
                     "forward, use_fused_kernels=True?)")
            return verl_loss(model_output=model_output, data=data, dp_group=dp_group)
        res, total = plan.result, plan.tokens.total
        offsets = data["input_ids"].offsets()
        leaf = _gathered(res["divergence"], res, total).detach().requires_grad_(True)
        extras = {"distillation_losses": torch.nested.nested_tensor_from_jagged(leaf, offsets.to(leaf.device))}
        for name in TOPK_FIELDS[1:]:
            v = _gathered(res["stats"][name], res, total)
            extras[name] = torch.nested.nested_tensor_from_jagged(v, offsets.to(v.device))
        loss, metrics = verl_loss(model_output={**model_output, **extras}, data=data, dp_group=dp_group)
        if isinstance(loss, Tensor) and loss.requires_grad:
            (g,) = torch.autograd.grad(loss, leaf, retain_graph=True, allow_unused=True)
            if g is not None:
                g = _to_rows(g, res["positions"], 0.0)
                if res["group"] is not None:
                    # as verl's gather of the per-token outputs: the rank's slice of the gradient, times sp (FSDP's
                    # average over the ranks gives back the whole sequence's)
                    import torch.distributed as dist
                    g = g * dist.get_world_size(res["group"])
            plan.grad["divergence"] = g
            # the backward enters through the model's output (the log-probs carry the divergence's gradient)
            loss = loss + res["output"].reshape(-1)[:1].sum() * 0.0
        write_record("fsdp", res["backend"], ENTRY)
        return loss, metrics
    return run
