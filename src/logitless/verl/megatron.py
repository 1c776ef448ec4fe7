"""verl's Megatron engine (``verl.models.mcore.model_forward_fused``) on logitless.

verl computes the fused head in two places, both through the module global
``linear_cross_entropy`` (its Triton kernel, CUDA only):
- ``fused_output_processor``: Megatron's native output-processor hook (megatron-core 0.18+),
- ``_fused_GPTModel_forward``: verl's per-instance forward patch for older releases ("legacy"),
and the generation / engine forward factories (``fused_forward_model_gen``,
``fused_forward_model_engine``) reach the head only through those two. Replacing that one global
moves every one of them onto logitless; verl's packing, temperature resolution, THD / remove-padding
handling and post-processing run unchanged.

The combined-1F1B forward (``model_forward_1f1b_overlap.gptmodel_forward_1f1b_overlap``) is replaced
by a schedule plan built with logitless' processor through megatron-core 0.19's
``build_schedule_plan(output_processor=...)`` (path "schedule-plan", log-probs and entropy); where the
plan has no such hook, verl's own function runs (it patches ``_postprocess``), with its
``linear_cross_entropy`` global replaced by logitless as well.

Tensor parallelism: verl passes Megatron's TP group and, under sequence parallelism, hidden
states it gathered itself (whose backward reduce-scatters d_hidden). logitless leaves d_hidden
partial there and all-reduces it otherwise, which is what Megatron's own output layer would do
(verl's kernel leaves it partial in both cases).

Strict mode turns two silent fallbacks into ``FusedPathUnavailable``: ``patch_fused_forward`` on a
model that is not (and does not wrap) a GPTModel ("... is not a supported for fused forward",
then nothing is patched), and the Megatron engine switching ``use_fused_kernels`` off (no
remove-padding, a value model, or MTP).
"""
from __future__ import annotations

import functools
import sys

from ..record import FusedPathUnavailable, last_backend, write_record
from . import truncation
from .core import linear_cross_entropy
from .sites import Site, strict_mode

FUSED = "verl.models.mcore.model_forward_fused"
OVERLAP = "verl.models.mcore.model_forward_1f1b_overlap"
ENGINE = "verl.workers.engine.megatron.transformer_impl"


def _caller_config(frame):
    """The Megatron TransformerConfig in scope where verl called the head: ``config`` (the hook
    processor), ``model.config`` (the legacy forward) or ``self.config`` (1f1b overlap)."""
    loc = frame.f_locals
    if "config" in loc and hasattr(loc["config"], "sequence_parallel"):
        return loc["config"]
    for name in ("model", "self"):
        cfg = getattr(loc.get(name), "config", None)
        if hasattr(cfg, "sequence_parallel"):
            return cfg
    return None


def _caller_model_name(frame):
    """The class name of the Megatron model verl's head runs for: the hook processor's bound
    ``compute_language_model_loss`` (in its ``**_ignored``), the legacy forward's ``model``, the
    1f1b overlap's ``self``."""
    loc = frame.f_locals
    owner = getattr((loc.get("_ignored") or {}).get("compute_language_model_loss"), "__self__", None)
    for candidate in (owner, loc.get("model"), loc.get("self")):
        if candidate is not None and hasattr(candidate, "output_layer"):
            return type(candidate).__name__
    return None


def _make_head(original):
    def linear_cross_entropy_logitless(hidden, weight, labels, temperature=1.0, reduction="none",
                                       dist_process_group=None):
        """logitless in place of verl's Triton ``linear_cross_entropy`` (same arguments and
        outputs; see logitless.verl)."""
        caller = sys._getframe(1)
        try:
            path = "hook" if caller.f_code.co_name == "fused_output_processor" else "legacy"
            cfg = _caller_config(caller)
            model = _caller_model_name(caller)
        finally:
            del caller
        # SP: verl gathered the hidden states; the gather's backward reduce-scatters d_hidden.
        sp = bool(getattr(cfg, "sequence_parallel", False))
        out = linear_cross_entropy(hidden, weight, labels, temperature, reduction, dist_process_group,
                                   reduce_grad_hidden=not sp)
        write_record(path, last_backend(), "verl", model=model)
        return out

    return linear_cross_entropy_logitless


def _unavailable(msg: str):
    return FusedPathUnavailable(msg + " (logitless.verl strict mode: install(strict=True) or LOGITLESS_STRICT=1)")


def _make_patch_fused_forward(original):
    @functools.wraps(original)
    def patch_fused_forward(model):
        if strict_mode() and sys.modules[FUSED]._get_patching_model(model) is None:
            raise _unavailable(f"verl cannot patch {type(model).__name__} for the fused forward (no GPTModel "
                               "inside it), so it would run the non-fused path")
        return original(model)

    return patch_fused_forward


def _make_maybe_enable(original):
    @functools.wraps(original)
    def _maybe_enable_fused_kernels(self):
        wanted = bool(self.engine_config.use_fused_kernels)
        result = original(self)
        if wanted and not self.engine_config.use_fused_kernels and strict_mode():
            raise _unavailable("verl's Megatron engine switched use_fused_kernels off (it needs "
                               "use_remove_padding=True, a policy model rather than a value model, and MTP "
                               "off), so it would run the non-fused path")
        return result

    return _maybe_enable_fused_kernels


def _make_overlap_forward(original):
    @functools.wraps(original)
    def gptmodel_forward_1f1b_overlap(model, input_ids, position_ids, attention_mask, labels=None, labels_mask=None,
                                      multi_modal_inputs=None, logits_processor=None, logits_processor_args=None,
                                      temperature=1.0):
        """verl's combined-1F1B forward on logitless: the schedule plan built with logitless' processor
        (megatron-core 0.19+'s build_schedule_plan hook); its post-process node returns (log_probs, entropy)
        [b, s] in verl's padded layout (verl's own returns log_probs only, entropy being a TODO there).
        Falls back to verl's function (its _postprocess patch, whose head is logitless too) where the
        schedule plan lacks the hook, or for verl's unfused logits_processor path."""
        from ..megatron.schedule import supports_schedule_plan_hook
        if truncation.current() is not None:
            raise ValueError("truncation=True with verl's combined-1F1B overlap forward "
                             "(gptmodel_forward_1f1b_overlap): its schedule-plan head does not take the rollout's "
                             "truncation; turn the overlap off")
        if labels is None:
            # verl's own function builds a plan whose post-process node then fails on labels=None (its packing
            # reads the labels); say so here, before any work
            raise ValueError("labels is None: verl's gptmodel_forward_1f1b_overlap scores labels (its own function "
                             "needs them too); for the model's logits run its forward or "
                             "logitless.megatron.build_fused_schedule_plan(..., labels=None)")
        mod = sys.modules[OVERLAP]
        inner = mod.unwrap_model(model)
        if logits_processor is not None or not supports_schedule_plan_hook(inner):
            return original(model, input_ids, position_ids, attention_mask, labels=labels, labels_mask=labels_mask,
                            multi_modal_inputs=multi_modal_inputs, logits_processor=logits_processor,
                            logits_processor_args=logits_processor_args, temperature=temperature)
        return _overlap_plan(mod, inner, input_ids, position_ids, attention_mask, labels, labels_mask, temperature)

    return gptmodel_forward_1f1b_overlap


def _overlap_plan(mod, inner, input_ids, position_ids, attention_mask, labels, labels_mask, temperature):
    """verl's packing (remove-padding THD) around ``build_fused_schedule_plan``'s processor."""
    from ..megatron.processor import FusedOutputProcessorContext
    from ..megatron.schedule import schedule_plan_processor
    post_process = inner.post_process
    batch_size, seq_len = attention_mask.shape[:2]
    ids_rmpad, packed_seq_params = mod.preprocess_packed_seqs(input_ids, attention_mask, pre_process=inner.pre_process)
    labels_rmpad = mod.preprocess_packed_seqs(labels, attention_mask, pre_process=True)[0].contiguous()
    labels_mask_rmpad = mod.preprocess_packed_seqs(labels_mask, attention_mask, pre_process=True)[0].contiguous()

    def processor(**hook_kwargs):
        lp, ent = schedule_plan_processor(**hook_kwargs)
        out = mod.CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None,
                                       hidden_states=hook_kwargs["hidden_states"], attentions=None)
        out.log_probs, out.entropy = lp, ent
        out = mod.postprocess_packed_seqs_for_dict_output(labels_mask_rmpad, out, packed_seq_params, attention_mask,
                                                          batch_size, seq_len, post_process=post_process)
        return out["log_probs"], out["entropy"]

    from ..megatron.mtp import enable_fused_mtp
    enable_fused_mtp(inner)
    ctx = FusedOutputProcessorContext(temperature=temperature, with_entropy=True)
    return inner.build_schedule_plan(input_ids=ids_rmpad.contiguous(), attention_mask=attention_mask,
                                     labels=labels_rmpad, position_ids=position_ids,
                                     packed_seq_params=packed_seq_params, output_processor=processor,
                                     output_processor_context=ctx)


SITES = (
    Site("megatron.linear_cross_entropy", FUSED, None, "linear_cross_entropy", _make_head,
         "the fused head of fused_output_processor (hook) and _fused_GPTModel_forward (legacy), used by "
         "fused_forward_model_gen / fused_forward_model_engine"),
    Site("megatron.1f1b_overlap.linear_cross_entropy", OVERLAP, None, "linear_cross_entropy", _make_head,
         "the fused head of gptmodel_forward_1f1b_overlap"),
    Site("megatron.1f1b_overlap.forward", OVERLAP, None, "gptmodel_forward_1f1b_overlap", _make_overlap_forward,
         "verl's combined-1F1B forward: a schedule plan with logitless' processor (log-probs and entropy), verl's "
         "_postprocess patch where build_schedule_plan has no output_processor hook"),
    Site("megatron.patch_fused_forward", FUSED, None, "patch_fused_forward", _make_patch_fused_forward,
         "strict check: a model verl cannot patch for the fused forward"),
    Site("megatron.engine.maybe_enable_fused_kernels", ENGINE, "MegatronEngine", "_maybe_enable_fused_kernels",
         _make_maybe_enable, "strict check: the Megatron engine switching use_fused_kernels off"),
)
