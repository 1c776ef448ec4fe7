"""logitless for Megatron-Core (GPTModel, HybridModel and the deprecated MambaModel):
``model(..., labels=labels, output_processor=fused_output_processor,
output_processor_context=FusedOutputProcessorContext(temperature=...))`` returns per-token
log-probs and entropy (or, with ``loss=``, the fused policy loss) instead of logits, on megatron-core
0.18+ GPTModel (native hook) and, through a per-instance patch (``patch_fused_forward``), on older
releases and on HybridModel (no hook yet). ``labels=None`` gives the model's own output.
``forward_padded`` and ``forward_packed`` run whole batches (packing, TP/CP padding, CP split and
gather included); ``build_fused_schedule_plan`` builds megatron-core's combined-1F1B schedule plan with
the processor; MTP losses come from the fused op too. ``last_path()`` says which path ran on which
model class and ``strict=True`` / ``LOGITLESS_STRICT=1`` forbids fallback.

Modules: ``processor`` (the output processor), ``distill`` (its distillation target, ``DistillationTarget``),
``unlabelled`` (labels=None), ``detect`` (hook or legacy, cached per model), ``patch`` (the legacy instance
patch), ``mtp`` (fused MTP losses), ``schedule`` (the schedule-plan path), ``head`` (the output layer's TP
group and MuP scale), ``forward`` (whole-batch entry points), ``packing`` (THD, TP x CP padding, zigzag),
``temperature`` (its [b, s] layout rule); the record is ``logitless.record``.
"""
from ..record import FusedPathUnavailable, PathRecord, last_path, strict_enabled
from .detect import fused_forward_mode, supports_output_processor_hook, unwrap_gpt_model, unwrap_language_model
from .distill import DistillationTarget
from .forward import forward_packed, forward_padded
from .mtp import disable_fused_mtp, enable_fused_mtp, fused_mtp_enabled
from .packing import (
                      PackedBatch,
                      pack_padded,
                      pack_sequences,
                      pad_multiple,
                      unpack_to_list,
                      unpack_to_padded,
                      zigzag_merge,
                      zigzag_split,
)
from .patch import patch_fused_forward, unpatch_fused_forward
from .processor import FusedOutputProcessorContext, fused_output_processor
from .schedule import build_fused_schedule_plan, schedule_plan_processor, supports_schedule_plan_hook

__all__ = ["unwrap_language_model", "enable_fused_mtp", "disable_fused_mtp", "fused_mtp_enabled",
           "build_fused_schedule_plan", "schedule_plan_processor", "supports_schedule_plan_hook",
           "FusedOutputProcessorContext", "fused_output_processor", "DistillationTarget",
           "supports_output_processor_hook",
           "fused_forward_mode", "patch_fused_forward", "unpatch_fused_forward", "forward_padded",
           "forward_packed", "FusedPathUnavailable", "PathRecord", "last_path", "strict_enabled",
           "unwrap_gpt_model", "PackedBatch", "pack_padded", "pack_sequences",
           "pad_multiple", "unpack_to_padded", "unpack_to_list", "zigzag_split", "zigzag_merge"]
