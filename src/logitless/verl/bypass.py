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
    reinforce, rollout_is "token", threshold u >= 1 (TIS), no batch normalisation
                                                 cispo with clip_low 1, clip_high u - 1:
                                                 -sg(clamp(exp(clamp(lp - old, +-20)), 0, u)) A lp
    reinforce, rollout_is "sequence" (threshold u or "l_u"), or "token" with "l_u" or u < 1, no batch
    normalisation                                gpg with current_is "<level>_truncate" (u) or "<level>_mask"
                                                 (l_u): -A lp sg(w), w verl's weight of this pass's log-probs

each with verl's ``rollout_rs`` (its options comma-chained, ``rollout_rs_threshold`` read by verl's own parser)
as the rejection mask of ``PolicyLoss`` (``rejection_settings``): token_k1 keeps -(lp - old) in [log l, log u],
the ratio band [1 / u, 1 / l] (``rejection_ratio_min`` / ``_max``); token_k2 / token_k3 keep 0.5 e^2 /
exp(e) - 1 - e at most their threshold (``rejection_k2_max`` / ``rejection_k3_max``); the sequence options
seq_sum_k*, seq_mean_k*, seq_max_k* keep a sequence whole by the sum, mean or maximum of those over its tokens
(``rejection_seq_ratio_*``, ``rejection_seq_mean_ratio_*``, ``rejection_seq_<stat>_k2_max`` / ``_k3_max``).
The mask removes rejected tokens from verl's policy term only (its response mask there), so the KL loss and the
entropy bonus keep every token; under seq-mean-token-mean each sequence's policy term becomes the mean over its
kept tokens, as the fused mask defines it. The other aggregations' normalisers are the mini-batch's token and
sequence counts, which verl's engine passes (``batch_num_tokens``, ``global_batch_size``; without them verl
counts the kept tokens and sequences, which the fused loss does not: ``rejection_counts_missing``).

Not fused (``bypass_mapping`` says why): reinforce with ``rollout_is_batch_normalize`` (the weights divided by
their mean over the micro-batch, all-reduced over every rank: a statistic of this pass's log-probs across ranks
that the fused loss does not form); rollout_rs without those counts.
"""
from __future__ import annotations

from typing import Optional

MODE = "bypass_mode"


def bypass_mapping(config) -> tuple[Optional[str], dict, str]:
    """(verl loss mode whose fused settings equal this bypass loss, setting overrides, "") or
    (None, {}, why) for an ActorConfig whose ``policy_loss.loss_mode`` is "bypass_mode". The reading of the
    rollout_correction config (keys and defaults) is verl's own ``compute_policy_loss_bypass_mode``'s."""
    rc = config.policy_loss.get("rollout_correction", None)
    if rc is None:
        return None, {}, "no policy_loss.rollout_correction (verl's bypass loss raises without it)"
    loss_type = rc.get("loss_type", "ppo_clip")
    rollout_is = rc.get("rollout_is", None)
    threshold = rc.get("rollout_is_threshold", 2.0)
    normalize = rc.get("rollout_is_batch_normalize", False)
    rejection, why = rejection_settings(rc)
    if why:
        return None, {}, why
    mode, overrides, why = _policy_term(loss_type, rollout_is, threshold, normalize)
    return mode, ({**overrides, **rejection} if mode is not None else {}), why


def rejection_settings(rc) -> tuple[dict, str]:
    """(PolicyLoss rejection settings, "") for rollout_correction's ``rollout_rs`` (``{}`` without one), or ({},
    why) for settings verl's own parser refuses (verl's loss then raises them itself). Options and thresholds
    are read by verl's ``compute_rollout_rejection_mask`` rules: comma-separated, stripped, duplicates dropped,
    one threshold for all or one per option."""
    from verl.trainer.ppo.rollout_corr_helper import (
        SUPPORTED_ROLLOUT_RS_OPTIONS,
        TOKEN_LEVEL_ROLLOUT_RS_OPTIONS,
        _parse_rollout_rs_thresholds,
    )
    rollout_rs = rc.get("rollout_rs", None)
    if rollout_rs is None:
        return {}, ""
    threshold = rc.get("rollout_rs_threshold", None)
    what = f"rollout_correction.rollout_rs={rollout_rs!r}"
    options = []
    for opt in (str(rollout_rs).split(",") if isinstance(rollout_rs, str) else []):
        opt = opt.strip()
        if opt and opt not in options:
            options.append(opt)
    if not options or any(opt not in SUPPORTED_ROLLOUT_RS_OPTIONS for opt in options):
        return {}, f"{what} (not options verl knows; verl's loss refuses it)"
    try:
        bounds = _parse_rollout_rs_thresholds(options, threshold)
    except (TypeError, ValueError) as exc:
        return {}, f"{what} with rollout_rs_threshold={threshold!r} ({exc})"
    out = {}
    for opt in options:
        # the PolicyLoss name: token_k2 -> rejection_k2_max, seq_sum_k3 -> rejection_seq_sum_k3_max, ...
        level = "" if opt in TOKEN_LEVEL_ROLLOUT_RS_OPTIONS else opt[:-2]
        if opt.endswith("k1"):      # keeps log l <= -(lp - old) (its sum, its mean) <= log u: the band [1/u, 1/l]
            band = {"": "rejection_ratio", "seq_sum_": "rejection_seq_ratio",
                    "seq_mean_": "rejection_seq_mean_ratio"}[level]
            out.update({f"{band}_min": 1.0 / bounds[opt]["upper"], f"{band}_max": 1.0 / bounds[opt]["lower"]})
        else:
            out[f"rejection_{level}{opt[-2:]}_max"] = float(bounds[opt]["upper"])
    return out, ""


def rejection_counts_missing(settings: dict, loss_agg_mode: str, *, batch_num_tokens, global_batch_size) -> str:
    """Why a rejection mask cannot run fused for this micro-batch ("" when it can): without the mini-batch's
    counts verl's agg_loss normalises by the kept tokens (token-mean) or the sequences with a kept token
    (the seq-mean modes) of the micro-batch, counts of this pass's log-probs."""
    if not any(key.startswith("rejection_") for key in settings):
        return ""
    if loss_agg_mode == "token-mean" and batch_num_tokens is None:
        return "bypass_mode's rollout_rs under token-mean without batch_num_tokens (verl counts the kept tokens)"
    if loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
        return (f"bypass_mode's rollout_rs under {loss_agg_mode} without global_batch_size (verl counts the "
                "sequences with a kept token)")
    return ""


def _policy_term(loss_type, rollout_is, threshold, normalize) -> tuple[Optional[str], dict, str]:
    from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_is_threshold
    if loss_type == "ppo_clip":
        return "vanilla", {}, ""
    if loss_type != "reinforce":
        return None, {}, f"rollout_correction.loss_type={loss_type!r} (verl knows 'ppo_clip' and 'reinforce')"
    if rollout_is is None or threshold is None:
        return "gpg", {}, ""
    if rollout_is not in ("token", "sequence"):
        return None, {}, f"rollout_correction.rollout_is={rollout_is!r} (verl knows 'token' and 'sequence')"
    try:
        upper, lower = _parse_rollout_is_threshold(threshold)
    except (TypeError, ValueError) as exc:
        return None, {}, f"rollout_correction.rollout_is_threshold={threshold!r} ({exc})"
    if normalize:
        return None, {}, ("loss_type 'reinforce' with rollout_correction.rollout_is_batch_normalize=True (the "
                          "weights' mean over the micro-batch, all-reduced over the ranks)")
    if rollout_is == "token" and lower is None and upper >= 1.0:
        return "cispo", {"clip_low": 1.0, "clip_high": upper - 1.0}, ""
    # the sequence's weight (of the sum of its log-ratios), IcePop's band, a truncation below 1
    mode = f"{rollout_is}_{'truncate' if lower is None else 'mask'}"
    return "gpg", {"current_is": mode, "current_is_min": lower, "current_is_max": upper}, ""
