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
and the response width verl's padded response axis.

The loss modes (``policy_loss.loss_mode``) are ``logitless.losses.verl_loss_settings``' surrogates, with verl's
parameters: clip_ratio_low / clip_ratio_high (else clip_ratio) as clip_low / clip_high; ``clip_ratio_c`` as
vanilla's dual clip (always on in verl) and dppo's ratio cap; tau_pos / tau_neg (sapo); dro_beta (dro);
clip_cov_ratio / clip_cov_lb / clip_cov_ub (clip_cov); kl_cov_ratio / ppo_kl_coef (kl_cov). verl's
``rollout_is_weights`` multiply the policy term (``rollout_weights``). sapo aggregates its policy term by
seq-mean-token-mean whatever ``loss_agg_mode`` says (verl does) and its KL loss and entropy bonus by
``loss_agg_mode``: the fused loss then gives those terms weights of their own (``kl_agg``, ``entropy_agg``) and
coefficients rescaled to the policy term's constant (``separate_terms``). geo_mean's policy term is a plain
mean over the micro-batch's sequences, outside that normalisation (``micro_batch_mean``). bypass_mode is the
vanilla, gpg or cispo settings (with current_is and the rejection mask where set) where its definition equals
theirs (``bypass.py``). ``unfusable`` names every setting that has no such mapping.
"""
from __future__ import annotations

from typing import Optional

from ..losses import KL_TYPES, VERL_POLICY_LOSSES, verl_loss_settings
from ..losses.policy import CLIPPED_SURROGATES
from .bypass import MODE as BYPASS
from .bypass import bypass_mapping

AGG = {"token-mean": "token-sum", "token-sum": "token-sum", "seq-mean-token-sum": "token-sum",
       "seq-mean-token-sum-norm": "token-sum", "seq-mean-token-mean": "seq-mean-token-mean"}
# loss modes fused for some of their settings only (``unfusable`` names the others)
PARTLY_FUSED = (BYPASS,)
# loss modes whose policy term verl takes as a plain mean over the micro-batch's sequences (torch.mean, fully
# masked ones included), outside loss_agg_mode and the mini-batch normalisation the KL loss and the entropy
# bonus keep: ``micro_batch_mean`` rescales the fused loss's terms to match
MICRO_BATCH_MEAN = ("geo_mean",)


def loss_mode(config) -> str:
    return config.policy_loss.get("loss_mode", "vanilla")


def fused_mode(config) -> tuple[Optional[str], dict, str]:
    """(the loss mode whose settings the fused loss takes, overrides of those settings, "") or (None, {}, why):
    the configured mode itself, or for bypass_mode the mode it equals (``bypass.py``)."""
    mode = loss_mode(config)
    if mode == BYPASS:
        return bypass_mapping(config)
    return mode, {}, ""


def uses_batch_is_weights(config) -> bool:
    """Whether verl's policy term reads the batch's ``rollout_is_weights`` (bypass_mode ignores them)."""
    return loss_mode(config) != BYPASS


def pg_agg_mode(config) -> str:
    """The aggregation verl gives the policy term: loss_agg_mode, except sapo's fixed seq-mean-token-mean."""
    return "seq-mean-token-mean" if loss_mode(config) == "sapo" else config.loss_agg_mode


def unfusable(config, *, with_entropy: bool) -> list:
    """verl actor settings (``ActorConfig``) the fused policy loss cannot reproduce, as "setting (why)"."""
    bad = []
    mode = loss_mode(config)
    mapped, _, why = fused_mode(config)
    if why:
        bad.append(f"policy_loss.loss_mode={mode!r} with {why}")
    elif mapped not in VERL_POLICY_LOSSES:
        bad.append(f"policy_loss.loss_mode={mode!r} (not a loss mode logitless knows: "
                   f"{', '.join((*VERL_POLICY_LOSSES, *PARTLY_FUSED))})")
    if config.loss_agg_mode not in AGG:
        bad.append(f"loss_agg_mode={config.loss_agg_mode!r} (not one of verl's token-weighted aggregations)")
    if config.use_kl_loss and config.kl_loss_type not in KL_TYPES:
        bad.append(f"kl_loss_type={config.kl_loss_type!r} (fused KL estimators: {', '.join(KL_TYPES)})")
    return bad


def settings(config, *, calculate_entropy: bool) -> dict:
    """``PolicyLoss`` keyword arguments (all but the per-token tensors) for verl's actor settings (call
    ``unfusable`` first). The entropy bonus is in verl's loss only when the engine computed the entropy
    (``calculate_entropy``, which the trainer sets when ``entropy_coeff != 0``); the KL loss only with
    ``use_kl_loss``."""
    mode, overrides, _ = fused_mode(config)
    pl = config.policy_loss
    out = verl_loss_settings(mode)
    clip = config.clip_ratio
    # verl's other losses read no clip ratio, and PolicyLoss refuses a setting its loss does not read
    if out.get("surrogate", "ppo") in CLIPPED_SURROGATES:
        out.update(clip_low=float(config.clip_ratio_low if config.clip_ratio_low is not None else clip),
                   clip_high=float(config.clip_ratio_high if config.clip_ratio_high is not None else clip))
    out.update(dual_clip=None,
               kl_coef=float(config.kl_loss_coef) if config.use_kl_loss else 0.0,
               kl_type=config.kl_loss_type if config.use_kl_loss else "k3",
               entropy_coef=float(config.entropy_coeff) if calculate_entropy else 0.0,
               loss_agg=AGG[pg_agg_mode(config)])
    if pg_agg_mode(config) != config.loss_agg_mode:
        # sapo: the KL loss and the entropy bonus keep loss_agg_mode's weights (``separate_terms`` scales them);
        # each only where its term is in the loss (PolicyLoss refuses a setting nothing reads)
        if out["entropy_coef"] != 0.0:
            out["entropy_agg"] = AGG[config.loss_agg_mode]
        if config.use_kl_loss:
            out["kl_agg"] = AGG[config.loss_agg_mode]
    if out.get("surrogate") == "geo_mean" and not config.use_kl_loss and out["entropy_coef"] == 0.0:
        del out["loss_agg"]      # verl's geo_mean ignores loss_agg_mode with no KL loss or entropy bonus to weigh
    if mode in ("vanilla", "dppo_tv", "dppo_kl"):
        out["dual_clip"] = float(config.get("clip_ratio_c", 3.0))
    if mode == "sapo":
        out.update(sapo_tau_pos=float(config.tau_pos), sapo_tau_neg=float(config.tau_neg))
    if mode == "dro":
        out["dro_beta"] = pl.get("dro_beta")
    if mode == "clip_cov":
        out.update(cov_ratio=float(pl.clip_cov_ratio), clip_cov_lb=float(pl.clip_cov_lb),
                   clip_cov_ub=float(pl.clip_cov_ub))
    if mode == "kl_cov":
        out.update(cov_ratio=float(pl.kl_cov_ratio), kl_cov_coef=float(pl.ppo_kl_coef))
    out.update(overrides)
    return out


def micro_batch_mean(kwargs: dict, agg_scale: float, *, loss_sequences: int, batch_sequences: int
                     ) -> tuple[dict, float]:
    """(settings, scale) for a ``MICRO_BATCH_MEAN`` loss mode (geo_mean). verl's loss there is

        mean_{b sequences of the micro-batch} pg_i + agg_scale * (kl_loss_coef * sum_j w_j kl_j - entropy_coeff * ...)

    while the fused loss's geo_mean term is the sum of pg_i over the ``loss_sequences`` sequences its rows
    delimit (the same pg_i; a sequence with no scored token, the packed rows' tail padding included, adds 0)
    divided by their number. Scaling the fused loss by s = loss_sequences / batch_sequences makes the policy
    terms equal; the KL and entropy coefficients are multiplied by agg_scale / s so that theirs are too.
    ``kwargs``: ``settings()``'s; agg_scale: ``loss_scale()``'s."""
    s = loss_sequences / batch_sequences
    ratio = agg_scale / s
    return dict(kwargs, kl_coef=kwargs["kl_coef"] * ratio, entropy_coef=kwargs["entropy_coef"] * ratio), s


def separate_terms(kwargs: dict, pg_scale: float, term_scale: float) -> dict:
    """settings for a loss mode whose policy term verl aggregates by another mode than its KL loss and entropy
    bonus (sapo: ``pg_agg_mode``). The fused loss is taken times ``pg_scale`` (the policy term's aggregation,
    ``loss_scale``); its KL and entropy terms carry loss_agg_mode's weights (``kl_agg``, ``entropy_agg``) and
    need that mode's constant, ``term_scale`` (``loss_scale(..., agg_mode=config.loss_agg_mode)``): their
    coefficients are multiplied by term_scale / pg_scale. pg_scale is 0 only when no sequence has a scored
    token, and then no term has one either: the coefficients stay as they are (the loss is 0 whatever they are;
    a coefficient set to 0 would leave its ``entropy_agg`` a setting without effect, which PolicyLoss refuses)."""
    ratio = term_scale / pg_scale if pg_scale else 1.0
    return dict(kwargs, kl_coef=kwargs["kl_coef"] * ratio, entropy_coef=kwargs["entropy_coef"] * ratio)


def loss_scale(config, *, dp_size: int, batch_num_tokens: Optional[float], global_batch_size: Optional[float],
               scored_tokens: int, scored_sequences: int, response_width: int,
               agg_mode: Optional[str] = None) -> float:
    """The constant that turns the fused loss (weights of ``settings()["loss_agg"]``) into verl's ``agg_loss``
    (see the module docstring). scored_*: the micro-batch's response tokens in the loss and the sequences
    that have one; response_width: the size of verl's padded response axis. agg_mode: verl's aggregation
    (default: the policy term's, ``pg_agg_mode``)."""
    mode = pg_agg_mode(config) if agg_mode is None else agg_mode
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
