"""verl's actor loss settings in ``fused_policy_loss``'s terms (verl 0.9: ``verl.workers.utils.losses.ppo_loss``
and ``verl.trainer.ppo.core_algos``).

verl's loss for one micro-batch, over its response tokens (``response_mask``):

    policy_loss = agg(pg) - entropy_coeff * agg(entropy) + kl_loss_coef * agg(kl_penalty(lp, ref, kl_loss_type))

with ``pg`` the loss mode's per-token term and ``agg`` its ``agg_loss`` of ``loss_agg_mode``, normalised by
the *mini-batch's* totals the engine passes in (``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``), so the micro-batches' gradients add up to the mini-batch's. Every aggregation is a
fixed weight per token, here ``scale * w_i`` with ``w_i`` the fused pass's own weights of ``loss_agg``:

    token-mean                 token-sum            scale = dp / batch_num_tokens
    token-sum                  token-sum            scale = dp
    seq-mean-token-sum         token-sum            scale = dp / G
    seq-mean-token-sum-norm    token-sum            scale = dp / (G * (loss_scale_factor or response width))
    seq-mean-token-mean        seq-mean-token-mean  scale = dp * n_seq / G

with G = ``global_batch_size`` (or, without it, n_seq: the micro-batch's sequences that have a scored token)
and the response width verl's padded response axis. Loss mode "vanilla" is PPO's clipped surrogate with
dual clip (``clip_ratio_c``, always on in verl): ``fused_policy_loss``'s per-token term exactly.
``unfusable`` names every setting that has no such mapping.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..losses import KL_TYPES

# verl's policy-loss modes that fused_policy_loss expresses exactly
FUSED_MODES = ("vanilla",)
AGG = {"token-mean": "token-sum", "token-sum": "token-sum", "seq-mean-token-sum": "token-sum",
       "seq-mean-token-sum-norm": "token-sum", "seq-mean-token-mean": "seq-mean-token-mean"}


def loss_mode(config) -> str:
    return config.policy_loss.get("loss_mode", "vanilla")


def unfusable(config, *, rollout_is_weights: bool) -> list:
    """verl actor settings (``ActorConfig``) the fused policy loss cannot reproduce, as "setting (why)"."""
    bad = []
    mode = loss_mode(config)
    if mode not in FUSED_MODES:
        bad.append(f"policy_loss.loss_mode={mode!r} (its per-token term is not one fused_policy_loss computes; "
                   f"fused: {', '.join(FUSED_MODES)})")
    if config.loss_agg_mode not in AGG:
        bad.append(f"loss_agg_mode={config.loss_agg_mode!r} (not one of verl's token-weighted aggregations)")
    if rollout_is_weights:
        bad.append("rollout_is_weights in the batch (algorithm.rollout_correction's importance weights multiply "
                   "the policy term alone)")
    if config.use_kl_loss and config.kl_loss_type not in KL_TYPES:
        bad.append(f"kl_loss_type={config.kl_loss_type!r} (fused KL estimators: {', '.join(KL_TYPES)})")
    return bad


@dataclass(frozen=True)
class Settings:
    """The scalar settings of ``PolicyLoss`` for a verl actor (per-token inputs come from the batch)."""
    clip_low: float
    clip_high: float
    dual_clip: float
    kl_coef: float
    kl_type: str
    entropy_coef: float
    loss_agg: str
    use_ref: bool


def settings(config, *, calculate_entropy: bool) -> Settings:
    """verl's ``compute_policy_loss_vanilla`` / ``ppo_loss`` settings (call ``unfusable`` first).

    The entropy bonus is in verl's loss only when the engine computed the entropy (``calculate_entropy``,
    which the trainer sets when ``entropy_coeff != 0``); the KL loss only with ``use_kl_loss``."""
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    return Settings(clip_low=float(low), clip_high=float(high), dual_clip=float(config.get("clip_ratio_c", 3.0)),
                    kl_coef=float(config.kl_loss_coef) if config.use_kl_loss else 0.0,
                    kl_type=config.kl_loss_type if config.use_kl_loss else "k3",
                    entropy_coef=float(config.entropy_coeff) if calculate_entropy else 0.0,
                    loss_agg=AGG[config.loss_agg_mode], use_ref=bool(config.use_kl_loss))


def loss_scale(config, *, dp_size: int, batch_num_tokens: Optional[float], global_batch_size: Optional[float],
               scored_tokens: int, scored_sequences: int, response_width: int) -> float:
    """The constant that turns the fused loss (weights of ``settings().loss_agg``) into verl's ``agg_loss``
    (see the module docstring). scored_*: the micro-batch's response tokens in the loss and the sequences
    that have one; response_width: the size of verl's padded response axis."""
    mode = config.loss_agg_mode
    dp = float(dp_size)
    if mode == "token-mean":
        tokens = float(batch_num_tokens) if batch_num_tokens is not None else float(scored_tokens)
        return dp / tokens if tokens else 0.0
    if mode == "token-sum":
        return dp
    seqs = float(global_batch_size) if global_batch_size is not None else float(scored_sequences)
    if mode == "seq-mean-token-mean":
        return dp * scored_sequences / seqs if seqs else 0.0
    scale = dp / seqs if seqs else 0.0
    if mode == "seq-mean-token-sum-norm":
        factor = config.loss_scale_factor if config.loss_scale_factor is not None else response_width
        scale /= float(factor)
    return scale
