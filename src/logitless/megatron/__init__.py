"""logitless for Megatron-Core: ``model(..., labels=labels, output_processor=fused_output_processor,
output_processor_context=FusedOutputProcessorContext(temperature=...))`` returns per-token
log-probs and entropy instead of logits, on megatron-core 0.18+ (native hook) and, through a
per-instance patch (``patch_fused_forward``), on older releases. ``forward_padded`` and
``forward_packed`` run whole batches (packing, TP/CP padding, CP split and gather included);
``last_path()`` says which path ran and ``strict=True`` / ``LOGITLESS_STRICT=1`` forbids fallback.

Modules: ``processor`` (the output processor), ``detect`` (hook or legacy, cached per model),
``patch`` (the legacy instance patch), ``forward`` (whole-batch entry points), ``packing`` (THD,
TP x CP padding, zigzag), ``record`` (which path ran), ``temperature`` (its [b, s] layout rule).
"""
from ..record import FusedPathUnavailable, PathRecord, last_path, strict_enabled
from .detect import fused_forward_mode, supports_output_processor_hook, unwrap_gpt_model
from .forward import forward_packed, forward_padded
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

__all__ = ["FusedOutputProcessorContext", "fused_output_processor", "supports_output_processor_hook",
           "fused_forward_mode", "patch_fused_forward", "unpatch_fused_forward", "forward_padded",
           "forward_packed", "FusedPathUnavailable", "PathRecord", "last_path", "strict_enabled",
           "unwrap_gpt_model", "PackedBatch", "pack_padded", "pack_sequences",
           "pad_multiple", "unpack_to_padded", "unpack_to_list", "zigzag_split", "zigzag_merge"]
