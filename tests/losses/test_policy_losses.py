"""Every policy loss of fused_policy_loss by name, on every backend (triton through its interpreter), against
float64 ground truth: log-probs and entropies from materialised float64 logits (reference64), the loss from
the trainer's own definition (verl 0.9.1's core_algos functions called themselves; TRL 1.16's formulas, its
static helpers called themselves), values and both gradients. Several token chunks per call (chunk boundaries
inside sequences), so a coupled loss's sequences and batch span chunks."""
from __future__ import annotations

import math

import pytest
import torch

from logitless.losses import PolicyLoss, fused_policy_loss, policy_loss
from logitless.losses.policy import reads_rollout_logprobs
from logitless.ops.triton.common import INTERPRETING
from policy64 import aggregate64
from reference64 import close_everywhere, logprobs_entropy64
from required import import_or_skip

core = import_or_skip("verl.trainer.ppo.core_algos", "make setup installs verl (the verl integration's tests)")
trl_grpo = import_or_skip("trl.trainer.grpo_trainer", "the test extra installs trl")
rollout_corr = import_or_skip("verl.trainer.ppo.rollout_corr_helper", "make setup installs verl")

TRITON = pytest.param("triton", marks=pytest.mark.skipif(
    not INTERPRETING, reason="CPU tensors: the triton backend needs its interpreter (TRITON_INTERPRET=1)"))
BACKENDS = ["chunked", "reference", TRITON]
B, S, H, V = 3, 7, 40, 263


@pytest.fixture
def small_chunks(monkeypatch):
    """4 tokens per chunk on the chunked backend, one token tile on the triton one: sequences of 7 span chunks."""
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * V))
    monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_BYTES", "1")


def batch(gen_seed=None, ignored=0.2, noise=0.4, s=S):
    """hidden, weight, labels [B, s] (some ignored; one row with a single scored token), advantages, and old /
    ref / rollout log-probs around the true ones (float32; NaN where ignored)."""
    S = s   # noqa: N806  (the sequences' length here)
    hidden = torch.randn(B, S, H)
    weight = torch.randn(V, H) * (4.0 / math.sqrt(H))
    with torch.no_grad():
        logp = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
        labels = torch.multinomial(logp.exp().reshape(-1, V), 1).reshape(B, S)
        lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ignore = torch.rand(B, S) < ignored
    ignore[:, 0] = False
    ignore[2, 1:] = True
    labels = torch.where(ignore, torch.full_like(labels, -100), labels)
    adv = torch.randn(B, S)
    old, ref, rollout = ((lp + noise * torch.randn(B, S).double()).clamp(max=0.0).float() for _ in range(3))
    nan = torch.full((B, S), float("nan"))
    adv, old, ref, rollout = (torch.where(ignore, nan, t) for t in (adv, old, ref, rollout))
    return hidden, weight, labels, adv, old, ref, rollout


def verl_config(**kw):
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    loss = kw.pop("policy_loss", {})
    loss.setdefault("dro_beta", kw.pop("dro_beta", None))
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       policy_loss=PolicyLossConfig(**loss), **kw)


def trl_k3(lp, ref):
    d = ref - lp
    return torch.exp(d) - d - 1


def trl_ppo(coef_1, adv, eps_low, eps_high, delta=None):
    """TRL's per-token clipped loss (grpo, bnpo, dr_grpo, dapo, luspo)."""
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    return -torch.min(coef_1 * adv, coef_2 * adv)


def trl_entropy_mask(ent, mask, quantile):
    """TRL's get_high_entropy_mask on one process (float32 quantile over the scored tokens)."""
    e = ent.detach().float()
    threshold = torch.quantile(e[mask.bool()], 1 - quantile)
    return ((e * mask.float()) >= threshold) & mask.bool()


def trl_is_ratio(old, rollout, mask, mode, lo, hi):
    """TRL's vLLM importance-sampling ratio (_generate_and_score_completions)."""
    diff = (old - rollout) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def verl_loss(mode, agg, **config):
    """verl's own compute_policy_loss_<mode> with an ActorConfig of ``config``."""
    fn = getattr(core, f"compute_policy_loss_{mode}")
    return lambda lp, ent, adv, old, ref, ro, m: fn(old, lp, adv, m, agg, verl_config(**config))[0]


def seq_ratio(lp, old, m):
    """TRL's importance_sampling_level="sequence" ratio, [b, 1]."""
    return torch.exp(((lp - old) * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1))


# name -> (our settings, the trainer's loss of float64 (lp, ent, adv, old, ref, rollout, mask))
CASES = {
    "verl-gspo": (dict(ratio_level="sequence-token", clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"),
                  verl_loss("gspo", "seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
    "verl-sapo": (dict(surrogate="sapo", sapo_tau_pos=1.2, sapo_tau_neg=0.9, loss_agg="seq-mean-token-mean"),
                  verl_loss("sapo", "seq-mean-token-mean", tau_pos=1.2, tau_neg=0.9)),
    "verl-gpg": (dict(surrogate="gpg", loss_agg="token-mean"), verl_loss("gpg", "token-mean")),
    "verl-cispo": (dict(surrogate="cispo", clip_low=0.2, clip_high=0.28, loss_agg="seq-mean-token-sum"),
                   verl_loss("cispo", "seq-mean-token-sum", clip_ratio_low=0.2, clip_ratio_high=0.28)),
    "verl-dro": (dict(surrogate="dro", dro_beta=0.3, loss_agg="token-mean"),
                 verl_loss("dro", "token-mean", dro_beta=0.3)),
    "verl-dppo_tv": (dict(surrogate="dppo_tv", clip_low=0.01, clip_high=0.02, loss_agg="token-mean"),
                     verl_loss("dppo_tv", "token-mean", clip_ratio_low=0.01, clip_ratio_high=0.02)),
    "verl-dppo_kl": (dict(surrogate="dppo_kl", clip_low=0.01, clip_high=0.02, loss_agg="seq-mean-token-mean"),
                     verl_loss("dppo_kl", "seq-mean-token-mean", clip_ratio_low=0.01, clip_ratio_high=0.02)),
    "verl-geo_mean": (dict(surrogate="geo_mean", clip_low=0.3, clip_high=0.2),
                      verl_loss("geo_mean", "token-mean", clip_ratio_low=0.3, clip_ratio_high=0.2)),
    "verl-kl_cov": (dict(surrogate="kl_cov", cov_ratio=0.2, kl_cov_coef=0.5, loss_agg="token-mean"),
                    verl_loss("kl_cov", "token-mean", policy_loss=dict(kl_cov_ratio=0.2, ppo_kl_coef=0.5))),
    "verl-clip_cov": (dict(surrogate="clip_cov", cov_ratio=0.2, clip_cov_lb=0.2, clip_cov_ub=3.0, clip_high=0.2,
                           loss_agg="seq-mean-token-mean"),
                      verl_loss("clip_cov", "seq-mean-token-mean",
                                policy_loss=dict(clip_cov_ratio=0.2, clip_cov_lb=0.2, clip_cov_ub=3.0))),
    "trl-gspo-bias_corrected_kl": (
        dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4, kl_coef=0.1, kl_type="k3_unclamped", kl_ratio=True,
             loss_agg="seq-mean-token-mean"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            trl_ppo(seq_ratio(lp, old, m), adv, 3e-4, 4e-4) + 0.1 * trl_k3(lp, ref) * seq_ratio(lp, old, m), m.bool(),
            "seq-mean-token-mean")),
    "trl-token-bias_corrected_kl": (
        dict(kl_coef=0.3, kl_type="k3_unclamped", kl_ratio=True, loss_agg="token-mean"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28) + 0.3 * trl_k3(lp, ref) * torch.exp(lp - old), m.bool(),
            "token-mean")),
    "trl-two_sided_delta": (dict(delta=1.1, clip_low=0.1, clip_high=0.2, loss_agg="token-sum"),
                            lambda lp, ent, adv, old, ref, ro, m: aggregate64(
                                trl_ppo(torch.exp(lp - old), adv, 0.1, 0.2, delta=1.1), m.bool(), "token-sum")),
    "trl-cispo-sequence": (
        dict(surrogate="cispo", ratio_level="sequence", clip_low=1.0, clip_high=0.1, loss_agg="token-sum"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            -torch.clamp(seq_ratio(lp, old, m), max=1.1).detach() * adv * lp, m.bool(), "token-sum")),
    # TRL's cispo with epsilon_high unset: the ratio clamped at epsilon, 0.2, below 1 (the old log-probs' noise
    # puts ratios on both sides of it)
    "trl-cispo-bound_below_1": (
        dict(surrogate="cispo", clip_low=1.0, clip_high=-0.8, kl_coef=0.05, kl_type="k3_unclamped", kl_ratio=True,
             loss_agg="token-sum"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            -torch.clamp(torch.exp(lp - old), max=0.2).detach() * adv * lp
            + 0.05 * trl_k3(lp, ref) * torch.exp(lp - old), m.bool(), "token-sum")),
    "trl-vespo": (dict(surrogate="vespo", loss_agg="token-sum"),
                  lambda lp, ent, adv, old, ref, ro, m: aggregate64(
                      -trl_grpo.GRPOTrainer.get_gamma_weights(adv, lp - old, m, None) * adv * lp, m.bool(),
                      "token-sum")),
    "trl-vespo-rollout_weights": (
        dict(surrogate="vespo", rollout_is="token_mask", rollout_is_min=0.7, rollout_is_max=1.5, loss_agg="token-sum"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            -trl_grpo.GRPOTrainer.get_gamma_weights(adv, lp - old, m, trl_is_ratio(old, ro, m, "token_mask", 0.7, 1.5))
            * adv * lp, m.bool(), "token-sum")),
    "trl-vespo-sequence_rollout_is": (   # TRL's default vLLM mode: one weight per sequence, counted once
        dict(surrogate="vespo", rollout_is="sequence_truncate", rollout_is_min=0.3, rollout_is_max=1.5,
             loss_agg="token-sum"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            -trl_grpo.GRPOTrainer.get_gamma_weights(
                adv, lp - old, m, trl_is_ratio(old, ro, m, "sequence_truncate", 0.3, 1.5)) * adv * lp, m.bool(),
            "token-sum")),
    "trl-off_policy_mask": (
        dict(off_policy_threshold=0.02, loss_agg="seq-mean-token-mean"),
        lambda lp, ent, adv, old, ref, ro, m: aggregate64(
            trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28)
            * trl_grpo.GRPOTrainer.get_off_policy_mask(adv, lp, ro, m, 0.02), m.bool(), "seq-mean-token-mean")),
    "trl-entropy_quantile-bonus": (
        dict(entropy_quantile=0.4, entropy_coef=0.05, entropy_agg="token-mean", loss_agg="seq-mean-token-mean"),
        lambda lp, ent, adv, old, ref, ro, m: (
            aggregate64(trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28) * trl_entropy_mask(ent, m, 0.4), m.bool(),
                        "seq-mean-token-mean")
            - 0.05 * (ent * m * trl_entropy_mask(ent, m, 0.4)).sum() / (m * trl_entropy_mask(ent, m, 0.4)).sum())),
    "k3_unclamped": (dict(kl_coef=0.5, kl_type="k3_unclamped", loss_agg="token-mean"),
                     lambda lp, ent, adv, old, ref, ro, m: aggregate64(
                         trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28) + 0.5 * trl_k3(lp, ref), m.bool(), "token-mean")),
}
for _mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
    CASES[f"rollout_is-{_mode}"] = (
        dict(rollout_is=_mode, rollout_is_min=0.8 if _mode.startswith("token") else 0.3, rollout_is_max=1.3,
             entropy_coef=0.01, loss_agg="token-mean"),
        (lambda mode: lambda lp, ent, adv, old, ref, ro, m: (
            aggregate64(trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28)
                        * trl_is_ratio(old, ro, m, mode, 0.8 if mode.startswith("token") else 0.3, 1.3),
                        m.bool(), "token-mean") - 0.01 * aggregate64(ent, m.bool(), "token-mean")))(_mode))


def verl_rollout_corrected(level, threshold, normalize, **ours):
    """verl's vanilla PPO loss with its own rollout-correction weights (compute_rollout_correction_weights)."""
    def fn(lp, ent, adv, old, ref, ro, m):
        weights, _ = rollout_corr.compute_rollout_correction_weights(old - ro, m, level, threshold, normalize)
        return core.compute_policy_loss_vanilla(old, lp, adv, m, "token-mean",
                                                verl_config(clip_ratio_low=0.2, clip_ratio_high=0.28),
                                                rollout_is_weights=weights)[0]
    return dict(dual_clip=3.0, clip_high=0.28, rollout_is_batch_normalize=normalize, **ours), fn


CASES["verl-rollout_is-token-tis"] = verl_rollout_corrected("token", 1.3, False, rollout_is="token_truncate",
                                                            rollout_is_max=1.3)
CASES["verl-rollout_is-sequence-tis-normalized"] = verl_rollout_corrected(
    "sequence", 2.0, True, rollout_is="sequence_truncate", rollout_is_max=2.0)
CASES["verl-rollout_is-token-icepop-normalized"] = verl_rollout_corrected(
    "token", "0.7_1.4", True, rollout_is="token_mask", rollout_is_min=0.7, rollout_is_max=1.4)


def verl_rejected(loss_type, agg, rollout_rs, threshold, kl_coef=0.0, entropy_coef=0.0, is_level=None,
                  is_threshold=None, **ours):
    """verl's bypass update's policy term over its rejection mask (compute_rollout_rejection_mask of this pass's
    log-probs against the rollout's, under no_grad), aggregated with the batch's token and sequence counts given
    (as verl's engine gives them), plus a k3 KL loss and an entropy bonus over the whole response mask; reinforce
    with IS weights of this pass's log-probs (compute_rollout_correction_weights) where is_level is given."""
    def fn(lp, ent, adv, old, ref, ro, m):
        with torch.no_grad():
            keep = m
            if rollout_rs is not None:
                keep, _ = rollout_corr.compute_rollout_rejection_mask(lp - ro, m, rollout_rs, threshold)
            weights = None
            if is_level is not None:
                weights, _ = rollout_corr.compute_rollout_correction_weights(lp - ro, m, is_level, is_threshold, False)
        config = verl_config(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
        info = dict(batch_num_tokens=m.sum(), global_batch_size=(m.sum(-1) > 0).sum())
        config.global_batch_info.update(info)
        if loss_type == "reinforce":
            pg = core.compute_policy_loss_reinforce(old, lp, adv, m * keep, agg, config, rollout_is_weights=weights)[0]
        else:
            pg = core.compute_policy_loss_vanilla(old, lp, adv, m * keep, agg, config)[0]
        kl = core.agg_loss(core.kl_penalty(lp, ref, "low_var_kl"), m, agg, **info)
        return pg + kl_coef * kl - entropy_coef * core.agg_loss(ent, m, agg, **info)
    surrogate = dict(surrogate="gpg") if loss_type == "reinforce" else dict(dual_clip=3.0)
    return dict(loss_agg=agg, kl_coef=kl_coef, kl_type="low_var_kl", entropy_coef=entropy_coef, **surrogate,
                **ours), fn


# verl's token_k1 threshold "l_u" keeps -(lp - rollout) in [log l, log u]: the ratio band [1 / u, 1 / l]
CASES["verl-rejection-token_k1-token-mean"] = verl_rejected(
    "ppo_clip", "token-mean", "token_k1", "0.7_1.6", kl_coef=0.1, rejection_ratio_min=1 / 1.6,
    rejection_ratio_max=1 / 0.7)
CASES["verl-rejection-token_k2_k3-seq-mean-token-mean"] = verl_rejected(
    "ppo_clip", "seq-mean-token-mean", "token_k2,token_k3", "0.05,0.06", kl_coef=0.1, entropy_coef=0.03,
    rejection_k2_max=0.05, rejection_k3_max=0.06)
CASES["verl-rejection-reinforce-token_k1-seq-mean-token-sum-norm"] = verl_rejected(
    "reinforce", "seq-mean-token-sum-norm", "token_k1", 1.4, entropy_coef=-0.02, rejection_ratio_min=1 / 1.4,
    rejection_ratio_max=1.4)
CASES["verl-rejection-reinforce-token_k3-seq-mean-token-sum"] = verl_rejected(
    "reinforce", "seq-mean-token-sum", "token_k3", 0.04, rejection_k3_max=0.04)
# sequence-level options (a sequence rejected whole), chained with each other and with token options
CASES["verl-rejection-token_k1-seq_mean_k3-token-mean"] = verl_rejected(
    "ppo_clip", "token-mean", "token_k1,seq_mean_k3", "0.6_1.6,0.05", kl_coef=0.1, rejection_ratio_min=1 / 1.6,
    rejection_ratio_max=1 / 0.6, rejection_seq_mean_k3_max=0.05)
CASES["verl-rejection-reinforce-seq_sum_k1-seq_max_k2-seq-mean-token-mean"] = verl_rejected(
    "reinforce", "seq-mean-token-mean", "seq_sum_k1,seq_max_k2", "0.5_2.0,0.3", entropy_coef=0.03,
    rejection_seq_ratio_min=1 / 2.0, rejection_seq_ratio_max=1 / 0.5, rejection_seq_max_k2_max=0.3)
CASES["verl-rejection-seq_mean_k1-seq_sum_k2-seq_sum_k3-seq-mean-token-sum"] = verl_rejected(
    "ppo_clip", "seq-mean-token-sum", "seq_mean_k1,seq_sum_k2,seq_sum_k3", "1.3,0.5,0.6",
    rejection_seq_mean_ratio_min=1 / 1.3, rejection_seq_mean_ratio_max=1.3, rejection_seq_sum_k2_max=0.5,
    rejection_seq_sum_k3_max=0.6)
CASES["verl-rejection-reinforce-seq_mean_k2-seq_max_k3-token-sum"] = verl_rejected(
    "reinforce", "token-sum", "seq_mean_k2,seq_max_k3", "0.06,0.2", is_level="sequence", is_threshold=2.0,
    current_is="sequence_truncate", current_is_max=2.0, rejection_seq_mean_k2_max=0.06,
    rejection_seq_max_k3_max=0.2)

# reinforce with IS weights of this pass's log-probs (verl's bypass reinforce): current_is
CASES["verl-current_is-sequence-tis-token-mean"] = verl_rejected(
    "reinforce", "token-mean", None, None, kl_coef=0.1, is_level="sequence", is_threshold=1.5,
    current_is="sequence_truncate", current_is_max=1.5)
CASES["verl-current_is-token-icepop-rejection-seq-mean-token-mean"] = verl_rejected(
    "reinforce", "seq-mean-token-mean", "token_k2", 0.05, entropy_coef=0.03, is_level="token",
    is_threshold="0.7_1.4",
    current_is="token_mask", current_is_min=0.7, current_is_max=1.4, rejection_k2_max=0.05)
CASES["verl-current_is-sequence-icepop-seq-mean-token-sum"] = verl_rejected(
    "reinforce", "seq-mean-token-sum", None, None, is_level="sequence", is_threshold="0.2_3.0",
    current_is="sequence_mask", current_is_min=0.2, current_is_max=3.0)
CASES["verl-current_is-token-tis-below-1-token-sum"] = verl_rejected(
    "reinforce", "token-sum", "token_k1", 1.6, is_level="token", is_threshold=0.8, current_is="token_truncate",
    current_is_max=0.8, rejection_ratio_min=1 / 1.6, rejection_ratio_max=1.6)


def verl_sapo_apart(agg, kl_type, kl_coef, entropy_coef):
    """verl's ppo_loss for sapo: the policy term by seq-mean-token-mean (compute_policy_loss_sapo), its KL loss
    and entropy bonus by loss_agg_mode ``agg``: three aggregations, kl_agg and entropy_agg."""
    def fn(lp, ent, adv, old, ref, ro, m):
        pg = core.compute_policy_loss_sapo(old, lp, adv, m, agg, verl_config(tau_pos=1.2, tau_neg=0.9))[0]
        kl = core.agg_loss(core.kl_penalty(lp, ref, kl_type), m, agg)
        return pg + kl_coef * kl - entropy_coef * core.agg_loss(ent, m, agg)
    settings = dict(surrogate="sapo", sapo_tau_pos=1.2, sapo_tau_neg=0.9, loss_agg="seq-mean-token-mean", kl_agg=agg,
                    kl_type=kl_type, kl_coef=kl_coef, entropy_coef=entropy_coef)
    if entropy_coef:        # entropy_agg without an entropy bonus is refused (a setting nothing reads)
        settings["entropy_agg"] = agg
    return settings, fn


CASES["verl-sapo-kl-entropy-token-mean"] = verl_sapo_apart("token-mean", "low_var_kl", 0.3, 0.05)
CASES["verl-sapo-kl-entropy-seq-mean-token-sum-norm"] = verl_sapo_apart("seq-mean-token-sum-norm", "mse", 0.5, -0.04)
CASES["verl-sapo-kl-seq-mean-token-sum"] = verl_sapo_apart("seq-mean-token-sum", "kl", 0.2, 0.0)


def uses_rollout(settings) -> bool:
    return ("rollout_is" in settings or settings.get("off_policy_threshold") is not None
            or any(name.startswith(("rejection", "current_is")) for name in settings))


def truth(inputs, fn, temperature=1.0, softcap=None):
    """(loss, d_hidden, d_weight), float64, of the trainer's definition ``fn`` on materialised logits."""
    hidden, weight, labels, adv, old, ref, rollout = inputs
    valid = labels != -100
    h = torch.where(valid.unsqueeze(-1), hidden.double(), 0.0).requires_grad_(True)
    w = weight.double().requires_grad_(True)
    lp, ent = logprobs_entropy64(h, w, labels, temperature, softcap=softcap)
    zero = torch.zeros_like(lp)
    adv, old, ref, rollout = (torch.where(valid, t.double(), zero) for t in (adv, old, ref, rollout))
    loss = fn(lp, ent, adv, old, ref, rollout, valid.double())
    loss.backward()
    return loss.detach(), h.grad, w.grad


def check(out, hidden, weight, want, valid):
    loss, dh, dw = want
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    assert abs(out.loss.item() - loss.item()) <= 2e-5 * max(1.0, abs(loss.item())), (out.loss.item(), loss.item())
    out.loss.backward()
    assert (hidden.grad[~valid] == 0).all()
    close_everywhere(hidden.grad[valid], dh[valid], 1e-4)
    close_everywhere(weight.grad, dw, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_loss_equals_trainer_definition(backend, case, small_chunks):
    settings, fn = CASES[case]
    inputs = batch()
    hidden, weight, labels, adv, old, ref, rollout = inputs
    torch.manual_seed(1234)          # clip_cov draws its tokens with torch.randperm, as verl does
    want = truth(inputs, fn, temperature=0.9)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    settings = dict(settings)
    torch.manual_seed(1234)
    if uses_rollout(settings):
        settings["rollout_logprobs"] = rollout
    out = fused_policy_loss(h, w, labels, adv, old, ref_logprobs=ref, temperature=0.9, backend=backend, **settings)
    check(out, h, w, want, labels != -100)


def test_the_settings_matter():
    """Each case's truth differs from the plain clipped loss (the setting is exercised, not a no-op)."""
    inputs = batch()
    plain = truth(inputs, lambda lp, ent, adv, old, ref, ro, m: aggregate64(
        trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28), m.bool(), "token-mean"))[0]
    for case, (_, fn) in CASES.items():
        assert abs(truth(inputs, fn)[0].item() - plain.item()) > 1e-6, case


@pytest.mark.parametrize("backend", ["chunked", TRITON])
def test_vespo_with_weights_per_sequence(backend, small_chunks):
    """rollout_weights given one per sequence ([b, 1], TRL's importance_sampling_ratio in its sequence modes):
    VESPO's sequence weight adds each sequence's log weight once, as TRL's get_gamma_weights does; the same
    weights given per token ([b, s]) add one log per token."""
    inputs = batch()
    hidden, weight, labels, adv, old, ref, rollout = inputs
    m = (labels != -100).double()
    rho = 0.5 + torch.rand(B, 1)
    for shape, trl_rho in (((B, 1), rho), ((B, S), rho.expand(B, S) * m)):
        want = truth(inputs, lambda lp, ent, adv, old, ref, ro, m, r=trl_rho: aggregate64(
            -trl_grpo.GRPOTrainer.get_gamma_weights(adv, lp - old, m, r.double() if r.shape[1] == 1 else
                                                    torch.where(m.bool(), r.double(), 1.0)) * adv * lp,
            m.bool(), "token-sum"))
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fused_policy_loss(h, w, labels, adv, old, surrogate="vespo", loss_agg="token-sum", backend=backend,
                                rollout_weights=rho.expand(shape).contiguous())
        check(out, h, w, want, labels != -100)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rollout_logprobs_missing_as_nan(backend, small_chunks):
    """rollout_nan_is_missing=True: NaN rollout log-probs at scored tokens (vLLM could not score them) add 0 to
    the off-policy mask's sum and give the rollout_is weight 1, as TRL's get_off_policy_mask and its vLLM
    ratio (nan_to_num) do; without it they are a ValueError naming rollout_logprobs."""
    inputs = batch()
    hidden, weight, labels, adv, old, ref, rollout = inputs
    rollout = rollout.clone()
    rollout[0, 0] = rollout[1, 0] = float("nan")                 # column 0 is scored in every row
    rollout[(labels != -100) & (torch.rand(B, S) < 0.3)] = float("nan")
    inputs = (hidden, weight, labels, adv, old, ref, rollout)

    def trl(lp, ent, adv, old, ref, ro, m):
        ro = torch.where(torch.isnan(rollout), ro.new_tensor(float("nan")), ro)   # truth() zeroed only padding
        diff = torch.nan_to_num((old - ro) * m, nan=0.0).sum(-1, keepdim=True)       # TRL's sequence_truncate
        weights = torch.exp(diff).clamp(min=0.3, max=1.5)
        keep = trl_grpo.GRPOTrainer.get_off_policy_mask(adv, lp, ro, m, 0.02)
        return aggregate64(trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28) * keep * weights, m.bool(), "token-mean")
    want = truth(inputs, trl, temperature=0.9)
    settings = dict(off_policy_threshold=0.02, rollout_is="sequence_truncate", rollout_is_min=0.3, rollout_is_max=1.5,
                    rollout_logprobs=rollout, temperature=0.9, backend=backend)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_policy_loss(h, w, labels, adv, old, rollout_nan_is_missing=True, **settings)
    check(out, h, w, want, labels != -100)
    with pytest.raises(ValueError, match="rollout_logprobs must be finite"):
        fused_policy_loss(hidden, weight, labels, adv, old, **settings)
    rollout[2, 0] = float("inf")                  # an infinity is refused either way
    with pytest.raises(ValueError, match="rollout_logprobs must be finite"):
        fused_policy_loss(hidden, weight, labels, adv, old, rollout_nan_is_missing=True, **settings)


def test_k3_unclamped_differs_from_verls_clamped_k3():
    """ref far above the policy's log-prob: verl's k3 clamps at 10, TRL's does not."""
    hidden, weight, labels, adv, old, _, _ = batch()
    valid = labels != -100
    # at temperature 3 the policy is flat (log-probs near -log V), so a reference 6 nats above it is still a
    # log-prob (<= 0) at most tokens: k3 = e^6 - 7 there, far past verl's clamp at 10
    lp = logprobs_entropy64(hidden, weight, labels, temperature=3.0)[0]
    ref = torch.where(valid, (lp + 6.0).clamp(max=0.0), float("nan")).float()
    old = torch.where(valid, lp.float(), float("nan"))
    outs = [fused_policy_loss(hidden, weight, labels, adv, old, ref_logprobs=ref, kl_coef=1.0, kl_type=k,
                              temperature=3.0).loss.item() for k in ("k3", "k3_unclamped")]
    # the policy term is the same in both: the difference is the token-mean of what the clamp cuts off
    d = ref[valid].double() - lp[valid]
    k3 = torch.expm1(d) - d
    cut = (k3 - k3.clamp(-10.0, 10.0)).mean().item()
    assert cut > 1.0
    assert outs[1] - outs[0] == pytest.approx(cut, rel=1e-4)


@pytest.mark.parametrize("backend", ["chunked", TRITON])
def test_softcapped_head(backend, small_chunks):
    """A softcapped head (Gemma 2's final_logit_softcapping) through the exact two-pass path."""
    inputs = batch()
    hidden, weight, labels, adv, old, ref, rollout = inputs
    want = truth(inputs, lambda lp, ent, adv, old, ref, ro, m: aggregate64(
        trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28) + 0.1 * trl_k3(lp, ref), m.bool(), "token-mean")
        - 0.02 * aggregate64(ent, m.bool(), "token-mean"), softcap=2.5)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, kl_coef=0.1, kl_type="k3_unclamped",
                        entropy_coef=0.02)
    out = policy_loss(policy, h, w, labels, softcap=2.5, backend=backend)
    check(out, h, w, want, labels != -100)


def drift_batch():
    """batch() with the policy far from the old one: 3 tokens of row 0 and every token of row 1 have
    lp - old around 21 (beyond verl's clamp at 20; row 1's sequence mean too), with advantages -3e-9 there,
    so that their unclipped terms (-A exp(lp - old), about 4) weigh like the others."""
    hidden, weight, labels, adv, old, ref, rollout = batch()
    old, adv = old.clone(), adv.clone()
    far = torch.zeros(B, S, dtype=torch.bool)
    far[0, :3] = True
    far[1] = True
    far &= labels != -100
    old[far] -= 21.0
    adv[far] = -3e-9
    return hidden, weight, labels, adv, old, ref, rollout


# TRL's ratio is exp(lp - old), never clamped: ratio_log_clamp=None
DRIFT_CASES = {
    "token": (dict(loss_agg="token-mean"), lambda lp, ent, adv, old, ref, ro, m: aggregate64(
        trl_ppo(torch.exp(lp - old), adv, 0.2, 0.28), m.bool(), "token-mean")),
    "sequence": (dict(ratio_level="sequence", loss_agg="seq-mean-token-mean"),
                 lambda lp, ent, adv, old, ref, ro, m: aggregate64(
                     trl_ppo(seq_ratio(lp, old, m), adv, 0.2, 0.28), m.bool(), "seq-mean-token-mean")),
    "token-bias_corrected_kl": CASES["trl-token-bias_corrected_kl"],
    "sequence-bias_corrected_kl": CASES["trl-gspo-bias_corrected_kl"],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(DRIFT_CASES))
def test_unclamped_ratio_beyond_20_equals_trl(backend, case, small_chunks):
    """ratio_log_clamp=None (TRL's ratio, and its KL's bias correction): values and gradients equal the float64
    formula where lp - old exceeds 20; verl's clamp (the default) gives another loss on the same inputs."""
    settings, fn = DRIFT_CASES[case]
    inputs = drift_batch()
    hidden, weight, labels, adv, old, ref, rollout = inputs
    want = truth(inputs, fn, temperature=0.9)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_policy_loss(h, w, labels, adv, old, ref_logprobs=ref, temperature=0.9, backend=backend,
                            ratio_log_clamp=None, **settings)
    check(out, h, w, want, labels != -100)
    clamped = fused_policy_loss(hidden, weight, labels, adv, old, ref_logprobs=ref, temperature=0.9, backend=backend,
                                **settings).loss.item()
    assert abs(clamped - want[0].item()) > 0.1, (clamped, want[0].item())     # each far token adds about 2.5


BAD = [
    (dict(surrogate="ppo2"), "surrogate"),
    (dict(ratio_level="seq"), "ratio_level"),
    (dict(kl_type="k4"), "kl_type"),
    (dict(surrogate="dro"), "dro_beta"),
    (dict(surrogate="dro", dro_beta=-1.0), "dro_beta"),
    (dict(delta=0.9), "delta"),
    (dict(delta=1.5, surrogate="cispo"), "delta"),
    (dict(clip_high=-0.1), "clip_high"),                                    # a bound below 1: cispo's only
    (dict(surrogate="cispo", clip_low=1.0, clip_high=-1.5), "clip_high"),    # a negative weight bound
    (dict(surrogate="cispo", clip_low=0.2, clip_high=-0.5), "below its lower bound"),
    (dict(dual_clip=3.0, surrogate="sapo"), "dual_clip"),
    (dict(cov_ratio=0.0, surrogate="kl_cov"), "cov_ratio"),
    (dict(clip_cov_lb=5.0, clip_cov_ub=1.0, surrogate="clip_cov"), "clip_cov_lb"),
    (dict(surrogate="geo_mean", entropy_quantile=0.5), "geo_mean"),
    (dict(surrogate="vespo", ratio_level="sequence"), "ratio_level"),
    (dict(entropy_quantile=0.0), "entropy_quantile"),
    (dict(entropy_quantile=1.5), "entropy_quantile"),
    (dict(sapo_tau_pos=0.0), "sapo_tau_pos"),
    (dict(rollout_is="token_truncate", rollout_is_max=2.0), "rollout_logprobs"),
    (dict(rollout_is="tis"), "rollout_is"),
    (dict(rollout_is_min=2.0, rollout_is_max=1.0), "rollout_is_min"),
    (dict(entropy_agg="mean"), "loss_agg"),
    (dict(kl_agg="mean"), "loss_agg"),
    (dict(kl_agg="token-sum"), "kl_agg='token-sum' aggregates the KL term, which needs ref_logprobs"),
    (dict(off_policy_threshold=float("nan")), "off_policy_threshold"),
    (dict(ratio_log_clamp=0.0), "ratio_log_clamp"),
    (dict(ratio_log_clamp=float("inf")), "ratio_log_clamp"),
    (dict(rejection_ratio_min=0.0), "rejection_ratio_min"),
    (dict(rejection_ratio_min=1.5, rejection_ratio_max=1.2), "rejection_ratio_min"),
    (dict(rejection_k2_max=-0.1), "rejection_k2_max"),
    (dict(rejection_k3_max=float("nan")), "rejection_k3_max"),
    (dict(rejection_k3_max=0.1, surrogate="geo_mean"), "rejection_k3_max"),
    (dict(rejection_seq_ratio_min=2.0, rejection_seq_ratio_max=1.5), "rejection_seq_ratio_min"),
    (dict(rejection_seq_max_k3_max=0.0), "rejection_seq_max_k3_max"),
    (dict(current_is="sequence"), "current_is"),
    (dict(current_is="token_truncate"), "current_is_max"),
    (dict(current_is="token_mask", current_is_min=2.0, current_is_max=1.0), "current_is_min"),
    (dict(current_is_max=2.0), "current_is_min / current_is_max need current_is"),
    (dict(current_is="sequence_mask", current_is_min=-1.0), "current_is_min"),
]


@pytest.mark.parametrize("settings,name", BAD)
def test_bad_settings_are_named(settings, name):
    hidden, weight, labels, adv, old, ref, rollout = batch()
    with pytest.raises(ValueError, match=name):
        fused_policy_loss(hidden, weight, labels, adv, old, **settings)


def test_missing_inputs_are_named():
    hidden, weight, labels, adv, old, ref, rollout = batch()
    with pytest.raises(ValueError, match="rollout_is_max"):
        fused_policy_loss(hidden, weight, labels, adv, old, rollout_logprobs=rollout, rollout_is="token_truncate")
    with pytest.raises(ValueError, match="old_logprobs"):
        fused_policy_loss(hidden, weight, labels, adv, None, rollout_logprobs=rollout, rollout_is="token_mask")
    with pytest.raises(ValueError, match="ratio_level='sequence' needs sequences"):
        fused_policy_loss(hidden.reshape(-1, H), weight, labels.reshape(-1), adv.reshape(-1), old.reshape(-1),
                          ratio_level="sequence")
    with pytest.raises(ValueError, match="rejection_k2_max needs rollout_logprobs or old_logprobs"):
        fused_policy_loss(hidden, weight, labels, adv, None, rejection_k2_max=0.1)
    with pytest.raises(ValueError, match="current_is='token_mask' needs rollout_logprobs or old_logprobs"):
        fused_policy_loss(hidden, weight, labels, adv, None, current_is="token_mask", current_is_max=2.0)
    # per-token terms against the rollout have no place in geo_mean's per-sequence loss
    with pytest.raises(ValueError, match="rejection_k2_max is a token mask .* surrogate='geo_mean'"):
        fused_policy_loss(hidden, weight, labels, adv, old, rejection_k2_max=0.1, surrogate="geo_mean")
    with pytest.raises(ValueError, match="current_is='token_mask' weights a per-token .* surrogate='geo_mean'"):
        fused_policy_loss(hidden, weight, labels, adv, old, current_is="token_mask", current_is_max=2.0,
                          surrogate="geo_mean")
    with pytest.raises(ValueError, match="current_is='sequence_mask' needs sequences"):
        fused_policy_loss(hidden.reshape(-1, H), weight, labels.reshape(-1), adv.reshape(-1), old.reshape(-1),
                          current_is="sequence_mask", current_is_max=2.0)
    with pytest.raises(ValueError, match=r"a sequence-level rejection \(rejection_seq_\*\) needs sequences"):
        fused_policy_loss(hidden.reshape(-1, H), weight, labels.reshape(-1), adv.reshape(-1), old.reshape(-1),
                          rejection_seq_mean_k2_max=0.1)
    with pytest.raises(TypeError, match="made_up"):
        fused_policy_loss(hidden, weight, labels, adv, old, made_up=1.0)
    with pytest.raises(TypeError, match="entropy_quantile_group"):
        fused_policy_loss(hidden, weight, labels, adv, old, entropy_quantile=0.5, entropy_quantile_group=3)


@pytest.mark.parametrize("settings", [dict(ratio_level="sequence", kl_coef=0.2, kl_ratio=True),
                                      dict(surrogate="vespo"), dict(off_policy_threshold=0.01),
                                      dict(rollout_is="sequence_mask", rollout_is_min=0.5, rollout_is_max=1.5),
                                      dict(surrogate="geo_mean"),
                                      dict(surrogate="gpg", current_is="sequence_truncate", current_is_max=1.5,
                                           rejection_k2_max=0.05)])
def test_coupled_losses_in_packed_and_sequence_first_layouts(settings, small_chunks):
    """The sequences of a coupled loss from cu_seqlens (packed 1-D labels) and from [b, s] labels with
    [s, b] hidden states (seq_first, Megatron's layout): the same loss and gradients as the [b, s] rows."""
    hidden, weight, labels, adv, old, ref, rollout = batch()
    settings = dict(settings, ref_logprobs=ref, loss_agg="seq-mean-token-mean")
    if reads_rollout_logprobs(settings):      # given where nothing reads them, they are refused
        settings["rollout_logprobs"] = rollout
    grads = []
    for layout in ("rows", "packed", "seq_first"):
        h = hidden.clone()
        if layout == "seq_first":
            h = h.transpose(0, 1).contiguous()
        h.requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        per_token = dict(advantages=adv, old_logprobs=old, **settings)
        lab = labels
        if layout == "packed":
            per_token = {k: v.reshape(-1) if torch.is_tensor(v) else v for k, v in per_token.items()}
            per_token["cu_seqlens"] = torch.arange(0, B * S + 1, S)
            lab = labels.reshape(-1)
        out = policy_loss(PolicyLoss(**per_token), h.reshape(-1, H) if layout == "packed" else h, w, lab,
                          seq_first=layout == "seq_first")
        out.loss.backward()
        dh = h.grad.transpose(0, 1) if layout == "seq_first" else h.grad.reshape(B, S, H)
        grads.append((out.loss.item(), dh, w.grad))
    for loss, dh, dw in grads[1:]:
        assert abs(loss - grads[0][0]) <= 1e-6 * max(1.0, abs(grads[0][0]))
        assert torch.allclose(dh, grads[0][1], rtol=1e-5, atol=1e-7)
        assert torch.allclose(dw, grads[0][2], rtol=1e-5, atol=1e-7)


SEQUENCE_COUPLED = ["verl-gspo", "verl-geo_mean", "trl-gspo-bias_corrected_kl", "trl-cispo-sequence", "trl-vespo",
                    "trl-vespo-rollout_weights", "trl-vespo-sequence_rollout_is", "trl-off_policy_mask",
                    "verl-rejection-token_k2_k3-seq-mean-token-mean", "verl-current_is-sequence-tis-token-mean",
                    "verl-current_is-sequence-icepop-seq-mean-token-sum",
                    "verl-rejection-reinforce-seq_sum_k1-seq_max_k2-seq-mean-token-mean",
                    "verl-rejection-seq_mean_k1-seq_sum_k2-seq_sum_k3-seq-mean-token-sum"]


@pytest.mark.parametrize("backend", ["chunked", TRITON])
@pytest.mark.parametrize("case", SEQUENCE_COUPLED)
def test_sequence_coupled_losses_keep_the_one_pass(backend, case, monkeypatch):
    """Chunks that hold whole sequences (8 rows on the chunked backend: several chunks cut at sequence
    boundaries; the triton one's 16-row token tile: one chunk; sequences of at most 7 tokens): the loss
    is coupled within sequences only, so it takes the one fused pass, exact."""
    import logitless.losses.api as api

    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(8 * V))
    monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_BYTES", "1")

    def no_second_pass(*args, **kwargs):
        raise AssertionError("the two-pass path ran")
    monkeypatch.setattr(api, "_reference", no_second_pass)
    cuts = []
    original = api._sequence_bounds
    monkeypatch.setattr(api, "_sequence_bounds", lambda *a: cuts.append(original(*a)) or cuts[-1])
    settings, fn = CASES[case]
    inputs = batch()
    hidden, weight, labels, adv, old, ref, rollout = inputs
    torch.manual_seed(1234)
    want = truth(inputs, fn, temperature=0.9)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    settings = dict(settings)
    if uses_rollout(settings):
        settings["rollout_logprobs"] = rollout
    out = fused_policy_loss(h, w, labels, adv, old, ref_logprobs=ref, temperature=0.9, backend=backend, **settings)
    check(out, h, w, want, labels != -100)
    assert len(cuts) == 1 and cuts[0] is not None
    if backend == "chunked":
        assert len(cuts[0]) > 2          # several chunks, cut at sequence boundaries (triton: one 16-row tile)


LONG_SEQUENCE_CASES = ["verl-gspo", "verl-geo_mean", "trl-gspo-bias_corrected_kl", "trl-vespo", "trl-off_policy_mask",
                       "verl-rejection-reinforce-seq_sum_k1-seq_max_k2-seq-mean-token-mean"]


@pytest.mark.skipif(not INTERPRETING, reason="CPU tensors: the triton backend needs its interpreter")
@pytest.mark.parametrize("case", LONG_SEQUENCE_CASES)
def test_long_sequences_grow_the_chunk(case, monkeypatch):
    """Sequences of up to 40 tokens against a 16-row chunk (the workspace knob at its smallest): within
    LOGITLESS_POLICY_WORKSPACE_MAX_BYTES the triton pass's chunk grows to the longest sequence and the loss keeps
    the one fused pass (no second pass ran, one statistics kernel a chunk, a chunk longer than 16 rows); with the
    bound at its smallest the same loss takes the two-pass path. Both equal float64 and each other."""
    import logitless.losses.api as api
    import logitless.ops.triton.policy_backend as policy_backend

    monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_BYTES", "1")
    ran, cuts, stats_calls = [], [], []
    two_pass, original, chunk_stats = api._reference, api._sequence_bounds, policy_backend.chunk_stats
    monkeypatch.setattr(api, "_reference", lambda *a, **k: ran.append(1) or two_pass(*a, **k))
    monkeypatch.setattr(api, "_sequence_bounds", lambda *a: cuts.append(original(*a)) or cuts[-1])
    monkeypatch.setattr(policy_backend, "chunk_stats", lambda *a: stats_calls.append(1) or chunk_stats(*a))
    settings, fn = CASES[case]
    inputs = batch(s=40)
    hidden, weight, labels, adv, old, ref, rollout = inputs
    valid = labels != -100
    longest = int(valid.sum(dim=1).max())
    assert longest > 16
    want = truth(inputs, fn, temperature=0.9)
    settings = dict(settings)
    if uses_rollout(settings):
        settings["rollout_logprobs"] = rollout
    got = {}
    for bound in ("1", str(1 << 20)):     # bytes: below one chunk; the longest sequence's 40 x 320 x 4 fit
        monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_MAX_BYTES", bound)
        ran.clear(), cuts.clear(), stats_calls.clear()
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fused_policy_loss(h, w, labels, adv, old, ref_logprobs=ref, temperature=0.9, backend="triton",
                                **settings)
        check(out, h, w, want, valid)
        got[bound] = (out.loss.detach(), h.grad, w.grad)
        if bound == "1":
            assert ran and cuts == [None] and not stats_calls      # the two-pass path
        else:
            assert not ran and len(cuts) == 1 and cuts[0] is not None, (ran, cuts)
            sizes = [b - a for a, b in zip(cuts[0][:-1], cuts[0][1:], strict=True)]
            assert max(sizes) == longest and len(stats_calls) == len(sizes), (sizes, stats_calls)
    (l1, dh1, dw1), (l2, dh2, dw2) = got.values()
    assert abs(l1.item() - l2.item()) <= 1e-6 * max(1.0, abs(l1.item()))
    close_everywhere(dh1[valid], dh2[valid], 1e-5)
    close_everywhere(dw1, dw2, 1e-5)
