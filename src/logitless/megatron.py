"""logitless for Megatron-Core: ``model(..., labels=labels, output_processor=fused_output_processor,
output_processor_context=FusedOutputProcessorContext(temperature=...))`` returns per-token
log-probs and entropy instead of logits, on megatron-core 0.18+ (native hook) and, through a
per-instance patch (``patch_fused_forward``), on older releases. ``forward_padded`` and
``forward_packed`` run whole batches (packing, TP/CP padding, CP split and gather included);
``last_path()`` says which path ran and ``strict=True`` / ``LOGITLESS_STRICT=1`` forbids fallback.
"""
from .integrations.megatron import (FusedOutputProcessorContext, FusedPathUnavailable, PathRecord,
                                    forward_packed, forward_padded, fused_forward_mode, fused_output_processor,
                                    last_path, patch_fused_forward, supports_output_processor_hook,
                                    unpatch_fused_forward)

__all__ = ["FusedOutputProcessorContext", "fused_output_processor", "supports_output_processor_hook",
           "fused_forward_mode", "patch_fused_forward", "unpatch_fused_forward", "forward_padded",
           "forward_packed", "FusedPathUnavailable", "PathRecord", "last_path"]
