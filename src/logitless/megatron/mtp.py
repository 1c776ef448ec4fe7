"""Multi-token prediction (MTP) losses from the fused op: no [tokens x vocab] logits at any depth.

megatron-core (0.18+) computes the MTP losses in ``process_mtp_loss``, called by ``GPTModel._postprocess``
and ``HybridModel.forward`` before the output processor runs: per depth k it builds the logits of the
k-th MTP hidden states with the output layer, its per-token cross entropy against the labels rolled k+1
to the left, the logged loss and acceptance counts (argmax of the logits), and attaches the scaled loss
to the main hidden states (``MTPLossAutoScaler``). ``fused_process_mtp_loss`` below is that function with
the two logits uses replaced: the cross entropy is ``-fused_logprobs`` (TP / SP / MuP scaling as the
processor handles them) and the argmax is taken over bounded [chunk x vocab shard] blocks. Everything
else (the chunking of the MTP hidden states, label / loss-mask rolling with CP and packed sequences,
derived labels when labels is None, ``mtp_detach_heads``, the tracker, the loss scaling) is
megatron-core's own code, called as it is.

How it is reached: the module global ``process_mtp_loss`` of megatron-core's gpt_model and hybrid_model
is replaced once by ``_dispatch``, which runs the fused version only for models that opted in
(``enable_fused_mtp``, done by ``patch_fused_forward`` and every logitless entry point) and megatron-core's
own function for every other model. The model is known from the bound ``compute_language_model_loss``
argument. A call with arguments this version does not know also goes to megatron-core's function, with a
warning (strict mode: ``FusedPathUnavailable`` instead).
Releases without ``process_mtp_loss`` (before 0.18) keep their own, unfused MTP losses.
"""
from __future__ import annotations

import importlib
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from ..api import fused_logprobs
from ..record import FusedPathUnavailable, strict_enabled
from .head import logit_scale, tp_group_and_size

_FLAG = "_logitless_fused_mtp"
_MTP_MODULE = "megatron.core.transformer.multi_token_prediction"
_CALLERS = ("megatron.core.models.gpt.gpt_model", "megatron.core.models.hybrid.hybrid_model")
_KNOWN_ARGS = frozenset(("hidden_states", "labels", "loss_mask", "output_layer", "output_weight",
                         "runtime_gather_output", "is_training", "compute_language_model_loss", "config",
                         "cp_group", "tp_group", "packed_seq_params", "scale_logits_fn", "input_ids"))
_IGNORE = -100
_ARGMAX_BLOCK = 1 << 22   # elements of one [tokens x vocab shard] block of the acceptance argmax


def release_has_process_mtp_loss() -> bool:
    try:
        return callable(getattr(importlib.import_module(_MTP_MODULE), "process_mtp_loss", None))
    except ImportError:
        return False


def enable_fused_mtp(model: nn.Module) -> bool:
    """Compute ``model``'s MTP losses with the fused op from now on (idempotent). Returns whether the
    fused MTP losses can run (a model with MTP layers on a release with ``process_mtp_loss``)."""
    if not getattr(model, "mtp_process", False) or not release_has_process_mtp_loss():
        return False
    _install_dispatch()
    model.__dict__[_FLAG] = True
    return True


def opt_in_late(model: Optional[nn.Module], in_inference: bool) -> None:
    """Called by the output processor, after megatron-core computed this forward's MTP losses. A model with
    MTP layers that never opted in (the processor passed to its forward without ``patch_fused_forward``) had
    them computed from full logits: strict mode refuses; otherwise a warning, and the fused MTP losses from the
    next forward on. Nothing to do in inference mode (no MTP losses) or for a model without MTP layers."""
    if (in_inference or model is None or fused_mtp_enabled(model) or not getattr(model, "mtp_process", False)
            or not release_has_process_mtp_loss()):
        return
    why = (f"{type(model).__name__} has MTP layers whose losses megatron-core computed from full [tokens x vocab] "
           "logits in this forward: call logitless.megatron.patch_fused_forward(model) before the first forward "
           "so that they come from the fused op")
    _unfused(why, "; fused from the next forward on", stacklevel=4)
    enable_fused_mtp(model)


def _unfused(why: str, then: str, stacklevel: int) -> None:
    """MTP losses that megatron-core computed from full logits: FusedPathUnavailable in strict mode, else a
    RuntimeWarning saying why (and ``then``, what happens next)."""
    if strict_enabled():
        raise FusedPathUnavailable(why + " (strict mode: LOGITLESS_STRICT=1)")
    warnings.warn(why + then, RuntimeWarning, stacklevel=stacklevel)


def disable_fused_mtp(model: nn.Module) -> None:
    model.__dict__.pop(_FLAG, None)


def fused_mtp_enabled(model: nn.Module) -> bool:
    return bool(model.__dict__.get(_FLAG))


def _install_dispatch() -> None:
    for name in _CALLERS:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "process_mtp_loss", None) is not None and module.process_mtp_loss is not _dispatch:
            module.process_mtp_loss = _dispatch


def _dispatch(*args, **kwargs):
    """megatron-core's ``process_mtp_loss`` for every model, the fused one for opted-in models. An opted-in
    model whose call this version cannot reproduce (positional or unknown arguments: a newer megatron-core)
    gets megatron-core's unfused MTP losses with a warning, or FusedPathUnavailable in strict mode."""
    model = getattr(kwargs.get("compute_language_model_loss"), "__self__", None)
    if model is not None and fused_mtp_enabled(model):
        unknown = sorted(set(kwargs) - _KNOWN_ARGS)
        if not args and not unknown:
            return fused_process_mtp_loss(**kwargs)
        why = (f"megatron-core's process_mtp_loss was called with arguments logitless' fused MTP losses do not "
               f"know ({len(args)} positional, unknown {unknown}); {type(model).__name__}'s MTP losses are computed "
               "from full logits by megatron-core")
        _unfused(why, "", stacklevel=3)
    return importlib.import_module(_MTP_MODULE).process_mtp_loss(*args, **kwargs)


def _head(output_layer, config, hidden: Tensor):
    """(hidden gathered over SP if needed, tp group or None, reduce_grad_hidden)."""
    group, tp_size = tp_group_and_size(output_layer, config)
    if tp_size > 1 and getattr(output_layer, "sequence_parallel", False):
        from ..parallel import gather_sequence
        return gather_sequence(hidden, group, dim=0), group, False
    return hidden, (group if tp_size > 1 else None), True


def fused_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, loss_mask: Tensor, output_layer, config,
                        scale: float, backend: str = "auto") -> tuple[Tensor, Tensor, Optional[object]]:
    """Per-token cross entropy [b, s] (float32) of logits ``scale * hidden @ weight.T`` against ``labels``
    [b, s], from hidden [s, b, h] (SP-scattered when the output layer is sequence parallel); 0 where
    ``loss_mask`` is 0 (Megatron multiplies those by 0). A label outside [0, V) (e.g. -100 at a packed
    sequence's end) gets what megatron-core's vocab-parallel cross entropy gives it: the log-sum-exp of
    the logits less their maximum (its "predicted logit" of the max-shifted logits is 0), whose gradient is
    the softmax's; computed as ``logit_0 - logprob(0) - max`` with the maximum a constant. Also returns
    the gathered hidden states and the TP group, for the acceptance argmax."""
    full, group, reduce = _head(output_layer, config, hidden)
    if full.dtype != weight.dtype:
        full = full.to(weight.dtype)
    vocab = weight.shape[0] * (group.size() if group is not None else 1)
    keep = loss_mask != 0
    outside = keep & ((labels < 0) | (labels >= vocab))
    lab = torch.where(keep, torch.where(outside, torch.zeros_like(labels), labels), torch.full_like(labels, _IGNORE))
    out = fused_logprobs(full, weight, lab.t(), temperature=1.0 / scale, with_entropy=False, ignore_index=_IGNORE,
                         tp_group=group, reduce_grad_hidden=reduce, backend=backend)
    ce = -out.logprobs.t()
    if bool(outside.any()):
        zmax = blockwise_max(full.detach(), weight.detach(), group)[0].float() * scale
        shift = _logit_of_token_0(full, weight, group, reduce, scale) - zmax
        ce = ce + torch.where(outside, shift.t(), 0.0)
    return ce, full, group


def _logit_of_token_0(full: Tensor, weight: Tensor, group, reduce_grad_hidden: bool, scale: float) -> Tensor:
    """scale * hidden @ weight[global id 0] as [s, b] float32, differentiable; under TP only the first
    rank holds that row: its value is summed over the ranks (backward: identity, as Megatron's
    reduce-from-TP region), and d_hidden is all-reduced where the fused op all-reduces it too."""
    if group is None:
        return (full @ weight[0]).float() * scale
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    h = copy_to_tensor_model_parallel_region(full, group=group) if reduce_grad_hidden else full
    local = (h @ weight[0]).float() * scale
    if group.rank() != 0:
        local = local * 0.0
    return reduce_from_tensor_model_parallel_region(local, group=group)


@torch.no_grad()
def blockwise_max(hidden: Tensor, weight: Tensor, group) -> tuple[Tensor, Tensor]:
    """(max, argmax) over the global vocabulary of hidden [s, b, h] @ weight.T: float values and global
    ids, each [s, b], computed over [token block x vocab shard] blocks; under TP (``weight`` this rank's
    vocab rows) the ranks' maxima are combined as megatron-core's ``_vocab_parallel_argmax`` does (ties:
    the lowest rank, then the lowest id)."""
    s, b, h = hidden.shape
    flat = hidden.reshape(-1, h)
    rows = max(1, _ARGMAX_BLOCK // max(1, weight.shape[0]))
    vals, ids = [], []
    for start in range(0, flat.shape[0], rows):
        v, i = (flat[start:start + rows] @ weight.t()).max(dim=-1)
        vals.append(v)
        ids.append(i)
    val, idx = torch.cat(vals), torch.cat(ids)
    if group is not None:
        import torch.distributed as dist
        size = dist.get_world_size(group)
        all_v = [torch.empty_like(val) for _ in range(size)]
        all_i = [torch.empty_like(idx) for _ in range(size)]
        dist.all_gather(all_v, val, group=group)
        dist.all_gather(all_i, idx, group=group)
        stacked = torch.stack(all_v)
        rank = stacked.argmax(dim=0)
        val = stacked.gather(0, rank.unsqueeze(0)).squeeze(0)
        idx = rank * weight.shape[0] + torch.stack(all_i).gather(0, rank.unsqueeze(0)).squeeze(0)
    return val.view(s, b), idx.view(s, b)


def blockwise_argmax(hidden: Tensor, weight: Tensor, group) -> Tensor:
    """The global ids [s, b] of ``blockwise_max``."""
    return blockwise_max(hidden, weight, group)[1]


def fused_process_mtp_loss(hidden_states: Tensor, labels: Tensor, loss_mask: Optional[Tensor], output_layer,
                           output_weight: Optional[Tensor], runtime_gather_output: Optional[bool],
                           is_training: bool, compute_language_model_loss, config, cp_group=None, tp_group=None,
                           packed_seq_params=None, scale_logits_fn=None, input_ids: Optional[Tensor] = None) -> Tensor:
    """megatron-core 0.19's ``process_mtp_loss`` (same arguments, same result and gradients) with each
    depth's cross entropy and acceptance argmax computed without its logits; see the module docstring."""
    from megatron.core import parallel_state
    from megatron.core.transformer.multi_token_prediction import (
        MTPLossAutoScaler,
        MTPLossLoggingHelper,
        roll_tensor,
    )

    hidden_states_list = torch.chunk(hidden_states, 1 + config.mtp_num_layers, dim=0)
    hidden_states = hidden_states_list[0]
    derived = False
    if labels is None:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
        derived = True
    weight = output_weight if output_weight is not None else output_layer.weight
    if config.mtp_detach_heads:
        weight = weight.detach()
    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if derived:
        loss_mask, _ = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                   packed_seq_params=packed_seq_params)
    original_num_tokens = loss_mask.sum()
    scale = logit_scale(scale_logits_fn)

    for depth in range(config.mtp_num_layers):
        mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1, cp_group=cp_group,
                                    packed_seq_params=packed_seq_params)
        loss_mask, num_tokens = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group,
                                            packed_seq_params=packed_seq_params)
        ce, full_hidden, group = fused_cross_entropy(hidden_states_list[depth + 1], weight, mtp_labels, loss_mask,
                                                     output_layer, config, scale)
        mtp_loss = loss_mask * ce
        if is_training:
            mtp_loss_for_log = (torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)) / num_tokens.clamp(min=1)
            preds = blockwise_argmax(full_hidden.detach(), weight.detach(), group)
            valid = loss_mask.t().bool()
            correct = ((preds == mtp_labels.t()) & valid).sum().float()
            total = valid.sum().float()
            MTPLossLoggingHelper.save_metrics_to_tracker(
                mtp_loss_for_log, correct, total, depth, config.mtp_num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        mtp_loss_scale = config.mtp_loss_scaling_factor / config.mtp_num_layers
        if config.calculate_per_token_loss:
            num_tokens_safe = torch.clamp(num_tokens, min=1)
            hidden_states = MTPLossAutoScaler.apply(
                hidden_states, mtp_loss_scale * mtp_loss * (original_num_tokens / num_tokens_safe))
        else:
            hidden_states = MTPLossAutoScaler.apply(hidden_states, mtp_loss_scale * mtp_loss / num_tokens.clamp(min=1))
    return hidden_states
