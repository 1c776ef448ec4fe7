"""One rule for every PolicyLoss setting: given a value other than its default where the chosen loss does not
read it, it is a ValueError naming the setting and the choice that leaves it without effect; under a choice
that reads it, it runs and changes the loss."""
from __future__ import annotations

import pytest
import torch

from logitless.losses import PolicyLoss, fused_policy_loss

V, N, H = 4099, 7, 96


def inputs():
    hidden = torch.randn(2, N, H)
    weight = torch.randn(V, H) * 0.05
    labels = torch.randint(0, V, (2, N))
    adv = torch.randn(2, N)
    old = -torch.rand(2, N) * 3 - 7
    return hidden, weight, labels, adv, old


# (setting, value, the rest of the call, what the message names)
IDLE = [
    ("sapo_tau_pos", 2.0, {}, "surrogate='ppo'"),
    ("sapo_tau_neg", 2.0, {"surrogate": "cispo"}, "surrogate='cispo'"),
    ("dro_beta", 0.1, {}, "surrogate='ppo'"),
    ("cov_ratio", 0.5, {}, "surrogate='ppo'"),
    ("clip_cov_lb", 0.5, {"surrogate": "kl_cov"}, "surrogate='kl_cov'"),
    ("kl_cov_coef", 2.0, {"surrogate": "clip_cov"}, "surrogate='clip_cov'"),
    ("vespo_k_pos", 1.0, {}, "surrogate='ppo'"),
    ("vespo_lambda_neg", 1.0, {"surrogate": "sapo"}, "surrogate='sapo'"),
    ("clip_high", 0.4, {"surrogate": "sapo"}, "surrogate='sapo'"),
    ("clip_low", 0.1, {"surrogate": "gpg"}, "surrogate='gpg'"),
    ("ratio_log_clamp", None, {"surrogate": "gpg"}, "surrogate='gpg'"),
    ("ratio_log_clamp", 5.0, {"ratio_level": "sequence-token"}, "ratio_level='sequence-token'"),
    ("ratio_level", "sequence", {"surrogate": "dro", "dro_beta": 0.1}, "surrogate='dro'"),
    ("kl_type", "k1", {}, "ref_logprobs"),
    ("kl_ratio", True, {}, "ref_logprobs"),
    ("entropy_agg", "token-sum", {}, "entropy_coef=0"),
    ("entropy_quantile_group", "default", {}, "entropy_quantile=1"),
    ("rollout_is_max", 2.0, {}, "rollout_is"),
    ("rollout_is_min", 0.5, {}, "rollout_is"),
    ("rollout_is_batch_normalize", True, {}, "rollout_is"),
    ("rollout_nan_is_missing", True, {}, "rollout_logprobs"),
    ("current_is_max", 2.0, {}, "current_is"),
    ("off_policy_threshold", 0.1, {"no_old": True}, "old_logprobs or rollout_logprobs"),
    # on-policy (old_logprobs=None) the ratio is 1 in value: no clip, cap, log-ratio penalty or weight binds
    ("clip_high", 0.4, {"no_old": True}, "without old_logprobs (on-policy"),
    ("clip_low", 0.1, {"surrogate": "dppo_tv", "no_old": True}, "without old_logprobs (on-policy"),
    ("dual_clip", 3.0, {"no_old": True}, "without old_logprobs (on-policy"),
    ("delta", 2.0, {"no_old": True}, "without old_logprobs (on-policy"),
    ("ratio_log_clamp", None, {"no_old": True}, "without old_logprobs (on-policy"),
    ("dro_beta", 0.1, {"surrogate": "dro", "no_old": True}, "without old_logprobs (on-policy"),
    ("vespo_lambda_pos", 1.0, {"surrogate": "vespo", "no_old": True}, "without old_logprobs (on-policy"),
    ("kl_cov_coef", 2.0, {"surrogate": "kl_cov", "no_old": True}, "without old_logprobs (on-policy"),
    ("cov_ratio", 0.5, {"surrogate": "kl_cov", "no_old": True}, "without old_logprobs (on-policy"),
    # geo_mean is a mean over sequences: loss_agg weighs only a KL term (or metric) and an entropy bonus
    ("loss_agg", "seq-mean-token-sum", {"surrogate": "geo_mean"}, "surrogate='geo_mean'"),
    ("loss_agg", "token-sum", {"surrogate": "geo_mean", "entropy_coef": 0.1, "entropy_agg": "token-mean"},
     "surrogate='geo_mean'"),
    # an input that nothing under the chosen loss reads: the rollout's log-probs without a term that compares
    ("rollout_logprobs", -torch.rand(2, N) - 1.0, {}, "without rollout_is, off_policy_threshold, current_is"),
    ("rollout_logprobs", -torch.rand(2, N) - 1.0, {"surrogate": "sapo", "ref_logprobs": -torch.rand(2, N) - 1.0,
                                                   "kl_coef": 0.1}, "rejection_* bound"),
]


@pytest.mark.parametrize("name, value, rest, names", IDLE, ids=[f"{c[0]}-{c[3]}" for c in IDLE])
def test_a_setting_without_effect_is_an_error(name, value, rest, names):
    hidden, weight, labels, adv, old = inputs()
    rest = dict(rest)
    if rest.pop("no_old", False):
        old = None
    with pytest.raises(ValueError, match=name) as err:
        fused_policy_loss(hidden, weight, labels, adv, old, **rest, **{name: value})
    assert names in str(err.value)
    with pytest.raises(ValueError, match=name):     # the dataclass itself, the integrations' entry
        PolicyLoss(advantages=adv, old_logprobs=old, **rest, **{name: value})


# the same settings where their loss reads them: accepted, and the loss moves
READ = [
    ("sapo_tau_pos", 2.0, {"surrogate": "sapo"}),
    ("cov_ratio", 0.5, {"surrogate": "kl_cov"}),
    ("vespo_k_pos", 1.0, {"surrogate": "vespo"}),
    ("clip_high", 0.01, {}),
    ("ratio_log_clamp", 0.01, {}),
    ("entropy_agg", "token-sum", {"entropy_coef": 0.1}),
    ("rollout_is_max", 1.05, {"rollout_is": "token_mask", "rollout": True}),
    ("rollout_logprobs", "rollout", {"rejection_ratio_min": 0.5, "rejection_ratio_max": 2.0}),
    ("loss_agg", "token-sum", {"surrogate": "geo_mean", "entropy_coef": 0.1}),
    ("rollout_logprobs", "rollout", {"current_is": "token_mask", "current_is_min": 0.5, "current_is_max": 2.0}),
]


def _moves(name, value, rest) -> tuple[float, float]:
    """(|loss with the setting - loss without|, |loss without|) on one fresh draw."""
    hidden, weight, labels, adv, old = inputs()
    rest = dict(rest)
    if rest.pop("rollout", False):
        rest["rollout_logprobs"] = old + 0.3 * torch.randn_like(old)
    with torch.no_grad():
        lp = fused_policy_loss(hidden, weight, labels, adv).logprobs
    old = (lp + 0.5 * torch.randn_like(lp)).clamp(max=0.0)     # ratios away from 1, so clips and caps bind
    if isinstance(value, str) and value == "rollout":     # the rollout's log-probs, 1.5 nats below old's: the
        value = old - 1.5                                   # rejection / weights of this pass against them differ
    base = fused_policy_loss(hidden, weight, labels, adv, old, **rest)
    given = fused_policy_loss(hidden, weight, labels, adv, old, **rest, **{name: value})
    return abs(float(base.loss) - float(given.loss)), abs(float(base.loss))


@pytest.mark.parametrize("name, value, rest", READ, ids=[c[0] for c in READ])
def test_the_same_setting_where_it_is_read_changes_the_loss(name, value, rest):
    # a setting read by the loss moves it, relative to the loss (an unread one gives the same bits). On a draw of 14
    # tokens a setting may bind on none (clip_high 0.01: about 3 draws in 100 put no ratio where it cuts) or move
    # the loss only a little (VESPO's k_pos: 7e-7 of a loss of 6e-3): it must move it on one of three draws
    moves = [_moves(name, value, rest) for _ in range(3)]
    assert any(diff > 1e-5 * loss for diff, loss in moves), (name, moves)


def test_a_name_that_belongs_elsewhere_says_where():
    hidden, weight, labels, adv, old = inputs()
    with pytest.raises(TypeError, match="softcap") as err:
        fused_policy_loss(hidden, weight, labels, adv, old, softcap=30.0)
    assert "policy_loss(PolicyLoss(...), hidden, weight, labels, softcap=...)" in str(err.value)
    with pytest.raises(TypeError, match="did you mean 'entropy_coef'"):
        fused_policy_loss(hidden, weight, labels, adv, old, entropy_coeff=0.1)


def test_softcap_goes_to_policy_loss_and_runs():
    """Where the message points: the softcapped head's loss, which differs from the uncapped one."""
    from logitless.losses import policy_loss
    hidden, weight, labels, adv, old = inputs()
    policy = PolicyLoss(advantages=adv, old_logprobs=old)
    capped = policy_loss(policy, hidden * 20, weight, labels, softcap=5.0)
    plain = policy_loss(policy, hidden * 20, weight, labels)
    assert torch.isfinite(capped.loss) and abs(float(capped.loss) - float(plain.loss)) > 1e-4


def test_loss_agg_error_points_at_sequence_ratios():
    hidden, weight, labels, adv, old = inputs()
    with pytest.raises(ValueError, match="loss_agg must be one of") as err:
        fused_policy_loss(hidden, weight, labels, adv, old, loss_agg="seq-mean")
    assert "cannot be fused" not in str(err.value) and "ratio_level='sequence'" in str(err.value)


@pytest.mark.parametrize("name, value, rest", [
    # CISPO's bound 1 + clip_high below ratio 1 binds
    ("clip_high", -0.8, {"surrogate": "cispo", "clip_low": 1.0, "clip_high": -0.5}),
    ("clip_cov_lb", -5.0, {"surrogate": "clip_cov"}),     # clip_cov's selected tokens carry no term
    ("sapo_tau_pos", 3.0, {"surrogate": "sapo"}),         # SAPO's value at ratio 1 is 4 / tau times the gate's
    ("ratio_level", "sequence", {}),                      # the gradient through the sequence's mean ratio
])
def test_on_policy_settings_that_still_act_run_and_move_the_loss(name, value, rest):
    """Without old_logprobs the ratio is 1, yet these settings still act: accepted, and the loss moves."""
    hidden, weight, labels, adv, _ = inputs()
    torch.manual_seed(0)
    h = hidden.clone().requires_grad_(True)
    base = fused_policy_loss(h, weight, labels, adv, **rest)
    base.loss.backward()
    torch.manual_seed(0)
    h2 = hidden.clone().requires_grad_(True)
    given = fused_policy_loss(h2, weight, labels, adv, **{**rest, name: value})
    given.loss.backward()
    moved = abs(float(base.loss) - float(given.loss)) + float((h.grad - h2.grad).abs().max())
    assert moved > 1e-6, (name, float(base.loss))
