"""The output processor that Megatron-Core calls at its post-process boundary instead of building
logits: per-token log-probability of the label and entropy, from the fused op.

Megatron hands over hidden_states [s, b, h] (after the final norm; sequence-parallel scattered
when SP is on; the CP-local slice under context parallelism) and labels [b, s]. The processor
returns ``TokenLogProbs`` in the labels' layout [b, s], float32; or, when the context carries a
``PolicyLoss``, the fused policy loss and its metrics (``PolicyLossOutput``, per-token fields [b, s]); or, when it
carries a ``DistillationTarget``, the distillation loss (``DistillationOutput``, ``distill.py``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from torch import Tensor

from .. import checks
from ..api import TokenLogProbs, fused_logprobs
from ..losses import PolicyLoss, PolicyLossOutput, policy_loss
from ..record import last_backend, processor_path, write_record
from .distill import DistillationTarget, distillation_loss
from .head import logit_scale, tp_group_and_size
from .mtp import opt_in_late
from .temperature import check_temperature, temperature_bs
from .unlabelled import WITHOUT_LABELS, inference_mode_active, log_outputs, megatron_logits


@dataclass
class FusedOutputProcessorContext:
    """What the processor computes; pass it as ``output_processor_context``.

    temperature: a positive float, or a tensor of shape [b] (per sequence) or [b, s] (per token),
        in the labels' layout. Not differentiated.
    with_entropy: also return the entropy (False: ``entropy`` is None and less work is done).
    ignore_index: label value whose positions get logprob 0, entropy 0 and no gradient.
    backend: the fused op's backend ("auto", "chunked", "triton", "reference").
    loss: None, or a ``logitless.losses.PolicyLoss`` whose per-token inputs (advantages, old / ref
        log-probs) are in the labels' layout [b, s] (or per sequence [b, 1]): the processor then returns
        the fused policy loss and its metrics (``PolicyLossOutput``: loss, logprobs, entropy,
        clip_fraction, kl) instead of the log-probs, with the sequences being the rows of labels.
        Packed (THD) input: labels [1, n] and the loss's ``cu_seqlens`` [k + 1] delimiting the k
        sequences in that row (per-token inputs [1, n]). Positions that must not count (prompt,
        padding) need ``ignore_index`` in labels.
    without_labels: what a forward given no labels (``labels=None``: a rollout / inference forward)
        returns: "logits" (default; the model's own logits [b, s, V], exactly as without the
        processor) or "hidden_states" (the [s, b, h] hidden states at the hook, untouched).
    """
    temperature: Union[float, Tensor] = 1.0
    with_entropy: bool = True
    ignore_index: int = -100
    backend: str = "auto"
    loss: Optional[PolicyLoss] = None
    without_labels: str = "logits"
    distillation: Optional[DistillationTarget] = None

    def __post_init__(self):
        check_temperature(self.temperature)
        checks.boolean(self.with_entropy, "with_entropy")
        checks.ignore_index(self.ignore_index)
        if self.loss is not None and not isinstance(self.loss, PolicyLoss):
            raise TypeError(f"loss must be a logitless.losses.PolicyLoss or None, got {type(self.loss).__name__}")
        if self.distillation is not None and not isinstance(self.distillation, DistillationTarget):
            raise TypeError("distillation must be a logitless.megatron.DistillationTarget or None, got "
                            f"{type(self.distillation).__name__}")
        if self.distillation is not None and self.loss is not None:
            raise ValueError("loss and distillation are two different outputs of the processor: set one")
        if self.without_labels not in WITHOUT_LABELS:
            raise ValueError(f"without_labels must be one of {WITHOUT_LABELS}, got {self.without_labels!r}")


def model_name(hook_kwargs: dict) -> Optional[str]:
    """The class name of the model that called the processor: Megatron passes its bound
    ``compute_language_model_loss``, whose ``__self__`` is the model."""
    owner = getattr(hook_kwargs.get("compute_language_model_loss"), "__self__", None)
    return type(owner).__name__ if owner is not None else None


def _packed_policy_loss(context, hidden, weight, labels, temperature, tp_group, reduce_grad_hidden):
    """The policy loss of a packed (THD) batch: one row of labels [1, n] holding several sequences, delimited
    by ``context.loss.cu_seqlens``. The loss runs on the flat positions (hidden [n, h], labels [n], the
    per-token inputs [1, n] flattened) with those boundaries; logprobs and entropy come back as [1, n]."""
    b, n = labels.shape
    if b != 1:
        raise ValueError(f"a policy loss with cu_seqlens needs packed (THD) input, labels [1, n]; got labels of "
                         f"shape {tuple(labels.shape)}")
    flat = {f.name: getattr(context.loss, f.name).reshape(-1) for f in dataclasses.fields(context.loss)
            if f.name != "cu_seqlens" and isinstance(getattr(context.loss, f.name), Tensor)
            and tuple(getattr(context.loss, f.name).shape) == (1, n)}
    policy = dataclasses.replace(context.loss, **flat)
    if isinstance(temperature, Tensor) and temperature.dim() == 2:
        temperature = temperature.expand(1, n).reshape(-1)
    out = policy_loss(policy, hidden.reshape(n, hidden.shape[-1]), weight, labels.reshape(-1),
                      temperature=temperature, ignore_index=context.ignore_index, tp_group=tp_group,
                      reduce_grad_hidden=reduce_grad_hidden, backend=context.backend)
    return out._replace(logprobs=out.logprobs.view(1, n), entropy=out.entropy.view(1, n))


def fused_output_processor(*, hidden_states: Tensor, output_layer, output_weight: Optional[Tensor],
                           labels: Optional[Tensor], context: Optional[FusedOutputProcessorContext] = None,
                           config=None, **kwargs) -> Union[TokenLogProbs, PolicyLossOutput]:
    """Megatron-Core ``output_processor``: returns TokenLogProbs(logprobs, entropy), each float32
    [b, s] like ``labels``, without building the [s, b, vocab] logits; with ``context.loss`` set, the
    fused policy loss instead (``PolicyLossOutput``; its loss differentiable to the model's parameters).

    hidden_states: [s, b, h] (or [s / tp, b, h] under sequence parallelism), any float dtype.
    output_weight: the shared embedding [V / tp, h] when weights are tied, else None
        (``output_layer.weight`` is used). The TP group is ``output_layer.tp_group``.
    labels: int [b, s] global token ids, or None: then the processor returns what the model returns
        without it (``context.without_labels``: its logits [b, s, V], or the hidden states).
    context: a FusedOutputProcessorContext (None: temperature 1, with entropy).
    kwargs: the rest of Megatron's hook arguments; ``scale_logits`` (MuP) is honoured when it is a
        positive constant multiplier and refused otherwise.
    """
    if context is None:
        context = FusedOutputProcessorContext()
    if not isinstance(context, FusedOutputProcessorContext):
        raise TypeError("output_processor_context must be a FusedOutputProcessorContext, got "
                        f"{type(context).__name__}")
    opt_in_late(getattr(kwargs.get("compute_language_model_loss"), "__self__", None),
                inference_mode_active(kwargs.get("inference_context"), config))
    if labels is None:
        write_record(processor_path(), None, "processor", f"labels is None: the model's own {context.without_labels}",
                     model_name(kwargs))
        if context.without_labels == "hidden_states":
            return hidden_states
        return megatron_logits(hidden_states=hidden_states, output_layer=output_layer, output_weight=output_weight,
                               config=config, **kwargs)
    if not isinstance(hidden_states, Tensor) or hidden_states.dim() != 3:
        raise ValueError("hidden_states must be a [s, b, h] tensor, got "
                         f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    if not isinstance(labels, Tensor) or labels.dim() != 2:
        raise ValueError(f"labels must be a [b, s] tensor, got {getattr(labels, 'shape', type(labels).__name__)}")
    if getattr(output_layer, "bias", None) is not None:
        raise ValueError("output_layer has a bias; the fused op computes hidden @ weight.T only")
    weight = output_weight if output_weight is not None else output_layer.weight
    if weight is None:
        raise ValueError("no output weight: output_weight is None and output_layer.weight is None")

    group, tp_size = tp_group_and_size(output_layer, config)
    hidden = hidden_states
    reduce_grad_hidden = True
    if tp_size > 1 and getattr(output_layer, "sequence_parallel", False):
        # SP: gather the sequence shards; the gather's backward reduce-scatters d_hidden, so the
        # op must not all-reduce it as well.
        from ..parallel import gather_sequence
        hidden = gather_sequence(hidden, group, dim=0)
        reduce_grad_hidden = False
    # Without SP the op all-reduces d_hidden itself: Megatron's output_layer, whose
    # copy-to-tensor-parallel region would do it, is never called on this path.
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)

    s, b = hidden.shape[0], hidden.shape[1]
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match hidden_states: expected [b, s] = "
                         f"[{b}, {s}]")
    c = logit_scale(kwargs.get("scale_logits"))
    temperature = temperature_bs(context.temperature, b, s, labels.device)
    if context.distillation is not None:
        out = distillation_loss(context.distillation, hidden, weight, labels, temperature, logit_scale=c,
                                ignore_index=context.ignore_index, tp_group=group if tp_size > 1 else None,
                                reduce_grad_hidden=reduce_grad_hidden, backend=context.backend,
                                sequence_parallel=not reduce_grad_hidden)
        write_record(processor_path(), last_backend(), "processor", model=model_name(kwargs))
        return out
    if c != 1.0:
        temperature = temperature / c  # softmax(c * z / T) == softmax(z / (T / c))
    if context.loss is not None and context.loss.cu_seqlens is not None:
        out = _packed_policy_loss(context, hidden, weight, labels, temperature, group if tp_size > 1 else None,
                                  reduce_grad_hidden)
        write_record(processor_path(), last_backend(), "processor", model=model_name(kwargs))
        log_outputs(config, kwargs, "input_and_logprobs", logprobs=out.logprobs, entropy=out.entropy)
        return out
    if context.loss is not None:
        # the loss takes labels, temperature and per-token inputs in the labels' [b, s] layout and the
        # hidden states in [s, b] order (seq_first); sequences are the rows of labels
        out = policy_loss(context.loss, hidden, weight, labels, temperature=temperature,
                          ignore_index=context.ignore_index, tp_group=group if tp_size > 1 else None,
                          reduce_grad_hidden=reduce_grad_hidden, backend=context.backend, seq_first=True)
        write_record(processor_path(), last_backend(), "processor", model=model_name(kwargs))
        log_outputs(config, kwargs, "input_and_logprobs", logprobs=out.logprobs, entropy=out.entropy)
        return out
    if isinstance(temperature, Tensor) and temperature.dim() == 2:
        temperature = temperature.t()  # the [s, b] token order of hidden

    # hidden is [s, b, h]: pair it with labels transposed to [s, b] (no copy of hidden), then
    # hand the results back in the labels' [b, s] layout.
    out = fused_logprobs(hidden, weight, labels.t(), temperature=temperature,
                         with_entropy=context.with_entropy, ignore_index=context.ignore_index,
                         tp_group=group if tp_size > 1 else None, reduce_grad_hidden=reduce_grad_hidden,
                         backend=context.backend)
    lp = out.logprobs.t().contiguous()
    ent = out.entropy.t().contiguous() if out.entropy is not None else None
    write_record(processor_path(), last_backend(), "processor", model=model_name(kwargs))
    log_outputs(config, kwargs, "input_and_logprobs", logprobs=lp, entropy=ent)
    return TokenLogProbs(lp, ent)
