"""A distillation target for Megatron's output processor: ``FusedOutputProcessorContext(distillation=...)`` makes
the processor return ``logitless.losses.fused_distillation_loss`` of the student (the model's final hidden states
and its output layer) against a teacher, vocab-parallel under TP, instead of the log-probs.

The teacher is either its top-k ids and log-probs per token (``teacher_topk_ids`` / ``teacher_topk_logprobs``
[b, s, k] in the labels' layout, global vocabulary ids; divergences "forward_kl_topk" and "forward_kl_topk_tail")
or its own final hidden states and head (``teacher_hidden`` [s, b, h_t] in Megatron's layout, sequence-parallel
scattered like the student's when SP is on, e.g. a teacher GPTModel's processor output with
``without_labels="hidden_states"``; ``teacher_weight`` [V / tp, h_t], this rank's shard of the same vocabulary rows
as the student's output layer; divergences "forward_kl", "reverse_kl", "jsd" with ``beta``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from torch import Tensor

from .. import checks
from ..losses import DIVERGENCES, fused_distillation_loss
from ..losses.aggregate import check_loss_agg
from ..losses.distillation import check_num_items, check_settings

TOPK = ("forward_kl_topk", "forward_kl_topk_tail")


@dataclass
class DistillationTarget:
    """What the student is distilled toward, and how the loss is aggregated (``fused_distillation_loss``'s
    arguments of the same names; sequences are the rows of labels, or ``cu_seqlens`` for packed THD input [1, n]).

    log_prob_min_clamp, loss_max_clamp: verl's clamps, top-k divergences only (None: no clamp)."""
    divergence: str
    teacher_topk_ids: Optional[Tensor] = None
    teacher_topk_logprobs: Optional[Tensor] = None
    teacher_hidden: Optional[Tensor] = None
    teacher_weight: Optional[Tensor] = None
    beta: Optional[float] = None
    loss_agg: str = "token-mean"
    cu_seqlens: Optional[Tensor] = None
    num_items_in_batch: Union[None, float, Tensor] = None
    token_weight: Optional[Tensor] = None
    log_prob_min_clamp: Optional[float] = None
    loss_max_clamp: Optional[float] = None

    def __post_init__(self):
        if not isinstance(self.divergence, str) or self.divergence not in DIVERGENCES:
            raise ValueError(f"divergence must be one of {DIVERGENCES}, got {self.divergence!r}")
        topk = self.divergence in TOPK
        given = {"teacher_topk_ids": self.teacher_topk_ids, "teacher_topk_logprobs": self.teacher_topk_logprobs,
                 "teacher_hidden": self.teacher_hidden, "teacher_weight": self.teacher_weight}
        needed = ("teacher_topk_ids", "teacher_topk_logprobs") if topk else ("teacher_hidden", "teacher_weight")
        for name, value in given.items():
            if name in needed and value is None:
                raise ValueError(f"divergence={self.divergence!r} needs {name}")
            if name not in needed and value is not None:
                raise ValueError(f"{name} has no effect on divergence={self.divergence!r} (it takes "
                                 f"{' and '.join(needed)}): leave it None")
        if not topk:
            for name in ("log_prob_min_clamp", "loss_max_clamp"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is a top-k divergence's setting; divergence={self.divergence!r} "
                                     "does not use it: leave it None")
        # the settings' checks that need no tensor, here: inside the processor they would come only after the
        # student's whole forward (on every pipeline rank)
        check_settings(self.divergence, self.beta, self.log_prob_min_clamp, self.loss_max_clamp)
        check_loss_agg(self.loss_agg)
        check_num_items(self.num_items_in_batch, self.loss_agg)
        if self.teacher_hidden is not None:
            t = checks.tensor(self.teacher_hidden, "teacher_hidden")
            if t.dim() != 3:
                raise ValueError(f"teacher_hidden must be [s, b, h_t] (Megatron's layout), got {tuple(t.shape)}")


def _gather_sp(hidden: Tensor, group) -> Tensor:
    from ..parallel import gather_sequence
    return gather_sequence(hidden, group, dim=0)


def distillation_loss(target: DistillationTarget, hidden: Tensor, weight: Tensor, labels: Tensor, temperature, *,
                      logit_scale: float, ignore_index: int, tp_group, reduce_grad_hidden: bool, backend: str,
                      sequence_parallel: bool):
    """The processor's distillation branch: hidden [s, b, h] (gathered from SP already), labels [b, s]; returns
    ``DistillationOutput`` with per-token fields in the labels' layout [b, s]."""
    s, b = hidden.shape[0], hidden.shape[1]
    # the loss pairs hidden rows with labels row by row: the [b, s] order (a copy of hidden unless b == 1)
    student = hidden.transpose(0, 1)
    kwargs = dict(divergence=target.divergence, loss_agg=target.loss_agg, cu_seqlens=target.cu_seqlens,
                  num_items_in_batch=target.num_items_in_batch, token_weight=target.token_weight,
                  ignore_index=ignore_index, tp_group=tp_group, reduce_grad_hidden=reduce_grad_hidden,
                  backend=backend)
    if target.cu_seqlens is not None:
        if b != 1:
            raise ValueError(f"cu_seqlens delimits the sequences of packed (THD) input, labels [1, n]; got labels of "
                             f"shape {tuple(labels.shape)}")
    if target.divergence in TOPK:
        for name in ("log_prob_min_clamp", "loss_max_clamp"):
            if getattr(target, name) is not None:
                kwargs[name] = getattr(target, name)
        # MuP's logit scale on the student, before any softcap (not folded into the temperature, which a cap
        # would make wrong)
        out = fused_distillation_loss(student, weight, labels, teacher_topk_ids=target.teacher_topk_ids,
                                      teacher_topk_logprobs=target.teacher_topk_logprobs,
                                      temperature=temperature, student_logit_scale=logit_scale, **kwargs)
    else:
        t_hidden = target.teacher_hidden
        if sequence_parallel:
            t_hidden = _gather_sp(t_hidden, tp_group)
        if tuple(t_hidden.shape[:2]) != (s, b):
            raise ValueError(f"teacher_hidden has shape {tuple(target.teacher_hidden.shape)}; the student's hidden "
                             f"states are [s, b] = [{s}, {b}] (both sequence-parallel scattered, or neither)")
        out = fused_distillation_loss(student, weight, labels, teacher_hidden=t_hidden.detach().transpose(0, 1),
                                      teacher_weight=target.teacher_weight.detach(), beta=target.beta,
                                      temperature=temperature, student_logit_scale=logit_scale, **kwargs)
    return out
