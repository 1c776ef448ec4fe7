"""``enable(trainer, fused_loss=True)``: GRPOTrainer's policy loss computed by logitless' fused policy
loss (log-probs, entropy, clipped surrogate, KL and aggregation in one pass over the LM head, no logits).

TRL's settings map onto ``fused_policy_loss`` as follows (TRL's own formulas in its ``_compute_loss``):

    epsilon, epsilon_high      -> clip_low, clip_high (the ratio is clipped to [1 - eps, 1 + eps_high])
    delta (two-sided clipping) -> dual_clip = delta (identical when delta >= 1 + epsilon_high)
    beta                       -> kl_coef, kl_type "k3" (TRL's exp(ref - lp) - (ref - lp) - 1), ref_logprobs;
                                  with beta != 0 only under use_bias_correction_kl=False (TRL's default True
                                  multiplies the KL by the ratio)
    temperature                -> temperature
    loss_type "grpo"           -> "seq-mean-token-mean", times (sequences with a scored token) / (all sequences)
    loss_type "bnpo"           -> "token-mean"
    loss_type "dr_grpo"        -> "token-sum" / (sequences x max_completion_length)
    loss_type "dapo"           -> "token-sum" / TRL's normaliser (num_items_in_batch, per process and step)
    entropy_coef (loss "bnpo") -> entropy_coef (TRL's bonus is a token mean, so only bnpo's weights match)

and the gradient-accumulation scaling is TRL's. Everything else TRL can do is refused by
``check_mappable`` with a ValueError naming the settings: the other loss types (cispo, sapo, vespo, luspo
have other per-token terms or couple tokens), sequence-level importance sampling, entropy masking
(``top_entropy_quantile < 1``: the mask depends on this pass's entropies), an entropy bonus with another
loss type or adaptive, ``use_bias_correction_kl``, the off-policy mask, vLLM importance-sampling correction.
Like verl, the fused loss clamps log-ratios to +-20 and the k3 estimate to +-10 (TRL does not): equal
values unless a token's log-ratio to the old or reference policy is that large.

Metrics: TRL's (entropy, kl, clip ratios, policy_loss) are logged from the pass's detached log-probs and
entropies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .names import VISION_ARGS

LOSS_AGG = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "token-sum", "dapo": "token-sum"}


def unmappable(trainer) -> list:
    """TRL settings of ``trainer`` that the fused policy loss cannot reproduce, as "name=value (why)"."""
    args = trainer.args
    bad = []
    if trainer.loss_type not in LOSS_AGG:
        bad.append(f"loss_type={trainer.loss_type!r} (only {', '.join(LOSS_AGG)} have the clipped per-token "
                   "surrogate with fixed token weights)")
    if getattr(trainer, "importance_sampling_level", "token") != "token":
        bad.append(f"importance_sampling_level={trainer.importance_sampling_level!r} (a sequence-level ratio couples "
                   "the tokens of a sequence)")
    if trainer.top_entropy_quantile < 1.0:
        bad.append(f"top_entropy_quantile={trainer.top_entropy_quantile} (the entropy mask depends on the entropies "
                   "of the same pass)")
    if not 0.0 <= trainer.epsilon_low < 1.0:
        bad.append(f"epsilon_low={trainer.epsilon_low} (TRL's epsilon: the fused loss takes it as clip_low, in [0, 1))")
    delta = getattr(args, "delta", None)
    if delta is not None and delta < 1.0 + trainer.epsilon_high:
        bad.append(f"delta={delta} (equals dual_clip only when delta >= 1 + epsilon_high = "
                   f"{1.0 + trainer.epsilon_high})")
    if trainer.beta != 0.0 and getattr(args, "use_bias_correction_kl", False):
        bad.append("use_bias_correction_kl=True, TRL's default (the KL term times the ratio is not one of the fused KL "
                   "estimators; set it to False for beta != 0)")
    if getattr(trainer, "off_policy_mask_threshold", None) is not None:
        bad.append(f"off_policy_mask_threshold={trainer.off_policy_mask_threshold} (the mask depends on this pass's "
                   "log-probs)")
    if getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
        bad.append("vllm_importance_sampling_correction=True (a per-token weight on the policy term only)")
    if getattr(trainer, "use_adaptive_entropy", False):
        bad.append("use_adaptive_entropy=True (its coefficient follows the entropies of each step)")
    elif getattr(trainer, "entropy_coef", 0.0) != 0.0 and trainer.loss_type != "bnpo":
        bad.append(f"entropy_coef={trainer.entropy_coef} with loss_type={trainer.loss_type!r} (TRL's bonus is a "
                   "token mean, which only bnpo's weights match)")
    if getattr(trainer, "aux_loss_enabled", False):
        bad.append("aux_loss_enabled (the MoE load-balancing loss needs router logits)")
    return bad


def check_mappable(trainer) -> None:
    """ValueError naming every TRL setting of ``trainer`` that ``fused_loss=True`` cannot reproduce."""
    bad = unmappable(trainer)
    if bad:
        raise ValueError("logitless.trl.enable(trainer, fused_loss=True) cannot map these GRPOTrainer settings onto "
                         "logitless' fused policy loss: " + "; ".join(bad) + ". Use enable(trainer) (fused log-probs, "
                         "TRL's loss) instead")


def loss_scale(trainer, inputs, scored: torch.Tensor) -> float:
    """The constant that turns the mapped aggregation into TRL's loss (gradient accumulation included).

    scored: bool [B, T], the completion tokens the loss sees."""
    mode = "train" if trainer.model.training else "eval"
    accum = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    b = scored.shape[0]
    if trainer.loss_type == "grpo":
        # TRL averages over every sequence; the fused seq-mean counts sequences with a scored token
        return float(scored.any(dim=-1).sum().clamp(min=1).item()) / b / accum
    if trainer.loss_type == "bnpo":
        return 1.0 / accum
    if trainer.loss_type == "dr_grpo":
        return 1.0 / (b * trainer.max_completion_length) / accum
    # dapo: TRL's normaliser spans the generation batch, rescaled to one accumulation window
    normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
    if mode == "train":
        normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
    return 1.0 / float(normalizer)


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
        out = torch.zeros(b, s, dtype=torch.float32, device=x.device)
        out[:, first:s - 1] = x.detach().float()
        return out

    advantages = inputs["advantages"]
    advantages = advantages.detach().float().unsqueeze(1) if advantages.dim() == 1 else at_positions(advantages)
    old = inputs.get("old_per_token_logps")
    ref = inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None
    settings = dict(advantages=advantages, old_logprobs=None if old is None else at_positions(old),
                    ref_logprobs=None if ref is None else at_positions(ref), clip_low=float(trainer.epsilon_low),
                    clip_high=float(trainer.epsilon_high), dual_clip=getattr(trainer.args, "delta", None),
                    kl_coef=float(trainer.beta), kl_type="k3", entropy_coef=float(trainer.entropy_coef),
                    loss_agg=LOSS_AGG[trainer.loss_type], temperature=trainer.temperature)
    return PolicyInputs(input_ids, attention_mask, labels, settings, loss_scale(trainer, inputs, scored), scored)


def compute_loss(self, model, inputs):
    """logitless in place of GRPOTrainer._compute_loss when enabled with fused_loss=True."""
    from ..transformers import fused_policy_loss

    p = policy_inputs(self, inputs)
    with self.accelerator.autocast():
        out = fused_policy_loss(model, p.input_ids, p.attention_mask, labels=p.labels, **p.settings)
    _log_metrics(self, out, inputs, p)
    return out.loss * p.scale


def _log_metrics(self, out, inputs, p: PolicyInputs):
    """TRL's metrics of _compute_loss, from the pass's detached log-probs and entropies."""
    mode = "train" if self.model.training else "eval"
    maskf = p.scored.float()
    s, k = p.input_ids.shape[1], p.scored.shape[1]
    lp = out.logprobs[:, s - 1 - k:s - 1].detach()
    ent = out.entropy[:, s - 1 - k:s - 1].detach()

    def global_masked_mean(x):
        totals = self.accelerator.reduce(torch.stack([(x * maskf).sum(), maskf.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def masked_seq_mean(x):
        return (x * maskf).sum(-1) / maskf.sum(-1)

    if self.beta != 0.0:
        d = inputs["ref_per_token_logps"] - lp
        self._metrics[mode]["kl"].append(global_masked_mean(torch.exp(d) - d - 1))
    self._metrics[mode]["entropy"].append(global_masked_mean(ent))
    old = inputs.get("old_per_token_logps")
    coef_1 = torch.exp(lp - (lp if old is None else old))
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    low = ((coef_1 < 1 - self.epsilon_low) & (advantages < 0)).float()
    high = ((coef_1 > 1 + self.epsilon_high) & (advantages > 0)).float()
    self._metrics[mode]["clip_ratio/low_mean"].append(global_masked_mean(low))
    self._metrics[mode]["clip_ratio/high_mean"].append(global_masked_mean(high))
    self._metrics[mode]["clip_ratio/region_mean"].append(global_masked_mean(((low + high) > 0).float()))
    from trl.trainer.utils import nanmax, nanmin
    self._metrics[mode]["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(masked_seq_mean(low))).item())
    self._metrics[mode]["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(masked_seq_mean(high))).item())
