"""logitless for Hugging Face transformers causal LMs: ``fused_forward`` for per-token log-probs
and entropy straight from the backbone's hidden states, ``fused_policy_loss`` for the PPO / GRPO
loss from them, and ``patch_model`` / ``unpatch_model`` to make one model instance return log-probs
from its own ``forward`` (no logits).

Modules: ``forward`` (entry points and the instance patch), ``heads`` (what the LM head computes),
``labels`` (targets and temperature per position), ``fsdp`` (FSDP1 head placement); sharded heads are
called through ``logitless.sharded_head``."""
from .forward import (
    FusedCausalLMOutput,
    fused_forward,
    fused_policy_loss,
    head_in_fp32,
    is_patched,
    patch_model,
    unpatch_model,
    unwrap_model,
)

__all__ = ["fused_forward", "fused_policy_loss", "head_in_fp32", "patch_model", "unpatch_model", "is_patched",
           "unwrap_model", "FusedCausalLMOutput"]
