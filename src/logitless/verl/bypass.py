"""verl's ``bypass_mode`` loss in ``fused_policy_loss``'s terms, where the definitions are equal.

In bypass mode (``algorithm.rollout_correction.bypass_mode``) verl's trainer sets old_log_probs to the
rollout engine's log-probs and ``policy_loss.loss_mode`` to "bypass_mode"; verl 0.9.1's
``core_algos.compute_policy_loss_bypass_mode`` then, per micro-batch and under no_grad, computes from *this
pass's* log-probs lp against the rollout's (old) ``compute_rollout_correction_and_rejection_mask``: IS weights
w (``rollout_is`` "token": exp(clamp(lp - old, +-20)), "sequence": exp(clamp(sum over the response of
lp - old, +-20)); truncated at the threshold u (TIS) or zeroed outside [l, u] (a "l_u" threshold, IcePop);
optionally divided by their batch mean) and a rejection mask (``rollout_rs``), and dispatches on
``rollout_correction.loss_type``:

    "ppo_clip"   compute_policy_loss_vanilla(old, lp, A, mask * rejection): the IS weights are only metrics
    "reinforce"  agg(-A * lp * w) over mask * rejection (w detached; without rollout_is, -A * lp)

The batch's own ``rollout_is_weights`` are ignored. Fused (exactly the same terms, gradients and aggregation):

    ppo_clip, no rollout_rs                      the vanilla loss mode (dual clip clip_ratio_c)
    reinforce, no rollout_is, no rollout_rs      gpg (-A lp)
    reinforce, rollout_is "token", threshold u >= 1 (TIS), no batch normalisation, no rollout_rs
                                                 cispo with clip_low 1, clip_high u - 1:
                                                 -sg(clamp(exp(clamp(lp - old, +-20)), 0, u)) A lp

Not fused (``bypass_mapping`` says why): any ``rollout_rs`` (a 0/1 mask of this pass's log-probs against the
rollout's, per token or per sequence, which logitless' losses do not define: their token_mask /
sequence_mask compare old_logprobs with rollout_logprobs, both known before the pass, and in bypass mode
those are equal; under seq-mean-token-mean the mask also changes each sequence's normaliser); reinforce with
``rollout_is`` "sequence" (a detached weight of the *sum* of a sequence's log-ratios: logitless' sequence
ratios are of the mean), with an IcePop band (a zero weight outside [l, u] of this pass's ratio), with
``rollout_is_batch_normalize`` (the weights' mean over the micro-batch, all-reduced over every rank) or with a
truncation below 1 (cispo's band cannot express min(r, u) for u < 1).
"""
from __future__ import annotations

from typing import Optional

MODE = "bypass_mode"


def bypass_mapping(config) -> tuple[Optional[str], dict, str]:
    """(verl loss mode whose fused settings equal this bypass loss, setting overrides, "") or
    (None, {}, why) for an ActorConfig whose ``policy_loss.loss_mode`` is "bypass_mode". The reading of the
    rollout_correction config (keys and defaults) is verl's own ``compute_policy_loss_bypass_mode``'s."""
    from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_is_threshold
    rc = config.policy_loss.get("rollout_correction", None)
    if rc is None:
        return None, {}, "no policy_loss.rollout_correction (verl's bypass loss raises without it)"
    loss_type = rc.get("loss_type", "ppo_clip")
    rollout_is = rc.get("rollout_is", None)
    threshold = rc.get("rollout_is_threshold", 2.0)
    normalize = rc.get("rollout_is_batch_normalize", False)
    rollout_rs = rc.get("rollout_rs", None)
    if rollout_rs is not None:
        return None, {}, (f"rollout_correction.rollout_rs={rollout_rs!r} (a rejection mask of this pass's "
                          "log-probs against the rollout's; the fused loss has no such mask)")
    if loss_type == "ppo_clip":
        return "vanilla", {}, ""
    if loss_type != "reinforce":
        return None, {}, f"rollout_correction.loss_type={loss_type!r} (verl knows 'ppo_clip' and 'reinforce')"
    if rollout_is is None or threshold is None:
        return "gpg", {}, ""
    if rollout_is != "token":
        return None, {}, (f"loss_type 'reinforce' with rollout_correction.rollout_is={rollout_is!r} (a detached "
                          "weight of the sum of the sequence's log-ratios of this pass; the fused sequence ratios "
                          "are of the mean)")
    upper, lower = _parse_rollout_is_threshold(threshold)
    if lower is not None:
        return None, {}, (f"loss_type 'reinforce' with rollout_correction.rollout_is_threshold={threshold!r} "
                          "(IcePop: a zero weight outside the band of this pass's ratio)")
    if normalize:
        return None, {}, ("loss_type 'reinforce' with rollout_correction.rollout_is_batch_normalize=True (the "
                          "weights' mean over the micro-batch, all-reduced over the ranks)")
    if upper < 1.0:
        return None, {}, (f"loss_type 'reinforce' with rollout_correction.rollout_is_threshold={threshold!r} "
                          "below 1 (cispo's clip band is [1 - clip_low, 1 + clip_high] with clip_high >= 0)")
    return "cispo", {"clip_low": 1.0, "clip_high": upper - 1.0}, ""
