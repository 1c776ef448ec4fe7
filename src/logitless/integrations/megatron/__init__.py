"""Megatron-Core integration: the fused output processor, hook detection, the legacy instance
patch, THD packing and the padded / packed forward entry points. Public names live in
``logitless.megatron``."""
from .detect import fused_forward_mode, signature_inspections, supports_output_processor_hook, unwrap_gpt_model
from .forward import forward_packed, forward_padded
from .packing import (PackedBatch, pack_padded, pack_sequences, pad_multiple, unpack_to_list, unpack_to_padded,
                      zigzag_merge, zigzag_split)
from .patch import patch_fused_forward, unpatch_fused_forward
from .processor import FusedOutputProcessorContext, fused_output_processor
from .record import FusedPathUnavailable, PathRecord, last_path, strict_enabled

__all__ = ["FusedOutputProcessorContext", "fused_output_processor", "supports_output_processor_hook",
           "fused_forward_mode", "patch_fused_forward", "unpatch_fused_forward", "forward_padded",
           "forward_packed", "FusedPathUnavailable", "PathRecord", "last_path", "strict_enabled",
           "unwrap_gpt_model", "signature_inspections", "PackedBatch", "pack_padded", "pack_sequences",
           "pad_multiple", "unpack_to_padded", "unpack_to_list", "zigzag_split", "zigzag_merge"]
