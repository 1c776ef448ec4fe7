"""Hugging Face transformers causal LMs: per-token log-probs and entropy from the final hidden
states and the output embedding, through ``logitless.fused_logprobs``, never building logits.

- ``fused_forward(model, input_ids, ...)`` runs the backbone and the fused op: TokenLogProbs [b, s].
- ``fused_policy_loss(model, input_ids, ..., advantages=...)`` runs the backbone and the fused policy
  loss (``logitless.losses``): the PPO / GRPO loss and its metrics, in three GEMMs, no logits.
- ``patch_model(model)`` / ``unpatch_model(model)`` replace ``forward`` on this *instance* only,
  so a trainer that calls ``model(input_ids=...)`` gets ``logprobs`` and ``entropy`` instead of
  logits. The class and every other instance are untouched.

Wrappers are looked through: PEFT (LoRA and other adapters that live inside the model),
DistributedDataParallel / FSDP / DeepSpeed ``.module`` chains, ``torch.compile``'s ``_orig_mod``.
A wrapped model is still *called* through its wrapper, so DDP's gradient bookkeeping, FSDP's
all-gathers and PEFT's hooks run as usual; only the innermost causal LM's forward is replaced.
The fused op runs as the head module's forward (``logitless.sharded_head.call_head``), so FSDP1 / FSDP2 /
DeepSpeed ZeRO-3 gather a sharded head, and reduce its gradient, as for the unfused head; a head sharded over
the vocabulary by tensor parallelism (DTensor ``Shard(0)``) runs the op's ``tp_group`` path. Layouts that
cannot work are refused by name (sharded_head.py, fsdp.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import types
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from transformers.utils import ModelOutput

from transformers import PreTrainedModel

from .. import checks
from ..api import TokenLogProbs, fused_logprobs, head_operands
from ..losses import PolicyLoss, PolicyLossOutput, policy_loss
from ..record import serial_now, write_step
from ..sharded_head import call_head, check_layout, head_shape, replicated
from .fsdp import check_head_in_root_unit, fsdp_units
from .heads import plan_head
from .labels import (
    check_labels,
    check_packing_attended,
    packed_cu_seqlens,
    per_token_temperature,
    targets_from_input_ids,
    targets_from_unshifted_labels,
)
from .model_kwargs import check_model_kwargs
from .truncation import as_rows, check_truncation

_STATE = "_logitless_patch"
# DDP / FSDP1 / DeepSpeed (.module), FSDP1 internals, torch.compile
_WRAPPER_ATTRS = ("module", "_fsdp_wrapped_module", "_orig_mod")


@dataclass
class FusedCausalLMOutput(ModelOutput):
    """What a patched causal LM returns instead of ``CausalLMOutputWithPast``: no logits.

    loss: when the call was given ``labels`` (as transformers returns one then), the mean negative log-prob of
        the scored tokens (transformers' cross-entropy of its logits, at the patch's temperature; divided by
        ``num_items_in_batch`` instead of the count when that is given, as transformers does), else None.
    logprobs: float32 [b, s], log-prob of the token each position is scored against (0 where ignored).
    entropy: float32 [b, s] entropy of the temperature-scaled next-token distribution (0 where
        ignored), or None when the model was patched with ``with_entropy=False``.
    cache, hidden_states, attentions: the backbone's, as the unpatched model would return them.
    policy_loss: the ``PolicyLossOutput`` when the call was given ``policy_loss=`` (see
        ``fused_policy_loss``), else None.
    """
    loss: Optional[Tensor] = None
    logprobs: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    cache: Any = None
    hidden_states: Optional[tuple] = None
    attentions: Optional[tuple] = None
    policy_loss: Any = None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The innermost causal LM inside PEFT, DDP/FSDP/DeepSpeed (``.module``) and torch.compile
    (``_orig_mod``) wrappers. Raises ValueError for prompt-learning PEFT adapters (prefix/prompt
    tuning), which change the sequence the labels refer to."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if type(model).__module__.split(".")[0] == "peft":
            cfg = getattr(model, "active_peft_config", None)
            if getattr(cfg, "is_prompt_learning", False):
                raise ValueError(f"model is a PEFT {cfg.peft_type} model: prompt-learning adapters prepend "
                                 "virtual tokens, which logitless does not score; use LoRA-style adapters")
            get_base = getattr(model, "get_base_model", None)
            inner = get_base() if callable(get_base) else getattr(model, "model", None)
            if isinstance(inner, nn.Module):
                model = inner
                continue
        if isinstance(model, PreTrainedModel):
            break
        # Wrapper attributes first: FSDP1 forwards unknown attribute lookups to the module it wraps,
        # so the wrapper itself seems to have get_output_embeddings().
        inner = next((m for m in (getattr(model, a, None) for a in _WRAPPER_ATTRS)
                      if isinstance(m, nn.Module) and m is not model), None)
        if inner is None:
            break
        model = inner
    return model


# set by ``head_in_fp32()``: the LM head computed from float32 hidden states and weight under any autocast
_HEAD_FP32 = contextvars.ContextVar("logitless_head_fp32", default=False)


@contextlib.contextmanager
def head_in_fp32(enabled: bool = True):
    """Within this context, fused_forward / fused_policy_loss compute the LM head in float32 (the hidden
    states and the head's weight cast to float32) even under a bf16 / fp16 autocast: what a model whose
    head was cast to float32 computes (TRL's ``cast_lm_head_to_fp32``)."""
    token = _HEAD_FP32.set(bool(enabled))
    try:
        yield
    finally:
        _HEAD_FP32.reset(token)


def _backbone(core: nn.Module) -> nn.Module:
    """The module that turns input ids into final (normed) hidden states: the base model."""
    prefix = getattr(core, "base_model_prefix", "") or ""
    base = getattr(core, prefix, None) if prefix else None
    if isinstance(base, nn.Module) and base is not core:
        return base
    get_decoder = getattr(core, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    if isinstance(decoder, nn.Module) and decoder is not core:
        return decoder
    raise ValueError(f"{type(core).__name__} has no base model (base_model_prefix / get_decoder()) to "
                     "produce hidden states; logitless needs a transformers *ForCausalLM model")


def _score(core: nn.Module, input_ids: Optional[Tensor], attention_mask: Optional[Tensor],
           position_ids: Optional[Tensor], targets: Tensor, temperature, with_entropy: bool,
           ignore_index: int, backbone_kwargs: dict, policy: Optional[PolicyLoss] = None, truncation=None):
    """Run the backbone, then the fused op on the positions that have a target (or, with ``policy``,
    the fused policy loss), as the head module's forward (``sharded_head.call_head``: whatever shards
    the head gathers it and reduces its gradient, as for the unfused head).

    targets: int [b, s], already per position (ignore_index where not scored).
    truncation: None or a ``Truncation`` whose tensors are in the targets' layout (``truncation.py``).
    Returns (TokenLogProbs of float32 [b, s] or, with ``policy``, a PolicyLossOutput, the backbone's
    output)."""
    checks.boolean(with_entropy, "with_entropy")
    backbone = _backbone(core)
    check_head_in_root_unit(core)
    plan = plan_head(core, backbone)
    head = core.get_output_embeddings()
    b, s = targets.shape
    shape = head_shape(plan.weight)   # [V, H] also while sharded (None for a flat FSDP1 shard)
    device = plan.weight.device
    # checked before the backbone runs, so a bad temperature costs no forward pass
    temp = per_token_temperature(temperature, (b, s), position_ids, device)
    temp = temp / plan.logit_scale  # softmax(scale * z / T) == softmax(z / (T / scale))
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   **backbone_kwargs)
    hidden = getattr(out, "last_hidden_state", None)
    if not isinstance(hidden, Tensor):
        raise ValueError(f"{type(core).__name__}'s base model {type(backbone).__name__} returned no "
                         "last_hidden_state; logitless needs a transformers *ForCausalLM whose base model "
                         "produces the final hidden states")
    hidden = replicated(hidden)   # a tensor-parallel model's DTensor: the whole of it on every rank
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != (b, s) or (shape is not None and hidden.shape[-1] != shape[1]):
        raise ValueError(f"the base model returned hidden states {list(hidden.shape)}; expected "
                         f"[{b}, {s}, {shape[1] if shape else 'H'}] to match the labels and lm_head.weight")
    # The head would see the hidden states on its own device (accelerate moves them there).
    hidden = hidden.to(device)
    targets = targets.to(device)
    h = hidden.reshape(b * s, hidden.shape[-1])

    if policy is not None:
        return _policy_loss(core, head, policy, h, targets, temp, position_ids, ignore_index, plan.softcap,
                            truncation), out

    flat = targets.reshape(-1)
    keep = flat != ignore_index
    # Score only the rows that have a target: padding and prompt tokens cost nothing, and a
    # non-finite hidden row at an ignored position cannot leak NaN into the weight gradient.
    everything = bool(keep.all())
    idx = None if everything else keep.nonzero().squeeze(1)
    if idx is not None:
        h, flat = h.index_select(0, idx), flat.index_select(0, idx)
        if isinstance(temp, Tensor):
            temp = temp.reshape(-1).index_select(0, idx)
    elif isinstance(temp, Tensor):
        temp = temp.reshape(-1)

    def compute(x: Tensor, weight: Tensor, tp_group):
        x, weight = _head_operands(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            res = fused_logprobs(x, weight, flat.to(x.device), temperature=_on(temp, x.device),
                                 with_entropy=with_entropy, ignore_index=ignore_index, softcap=plan.softcap,
                                 tp_group=tp_group, truncation=as_rows(truncation, (b, s), idx, device=x.device))
        return res.logprobs, res.entropy

    lp, ent = call_head(head, h, compute, owner=core)

    def full(x: Optional[Tensor]) -> Optional[Tensor]:
        if x is None:
            return None
        x = x.float()   # an FSDP2 output_dtype may have cast the head's outputs
        # written into a new [b, s] tensor rather than returned as a view of x: FSDP2 warns about a root
        # module that returns views
        res = x.new_zeros(b, s)
        if idx is None:
            res.view(-1).copy_(x)
        else:
            res.view(-1).index_copy_(0, idx.to(x.device), x)
        return res

    return TokenLogProbs(full(lp), full(ent)), out


def _on(temp, device):
    return temp.to(device) if isinstance(temp, Tensor) else temp


def _head_operands(h: Tensor, weight: Tensor):
    """(hidden, weight) as the head's F.linear would multiply them: float32 inside ``head_in_fp32()`` (TRL's
    cast_lm_head_to_fp32) whatever the autocast, the autocast dtype under autocast, else hidden in the
    weight's dtype."""
    if _HEAD_FP32.get():
        return h.float(), weight.float()
    return head_operands(h, weight)


def _policy_loss(core: nn.Module, head: nn.Module, policy: PolicyLoss, h: Tensor, targets: Tensor, temperature,
                 position_ids, ignore_index: int, softcap: Optional[float] = None,
                 truncation=None) -> PolicyLossOutput:
    """The fused policy loss of the rows h [b * s, H] against targets [b, s], run as the head's forward.
    Sequences are the rows, or, in one padding-free packed row, the packed sequences (from position_ids,
    unless the policy has its own cu_seqlens); the per-token inputs are in the [b, s] layout either way."""
    b, s = targets.shape
    cu = packed_cu_seqlens(position_ids, (b, s)) if policy.cu_seqlens is None else None
    if cu is not None:
        def flat(t, name):
            return None if t is None else checks.per_token_tensor(t, name, targets).reshape(-1)
        policy = dataclasses.replace(policy, advantages=flat(policy.advantages, "advantages"),
                                     old_logprobs=flat(policy.old_logprobs, "old_logprobs"),
                                     ref_logprobs=flat(policy.ref_logprobs, "ref_logprobs"),
                                     rollout_logprobs=flat(policy.rollout_logprobs, "rollout_logprobs"),
                                     rollout_weights=flat(policy.rollout_weights, "rollout_weights"), cu_seqlens=cu)
        labels = targets.reshape(-1)
        if isinstance(temperature, Tensor):
            temperature = temperature.reshape(-1)
    else:
        labels = targets

    def compute(x: Tensor, weight: Tensor, tp_group):
        x, weight = _head_operands(x, weight)
        rows = x if cu is not None else x.view(b, s, x.shape[-1])
        with torch.autocast(x.device.type, enabled=False):
            return tuple(policy_loss(policy, rows, weight, labels.to(x.device), temperature=_on(temperature, x.device),
                                     ignore_index=ignore_index, tp_group=tp_group, softcap=softcap,
                                     truncation=as_rows(truncation, (b, s), flat=cu is not None, device=x.device)))

    out = PolicyLossOutput(*call_head(head, h, compute, owner=core))
    if cu is not None:
        out = out._replace(logprobs=out.logprobs.view(b, s), entropy=out.entropy.view(b, s))
    return out


def _batch_shape(input_ids, labels, name: str):
    if isinstance(input_ids, Tensor):
        return tuple(input_ids.shape)
    if input_ids is not None:
        checks.tensor(input_ids, "input_ids")
    if labels is None:
        raise ValueError(f"{name} is required when input_ids is None (e.g. with inputs_embeds): there is "
                         "no next token to score against")
    return tuple(checks.tensor(labels, name).shape)


def _targets(input_ids, attention_mask, position_ids, labels, shift_labels, ignore_index: int) -> Tensor:
    """int64 [b, s]: what each position is scored against, in transformers' two conventions: ``labels``
    unshifted (labels[t] is token t: position t is scored against labels[t + 1], never across a packed-sequence
    boundary), ``shift_labels`` already shifted (position t against shift_labels[t]); with neither,
    input_ids[t + 1] with the last position, padding and packed-sequence boundaries ignored."""
    if shift_labels is not None:
        return check_labels(shift_labels, _batch_shape(input_ids, shift_labels, "shift_labels"))
    if labels is not None:
        checked = check_labels(labels, _batch_shape(input_ids, labels, "labels"))
        return targets_from_unshifted_labels(checked, position_ids, ignore_index)
    _batch_shape(input_ids, None, "labels (or shift_labels)")
    return targets_from_input_ids(input_ids, attention_mask, position_ids, ignore_index)


def _one_convention(labels, shift_labels):
    if labels is not None and shift_labels is not None:
        raise ValueError("give labels (transformers' unshifted convention: labels[t] is token t) or shift_labels "
                         "(already shifted: position t is scored against shift_labels[t]), not both")


# keywords the model takes whose only effect is on what fused_forward / fused_policy_loss do not return (the cache,
# the hidden states and attentions, transformers' LM loss): given a value that asks for that effect, refused
_WITHOUT_EFFECT = {
    "use_cache": "the KV cache is not returned (and with packed position_ids it would make transformers attend "
                 "across the packed sequences)",
    "output_hidden_states": "the hidden states are not returned",
    "output_attentions": "the attentions are not returned",
    "output_router_logits": "the router logits are not returned",
    "num_items_in_batch": "it divides transformers' LM loss, which is not computed here (the policy loss's "
                          "normalisation is loss_agg; a patched model given labels takes it for its .loss)",
}


def _check_no_idle_kwargs(model_kwargs: dict, caller: str) -> None:
    for name, why in _WITHOUT_EFFECT.items():
        value = model_kwargs.get(name)
        if value is None or value is False:
            continue
        raise ValueError(f"{caller} got {name}={value!r}, which has no effect here: {why}; a setting without "
                         "effect is refused, not ignored")


def _cached(kwargs: dict) -> bool:
    """Whether the backbone runs with a cache (transformers then ignores packing in position_ids)."""
    return bool(kwargs.get("use_cache")) or any(kwargs.get(n) is not None for n in ("past_key_values", "cache"))


def _lm_loss(logprobs: Tensor, targets: Tensor, ignore_index: int, num_items_in_batch) -> Tensor:
    """transformers' ForCausalLMLoss from the log-probs: the sum of -logprob over the scored tokens, divided by
    their count (0 tokens: NaN, as cross_entropy's mean) or by num_items_in_batch."""
    total = -logprobs.sum()
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum().to(total.device)
    if isinstance(num_items_in_batch, Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _patched_forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, *,
                     shift_labels=None, temperature=None, with_entropy=None, ignore_index=None,
                     logits_to_keep=0, return_dict=None, policy_loss=None, **kwargs):
    """Replaces ``forward`` on a patched causal LM instance (see ``patch_model``)."""
    state = self.__dict__[_STATE]
    given = state.get("call")   # fused_forward / fused_policy_loss's settings, kept out of the call's arguments
    truncation = None
    if given is not None:
        temperature, policy_loss = given["temperature"], given["policy_loss"]
        truncation = given.get("truncation")
    temperature = state["temperature"] if temperature is None else temperature
    with_entropy = state["with_entropy"] if with_entropy is None else with_entropy
    ignore_index = checks.ignore_index(state["ignore_index"] if ignore_index is None else ignore_index)
    if not (logits_to_keep is None or (isinstance(logits_to_keep, int) and logits_to_keep == 0)):
        raise ValueError("logits_to_keep is not supported by a logitless-patched model (it returns no logits); "
                         "call logitless.transformers.unpatch_model(model) before generating")
    kwargs = {k: v for k, v in kwargs.items() if not (v is None and k.startswith("output_"))}
    check_model_kwargs(_backbone(self), kwargs, "a logitless-patched forward", _PATCHED_NAMES)
    if kwargs.get("use_cache") is None:
        # No logits, so no generation: a KV cache would only cost memory, and transformers
        # ignores the packing in position_ids when a cache is present.
        kwargs["use_cache"] = False

    # as transformers: shift_labels, if given, are what is scored; labels (unshifted) otherwise
    targets = _targets(input_ids, attention_mask, position_ids, labels, shift_labels, ignore_index)
    check_packing_attended(attention_mask, position_ids, targets.shape, _cached(kwargs))
    if policy_loss is not None and not isinstance(policy_loss, PolicyLoss):
        raise TypeError(f"policy_loss must be a logitless.losses.PolicyLoss, got {type(policy_loss).__name__}")
    res, out = _score(self, input_ids, attention_mask, position_ids, targets, temperature, with_entropy,
                      ignore_index, kwargs, policy=policy_loss, truncation=truncation)
    loss = None
    if labels is not None and policy_loss is None:   # transformers returns a loss when given labels
        loss = _lm_loss(res.logprobs, targets, ignore_index, kwargs.get("num_items_in_batch"))
    return FusedCausalLMOutput(loss=loss, logprobs=res.logprobs, entropy=res.entropy,
                               cache=getattr(out, "cache", None),
                               hidden_states=getattr(out, "hidden_states", None),
                               attentions=getattr(out, "attentions", None),
                               policy_loss=res if policy_loss is not None else None)


def is_patched(model: nn.Module) -> bool:
    """Whether the causal LM inside ``model`` currently has the logitless forward."""
    return _STATE in unwrap_model(model).__dict__


def _check_settings(temperature, with_entropy, ignore_index):
    checks.temperature(temperature, max_dim=2)   # its layout is checked against the batch in the call
    checks.boolean(with_entropy, "with_entropy")
    checks.ignore_index(ignore_index)


def patch_model(model: nn.Module, *, temperature: Union[float, Tensor] = 1.0, with_entropy: bool = True,
                ignore_index: int = -100) -> nn.Module:
    """Make ``model(input_ids=..., attention_mask=..., position_ids=...)`` return a
    ``FusedCausalLMOutput`` (``logprobs``, ``entropy`` [b, s] float32; no logits).

    Only this instance changes (its innermost causal LM gets an instance attribute ``forward``);
    the class and other instances keep the original forward. Patching again only updates the
    settings; ``unpatch_model`` restores the original. Returns ``model``.

    Scoring in the patched forward, per position t: without labels, against input_ids[t+1]
    (last position, padding and packed-sequence boundaries ignored, as in ``fused_forward``);
    with ``labels=`` (transformers' unshifted convention), against labels[t+1]; with
    ``shift_labels=``, against shift_labels[t] as given (transformers' precedence: shift_labels when both are
    given); given ``labels``, ``.loss`` is transformers' loss (``FusedCausalLMOutput``). ``temperature=``,
    ``with_entropy=`` and
    ``ignore_index=`` may also be passed per call. The head is checked at patch time: a head
    logitless cannot reproduce exactly raises ValueError here, not later.
    """
    core = unwrap_model(model)
    _check_settings(temperature, with_entropy, ignore_index)
    check_head_in_root_unit(core)
    # Outside its forward, an FSDP1 root holds the head weight as a flat shard: its shape is
    # checked when the patched forward runs, with the weight unsharded.
    plan = plan_head(core, _backbone(core), weight_sharded=bool(fsdp_units(model)))
    check_layout(model, plan.weight)
    state = core.__dict__.get(_STATE)
    if state is None:
        state = {"previous": core.__dict__.get("forward")}
        core.__dict__[_STATE] = state
        core.__dict__["forward"] = types.MethodType(_patched_forward, core)
    state.update(temperature=temperature, with_entropy=with_entropy, ignore_index=ignore_index)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo ``patch_model`` (a no-op on a model that is not patched). Returns ``model``."""
    core = unwrap_model(model)
    state = core.__dict__.pop(_STATE, None)
    if state is not None:
        core.__dict__.pop("forward", None)
        if state["previous"] is not None:
            core.__dict__["forward"] = state["previous"]
    return model


def _has_call_hooks(core: nn.Module) -> bool:
    """Whether calling ``core`` runs hooks around its forward (FSDP2's ``fully_shard`` on the causal LM
    itself unshards the root unit there, DeepSpeed fetches its parameters): then it is called, patched."""
    return bool(core._forward_pre_hooks or core._forward_hooks)


@contextlib.contextmanager
def _patched_for_call(model: nn.Module, core: nn.Module, **settings):
    """``core`` (the causal LM inside the wrapper ``model``) patched for the duration, unless it already is,
    with ``settings`` (temperature, policy_loss) for the call. They reach the patched forward beside the
    call's arguments, not in them: FSDP's mixed precision casts every float tensor among a unit's inputs
    (a per-token temperature, the policy's advantages) to its parameter dtype."""
    patched_here = _STATE not in core.__dict__
    if patched_here:
        patch_model(model)  # the wrapper, so an FSDP root is seen
    state = core.__dict__[_STATE]
    previous = state.get("call")
    state["call"] = settings
    try:
        yield
    finally:
        if previous is None:
            state.pop("call", None)
        else:
            state["call"] = previous
        if patched_here:
            unpatch_model(core)


def fused_forward(model: nn.Module, input_ids: Optional[Tensor], attention_mask: Optional[Tensor] = None,
                  position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                  shift_labels: Optional[Tensor] = None, temperature: Union[float, Tensor] = 1.0,
                  with_entropy: bool = True, ignore_index: int = -100, truncation=None,
                  **model_kwargs) -> TokenLogProbs:
    """Per-token log-probs and entropy of a transformers causal LM, without its logits.

    Args:
        model: a ``*ForCausalLM`` (or PEFT / DDP / FSDP / compiled wrapper of one).
        input_ids: int64 [b, s]. May be None with ``inputs_embeds=`` in model_kwargs and labels / shift_labels.
        attention_mask: [b, s] 0/1, 0 = padding (left or right). Other mask forms need labels.
        position_ids: int64 [b, s]; in a padding-free packed row (b == 1) positions restart at each
            sequence, and no position is scored across a restart.
        labels: int [b, s] in transformers' convention, unshifted (``labels=input_ids``, with ``ignore_index``
            where not scored): position t is scored against labels[t + 1] (never across a packed-sequence
            boundary), as the model's own ``labels=`` loss scores it.
        shift_labels: int [b, s], already shifted: position t is scored against shift_labels[t] as given
            (transformers' ``shift_labels``). Not with labels. With neither, position t is scored against
            input_ids[t + 1], with the last position, padding and packed-sequence boundaries ignored.
        temperature: a positive number; or a tensor: [b] / [b, 1] per sequence, [b, s] per token, or
            for one packed row [n] per packed sequence. The head's own logit scale, if any (Cohere
            ``logit_scale``, Granite ``logits_scaling``, ...), is folded in exactly; Gemma 2 / 3's
            ``final_logit_softcapping`` is applied exactly before the temperature, as the model does.
        with_entropy: also return the entropy.
        truncation: None, or a ``logitless.Truncation``: the log-probs and entropies of the distribution the
            rollout sampled from, truncated by its top_k / top_p / min_p (numbers, or tensors [b, s] per token /
            [b, 1] per sequence) or its logged kept ids [b, s, K] (docs/truncation.md). The returned
            TokenLogProbs holds the truncated log-probs and entropies.
        model_kwargs: passed to the model (e.g. ``inputs_embeds``, ``token_type_ids``): only names its base
            model's forward declares (``model_kwargs.py``); any other name is a TypeError, never dropped.

    Returns:
        TokenLogProbs(logprobs, entropy), float32 [b, s]; 0 at ignored positions. Differentiable
        w.r.t. every parameter that produced them.
    """
    core = unwrap_model(model)
    check_model_kwargs(_backbone(core), model_kwargs, "logitless.transformers.fused_forward", _FORWARD_NAMES)
    _check_no_idle_kwargs(model_kwargs, "logitless.transformers.fused_forward")
    _check_settings(temperature, with_entropy, ignore_index)
    truncation = check_truncation(truncation)
    _one_convention(labels, shift_labels)
    targets = _targets(input_ids, attention_mask, position_ids, labels, shift_labels, ignore_index)
    check_packing_attended(attention_mask, position_ids, targets.shape, _cached(model_kwargs))
    model_kwargs.setdefault("use_cache", False)  # scoring builds no KV cache unless asked to
    since = serial_now()
    if core is model and not _has_call_hooks(core):
        res, _ = _score(core, input_ids, attention_mask, position_ids, targets, temperature, with_entropy,
                        ignore_index, model_kwargs, truncation=truncation)
        write_step("transformers.fused_forward", since)
        return res
    # Go through the wrapper's own __call__ so DDP / FSDP / PEFT do their part of the forward.
    with _patched_for_call(model, core, temperature=temperature, policy_loss=None, truncation=truncation):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    shift_labels=targets, with_entropy=with_entropy, ignore_index=ignore_index, **model_kwargs)
    write_step("transformers.fused_forward", since)
    return TokenLogProbs(out.logprobs, out.entropy)


def fused_policy_loss(model: nn.Module, input_ids: Optional[Tensor], attention_mask: Optional[Tensor] = None,
                      position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                      shift_labels: Optional[Tensor] = None, advantages: Tensor,
                      old_logprobs: Optional[Tensor] = None, clip_low: float = 0.2, clip_high: float = 0.28,
                      dual_clip: Optional[float] = None,
                      ref_logprobs: Optional[Tensor] = None, kl_coef: float = 0.0, kl_type: str = "k3",
                      entropy_coef: float = 0.0, loss_agg: str = "token-mean", cu_seqlens: Optional[Tensor] = None,
                      temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100,
                      loss_settings: Optional[dict] = None, truncation=None, **model_kwargs) -> PolicyLossOutput:
    """The PPO / GRPO policy loss of a transformers causal LM (``logitless.losses.fused_policy_loss``
    from its final hidden states and output embedding): no logits, three GEMMs.

    Positions, targets, padding, packing, temperature and wrappers as in ``fused_forward`` (position t is
    scored against input_ids[t + 1], or against labels[t + 1] with ``labels`` (unshifted, transformers'
    convention), or against shift_labels[t] with ``shift_labels`` (already shifted)). The per-token inputs
    (advantages, old_logprobs, ref_logprobs) are in that same [b, s] layout: position t holds the values of
    the token it is scored against (per sequence: [b, 1]). Sequences for ``loss_agg`` are the rows, or, in
    one padding-free packed row, the packed sequences found from ``position_ids``. The other arguments are
    ``logitless.losses.PolicyLoss``'s (the other settings by name in ``loss_settings``; one given as a keyword
    here is a TypeError saying so, as is any name the model's forward does not declare). Heads with
    final_logit_softcapping (Gemma 2 / 3) take the exact two-pass path (``logitless.losses.policy_loss``).
    ``truncation``: as in ``fused_forward``; the loss's log-probs, ratio, KL and entropy are then the truncated
    distribution's (``logitless.losses.policy_loss(..., truncation=)``: the exact path).

    Returns a PolicyLossOutput (loss 0-d, differentiable once to every parameter that produced the
    hidden states and the head; logprobs / entropy [b, s]; clip_fraction; kl).
    """
    if loss_settings is not None and not isinstance(loss_settings, dict):
        raise TypeError(f"loss_settings must be a dict of PolicyLoss settings, got {type(loss_settings).__name__}")
    core = unwrap_model(model)
    check_model_kwargs(_backbone(core), model_kwargs, "logitless.transformers.fused_policy_loss", _POLICY_NAMES)
    _check_no_idle_kwargs(model_kwargs, "logitless.transformers.fused_policy_loss")
    policy = PolicyLoss(advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                        clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef,
                        kl_type=kl_type, entropy_coef=entropy_coef, loss_agg=loss_agg, cu_seqlens=cu_seqlens,
                        **(loss_settings or {}))
    _check_settings(temperature, True, ignore_index)
    truncation = check_truncation(truncation)
    _one_convention(labels, shift_labels)
    targets = _targets(input_ids, attention_mask, position_ids, labels, shift_labels, ignore_index)
    check_packing_attended(attention_mask, position_ids, targets.shape, _cached(model_kwargs))
    model_kwargs.setdefault("use_cache", False)
    since = serial_now()
    if core is model and not _has_call_hooks(core):
        res, _ = _score(core, input_ids, attention_mask, position_ids, targets, temperature, True, ignore_index,
                        model_kwargs, policy=policy, truncation=truncation)
        write_step("transformers.fused_policy_loss", since)
        return res
    with _patched_for_call(model, core, temperature=temperature, policy_loss=policy, truncation=truncation):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    shift_labels=targets, ignore_index=ignore_index, **model_kwargs)
    write_step("transformers.fused_policy_loss", since)
    return out.policy_loss


def _names(fn) -> tuple:
    return tuple(inspect.signature(fn).parameters)


# each entry point's own argument names: the suggestions for a misspelled keyword
_FORWARD_NAMES, _POLICY_NAMES, _PATCHED_NAMES = map(_names, (fused_forward, fused_policy_loss, _patched_forward))
