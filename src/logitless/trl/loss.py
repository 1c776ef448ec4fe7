"""``enable(trainer, fused_loss=True)``: GRPOTrainer's policy loss computed by logitless' fused policy
loss (log-probs, entropy, the surrogate, KL and aggregation from the LM head, no logits).

TRL's settings map onto ``logitless.losses.PolicyLoss`` as follows (TRL's own formulas in its
``_compute_loss``; docs/trl.md has the table):

    epsilon, epsilon_high           -> clip_low, clip_high (the ratio clipped to [1 - eps, 1 + eps_high])
    delta (two-sided clipping)      -> delta (the unclipped ratio capped at delta)
    beta                            -> kl_coef, kl_type "k3_unclamped" (TRL's exp(ref - lp) - (ref - lp) - 1)
    use_bias_correction_kl          -> kl_ratio (the KL term times the importance ratio)
    importance_sampling_level       -> ratio_level ("token" / "sequence": GSPO's sequence ratio), with
                                       ratio_log_clamp=None: TRL's exp(log_ratio) is not clamped
    loss_type grpo, bnpo, dr_grpo,
              dapo, luspo           -> surrogate "ppo"
    loss_type cispo                 -> surrogate "cispo", its ratio clamped to at most epsilon_high (clip_low 1,
                                       clip_high epsilon_high - 1: below 0 for TRL's default bound, epsilon)
    loss_type sapo                  -> surrogate "sapo" (sapo_temperature_pos / _neg)
    loss_type vespo                 -> surrogate "vespo" (vespo_k_pos, vespo_lambda_pos, ...)
    the aggregation of each type    -> a loss_agg times a constant (``loss_scale``), with TRL's
                                       gradient-accumulation scaling
    top_entropy_quantile            -> entropy_quantile (over every process's tokens: entropy_quantile_group)
    off_policy_mask_threshold       -> off_policy_threshold (rollout_logprobs: the batch's
                                       sampling_per_token_logps, when present; NaN ones, which vLLM could
                                       not score, taken as no drift: rollout_nan_is_missing)
    vllm_importance_sampling_*      -> rollout_weights: the batch's importance_sampling_ratio
    entropy_coef, use_adaptive_entropy -> entropy_coef with entropy_agg "token-mean" (TRL's bonus is a token
                                       mean over the tokens the entropy mask keeps), TRL's adaptive
                                       controller run on the pass's entropies
    temperature                     -> temperature; cast_lm_head_to_fp32: the head in float32

The metrics TRL logs from ``_compute_loss`` (entropy, kl, clip ratios, cispo_clip_ratio,
vespo/phi_seq_mean, policy_loss, entropy_coef) are logged under TRL's names, computed as TRL computes them
from the pass's detached log-probs and entropies. What still cannot be mapped (an MoE auxiliary loss) is
refused by ``check_mappable``.
The ratio's log is not clamped (``ratio_log_clamp=None``), as TRL does not clamp it: equal values and
gradients however far the policy drifted from the old one (VESPO's weight keeps the +-20 clamps that TRL's
get_gamma_weights itself applies).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..losses.policy import CLIPPED_SURROGATES, RATIO_SURROGATES, on_policy_settings
from ..record import serial_now, write_step
from .names import VISION_ARGS
from .truncation import rollout_truncation_of

PPO_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = PPO_TYPES + ("cispo", "sapo", "vespo")
# the loss_agg whose weights, times loss_scale, are TRL's normaliser of each loss type
LOSS_AGG = {"grpo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "bnpo": "token-mean",
            "dr_grpo": "token-sum", "dapo": "token-sum", "cispo": "token-sum", "vespo": "token-sum",
            "luspo": "token-sum"}
SURROGATE = {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}
# types whose policy_loss metric TRL records before dividing by the accumulation steps
ACCUMULATION_DIVIDED = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")
# keyword arguments of logitless.transformers.fused_policy_loss itself (the rest go in loss_settings)
BASE_SETTINGS = ("advantages", "old_logprobs", "clip_low", "clip_high", "dual_clip", "ref_logprobs", "kl_coef",
                 "kl_type", "entropy_coef", "loss_agg", "temperature")


def unmappable(trainer) -> list:
    """TRL settings of ``trainer`` that the fused policy loss cannot reproduce, as "name=value (why)"."""
    bad = []
    if trainer.loss_type not in LOSS_TYPES:
        bad.append(f"loss_type={trainer.loss_type!r} (logitless maps {', '.join(LOSS_TYPES)})")
    level = getattr(trainer, "importance_sampling_level", "token")
    if level not in ("token", "sequence"):
        bad.append(f"importance_sampling_level={level!r}")
    if trainer.loss_type == "cispo" and not trainer.epsilon_high >= 0.0:
        bad.append(f"epsilon_high={trainer.epsilon_high} with loss_type='cispo' (CISPO's ratio is clamped to at most "
                   "epsilon_high, a weight >= 0: logitless takes a bound >= 0)")
    if not 0.0 <= trainer.epsilon_low <= 1.0:
        bad.append(f"epsilon_low={trainer.epsilon_low} (TRL's epsilon: the fused loss takes it as clip_low, in [0, 1])")
    if getattr(trainer, "aux_loss_enabled", False):
        bad.append("aux_loss_enabled (the MoE load-balancing loss needs router logits)")
    if not bad:
        bad += _invalid_settings(trainer)
    return bad


def check_mappable(trainer) -> None:
    """ValueError naming every TRL setting of ``trainer`` that ``fused_loss=True`` cannot reproduce."""
    bad = unmappable(trainer)
    if bad:
        raise ValueError("logitless.trl.enable(trainer, fused_loss=True) cannot map these GRPOTrainer settings onto "
                         "logitless' fused policy loss: " + "; ".join(bad) + ". Use enable(trainer) (fused log-probs, "
                         "TRL's loss) instead")


def _mode(trainer) -> str:
    return "train" if trainer.model.training else "eval"


def _accumulation(trainer) -> float:
    return trainer.current_gradient_accumulation_steps if _mode(trainer) == "train" else 1.0


def loss_scale(trainer, inputs, scored: torch.Tensor) -> float:
    """The constant that turns the mapped aggregation into TRL's loss (gradient accumulation included).

    scored: bool [B, T], the completion tokens the loss sees."""
    accum = _accumulation(trainer)
    b = scored.shape[0]
    kind = trainer.loss_type
    if kind in ("grpo", "sapo"):
        # TRL averages over every sequence; the fused seq-mean counts sequences with a scored token
        return float(scored.any(dim=-1).sum().clamp(min=1).item()) / b / accum
    if kind == "bnpo":
        return 1.0 / accum
    if kind == "dr_grpo":
        return 1.0 / (b * trainer.max_completion_length) / accum
    if kind == "luspo":
        return 1.0 / b / accum
    # dapo, cispo, vespo: TRL's normaliser spans the generation batch, rescaled to one accumulation window
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if _mode(trainer) == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return 1.0 / float(normalizer)


def applied_entropy_coef(trainer) -> float:
    """The entropy coefficient TRL applies in this step (the adaptive one is gated by last step's entropy)."""
    if not trainer._entropy_bonus_enabled:
        return 0.0
    if trainer.use_adaptive_entropy:
        return trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    return trainer.entropy_coef


def scalar_settings(trainer) -> dict:
    """The trainer's loss settings as ``PolicyLoss`` scalar settings (the table of the module docstring);
    the entropy bonus, which depends on the batch's scale, apart."""
    args = trainer.args
    kind = trainer.loss_type
    # TRL's ratio is exp(log_ratio) unclamped, however far the policy drifted (verl's is clamped at +-20)
    settings = dict(clip_low=float(trainer.epsilon_low), clip_high=float(trainer.epsilon_high), loss_agg=LOSS_AGG[kind],
                    surrogate=SURROGATE.get(kind, "ppo"),
                    ratio_level=getattr(trainer, "importance_sampling_level", "token"), ratio_log_clamp=None)
    if kind in PPO_TYPES and getattr(args, "delta", None) is not None:      # TRL's two-sided clip: ppo types only
        settings["delta"] = float(args.delta)
    if kind == "cispo":      # TRL: clamp(ratio, max=epsilon_high), detached (epsilon_high defaults to epsilon,
        # so the bound is often below 1); the ratio is > 0, so no lower bound
        settings.update(clip_low=1.0, clip_high=float(trainer.epsilon_high) - 1.0)
    elif kind == "sapo":
        settings.update(sapo_tau_pos=float(args.sapo_temperature_pos), sapo_tau_neg=float(args.sapo_temperature_neg))
    elif kind == "vespo":
        settings.update(vespo_k_pos=float(args.vespo_k_pos), vespo_lambda_pos=float(args.vespo_lambda_pos),
                        vespo_k_neg=float(args.vespo_k_neg), vespo_lambda_neg=float(args.vespo_lambda_neg))
    if trainer.beta != 0.0:
        settings.update(kl_coef=float(trainer.beta), kl_type="k3_unclamped",
                        kl_ratio=bool(getattr(args, "use_bias_correction_kl", False)))
    if trainer.top_entropy_quantile < 1.0:
        settings["entropy_quantile"] = float(trainer.top_entropy_quantile)
        if trainer.accelerator.num_processes > 1:
            # TRL's quantile spans every process's scored entropies (accelerator.gather: the default group)
            settings["entropy_quantile_group"] = torch.distributed.group.WORLD.group_name
    if trainer.off_policy_mask_threshold is not None:
        settings["off_policy_threshold"] = float(trainer.off_policy_mask_threshold)
    # PolicyLoss refuses a setting its loss does not read: TRL's epsilons are not read by sapo / vespo, and
    # vespo has no ratio to leave unclamped (unless the KL term is multiplied by it)
    if settings["surrogate"] not in CLIPPED_SURROGATES:
        del settings["clip_low"], settings["clip_high"]
    if settings["surrogate"] not in RATIO_SURROGATES and not settings.get("kl_ratio"):
        del settings["ratio_log_clamp"]
    return settings


def _invalid_settings(trainer) -> list:
    """The mapped settings' own checks (PolicyLoss's), run at enable() on a stand-in advantage."""
    from ..losses import PolicyLoss

    # checked as an off-policy batch's loss, which reads every mapped setting (an on-policy batch's drops those
    # that act on the ratio: policy_inputs)
    settings = dict(scalar_settings(trainer), old_logprobs=torch.zeros(()))
    if trainer.beta != 0.0:
        settings["ref_logprobs"] = torch.zeros(())
    try:
        PolicyLoss(advantages=torch.zeros(()), **settings)
    except (TypeError, ValueError) as exc:
        return [f"{exc} (from the trainer's loss settings)"]
    return []


@dataclass
class PolicyInputs:
    """One GRPO batch in fused_policy_loss's terms: per position of input_ids [B, s] (position t scores
    token t + 1), with TRL's settings mapped; ``scale`` turns the fused loss into TRL's."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    settings: dict
    scale: float
    scored: torch.Tensor        # bool [B, k]: the completion tokens in the loss
    entropy_coef: float         # TRL's coefficient of its (token-mean) entropy bonus in this step


def policy_inputs(trainer, inputs) -> PolicyInputs:
    """Map a GRPOTrainer batch (``_compute_loss``'s ``inputs``) and the trainer's settings."""
    check_mappable(trainer)
    extra = [name for name in VISION_ARGS + ("token_type_ids",) if inputs.get(name) is not None]
    if extra:
        raise ValueError(f"logitless.trl fused_loss scores text-only models; got {', '.join(extra)}")
    prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
    completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    k = completion_ids.size(1)
    mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
    scored = mask.bool()
    b, s = input_ids.shape
    first = s - 1 - k          # completion token j is predicted at position first + j
    labels = torch.full_like(input_ids, -100)
    labels[:, first:s - 1] = completion_ids.masked_fill(~scored, -100)

    def at_positions(x):
        if x is None:
            return None
        x = x.detach().float()
        if x.shape[1] == 1:                          # one value per sequence
            return x
        out = torch.zeros(b, s, dtype=torch.float32, device=x.device)
        out[:, first:s - 1] = x
        return out

    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    kind = trainer.loss_type
    old = at_positions(inputs.get("old_per_token_logps"))
    scalars = scalar_settings(trainer)
    if old is None:     # TRL's on-policy batch: the ratio is 1, and the settings that act on it are refused
        scalars = on_policy_settings(scalars)
    settings = dict(scalars, advantages=at_positions(advantages), old_logprobs=old, temperature=trainer.temperature)
    if trainer.beta != 0.0:
        settings["ref_logprobs"] = at_positions(inputs["ref_per_token_logps"])
    if trainer.off_policy_mask_threshold is not None:
        settings["rollout_logprobs"] = at_positions(inputs.get("sampling_per_token_logps"))
        # vLLM's missing log-probs are NaN: TRL's mask takes them as no drift (nan_to_num)
        settings["rollout_nan_is_missing"] = settings["rollout_logprobs"] is not None
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction and "importance_sampling_ratio" in inputs:
        settings["rollout_weights"] = at_positions(inputs["importance_sampling_ratio"])
    scale = loss_scale(trainer, inputs, scored)
    coef = applied_entropy_coef(trainer)
    if coef != 0.0:
        # TRL subtracts coef * (token mean of the entropy) / accumulation, whatever the loss type; the fused
        # loss is multiplied by ``scale`` afterwards
        settings["entropy_coef"] = coef / (_accumulation(trainer) * scale)
        if LOSS_AGG[kind] != "token-mean":
            settings["entropy_agg"] = "token-mean"
    return PolicyInputs(input_ids, attention_mask, labels, settings, scale, scored, coef)


def compute_loss(self, model, inputs):
    """logitless in place of GRPOTrainer._compute_loss when enabled with fused_loss=True."""
    from ..transformers import fused_policy_loss, head_in_fp32

    p = policy_inputs(self, inputs)
    base = {name: p.settings[name] for name in BASE_SETTINGS if name in p.settings}
    others = {name: value for name, value in p.settings.items() if name not in BASE_SETTINGS}
    since = serial_now()
    with self.accelerator.autocast(), head_in_fp32(bool(getattr(self.args, "cast_lm_head_to_fp32", False))):
        out = fused_policy_loss(model, p.input_ids, p.attention_mask, shift_labels=p.labels, loss_settings=others,
                                truncation=rollout_truncation_of(self), **base)
    write_step("trl.grpo", since)
    loss = out.loss * p.scale
    log_metrics(self, out.logprobs, out.entropy, inputs, p, loss.detach())
    return loss


def log_metrics(self, logprobs, entropy, inputs, p: PolicyInputs, loss):
    """TRL's metrics of _compute_loss (same names, same values), from the pass's detached log-probs and
    entropies ([B, s] at the input positions) and the loss returned; TRL's adaptive entropy controller."""
    from trl.trainer.utils import nanmax, nanmin

    mode = _mode(self)
    metrics = self._metrics[mode]
    mask = p.scored.to(torch.float32)
    s, k = p.input_ids.shape[1], p.scored.shape[1]
    lp = logprobs[:, s - 1 - k:s - 1].detach()
    ent = entropy[:, s - 1 - k:s - 1].detach()
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    old = inputs.get("old_per_token_logps")
    old = lp if old is None else old
    log_ratio = lp - old
    if self.importance_sampling_level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)

    def masked_seq_mean(x):
        if x.shape[1] == 1:
            return x.squeeze(1)
        return (x * mask).sum(-1) / mask.sum(-1)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            local_sum, local_count = x.sum(), torch.tensor(float(x.shape[0]), device=x.device)
        else:
            local_sum, local_count = (x * mask).sum(), mask.sum().float()
        totals = self.accelerator.reduce(torch.stack([local_sum, local_count]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    if self._entropy_bonus_enabled:
        effective = mask
        if self.top_entropy_quantile < 1.0:
            effective = mask * self.get_high_entropy_mask(ent, mask, 1 - self.top_entropy_quantile)
        bonus = (ent * effective).sum() / effective.sum().clamp(min=1.0)
        accum = _accumulation(self)
        policy_loss = loss + p.entropy_coef * bonus / accum
        if self.loss_type in ACCUMULATION_DIVIDED:
            policy_loss = policy_loss * accum
        metrics["policy_loss"].append(self.accelerator.gather(policy_loss).nanmean().item())
        _adaptive_entropy_update(self, mode, ent, effective)
        if mode == "train" and self.accelerator.sync_gradients:
            metrics["entropy_coef"].append(self.entropy_coef)

    if self.beta != 0.0:
        d = inputs["ref_per_token_logps"] - lp
        kl = torch.exp(d) - d - 1
        if self.args.use_bias_correction_kl:
            kl = kl * coef_1
        metrics["kl"].append(global_masked_mean(kl))
    metrics["entropy"].append(global_masked_mean(ent))
    if self.loss_type in PPO_TYPES:
        if self.args.delta is not None:
            coef_1 = torch.clamp(coef_1, max=self.args.delta)
        low = (coef_1 < 1 - self.epsilon_low) & (advantages < 0)
        high = (coef_1 > 1 + self.epsilon_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low.float()))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high.float()))
        metrics["clip_ratio/region_mean"].append(global_masked_mean((low | high).float()))
        metrics["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low.float()))).item())
        metrics["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high.float()))).item())
    elif self.loss_type == "cispo":
        clipped = (coef_1 > self.epsilon_high) & (advantages > 0)
        metrics["cispo_clip_ratio"].append(global_masked_mean(clipped.float()))
    elif self.loss_type == "vespo":
        phi = self.get_gamma_weights(advantages=advantages, log_ratio_per_token=lp - old, mask=mask,
                                     importance_sampling_ratio=inputs.get("importance_sampling_ratio"),
                                     k_pos=self.args.vespo_k_pos, lambda_pos=self.args.vespo_lambda_pos,
                                     k_neg=self.args.vespo_k_neg, lambda_neg=self.args.vespo_lambda_neg)
        metrics["vespo/phi_seq_mean"].append(global_masked_mean(phi))


def _adaptive_entropy_update(self, mode, ent, effective):
    """TRL's adaptive entropy controller (GRPOTrainer._compute_loss), on the pass's entropies."""
    if not (self.use_adaptive_entropy and mode == "train"):
        return
    stats = torch.stack([(ent * effective).sum(), effective.sum()]).detach()
    self._entropy_window_stats = stats if self._entropy_window_stats is None else self._entropy_window_stats + stats
    if self.accelerator.sync_gradients:
        window = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
        world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
        args = self.args
        if world_entropy <= args.entropy_target:
            self.entropy_coef = min(self.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
        else:
            self.entropy_coef = max(self.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
        self._last_world_entropy = world_entropy
        self._entropy_window_stats = None

