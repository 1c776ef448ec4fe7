"""The names of TRL's that logitless relies on: a leaf module that ``grpo.py`` and ``loss.py`` both read."""

# the attribute under which enable() keeps what it replaced on a trainer instance
STATE = "_logitless_trl"
# GRPOTrainer's method that computes per-token log-probs and entropies (replaced per instance)
METHOD = "_get_per_token_logps_and_entropies"
# TRL's multimodal arguments of that method: logitless scores text-only causal LMs here
VISION_ARGS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
               "num_tiles", "image_sizes", "mm_token_type_ids", "image_position_ids")
