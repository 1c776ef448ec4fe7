"""enable(trainer, fused_loss=True): TRL's loss settings mapped onto logitless' fused policy loss.
Settings that cannot be mapped are refused by name; the mapped loss (logitless.losses.fused_policy_loss
on the policy's last hidden states) equals TRL's own _compute_loss on the same batch, value and
gradients, for every mappable loss type."""
import os
import sys

import pytest
import torch

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")
try:                                    # part of logitless itself, not an optional integration
    from logitless import losses
except ImportError as exc:
    pytest.skip(f"logitless.losses is not in this build ({exc})", allow_module_level=True)

import logitless.trl as lt  # noqa: E402
from logitless.trl.loss import policy_inputs  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_tiny  # noqa: E402

TOL = 1e-5
GRAD_TOL = 1e-4


UNMAPPABLE = [("loss_type", "cispo"), ("loss_type", "sapo"), ("loss_type", "vespo"), ("loss_type", "luspo"),
              ("importance_sampling_level", "sequence"), ("top_entropy_quantile", 0.2),
              ("off_policy_mask_threshold", 0.5), ("use_adaptive_entropy", True), ("epsilon_low", 1.0)]


def test_unmappable_settings_are_named(folder, tmp_path):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path))
    for name, value in UNMAPPABLE:
        saved = getattr(trainer, name)
        setattr(trainer, name, value)
        with pytest.raises(ValueError, match=name):
            lt.enable(trainer, fused_loss=True)
        setattr(trainer, name, saved)
        assert not lt.is_enabled(trainer)
    trainer.entropy_coef = 0.01                        # a bonus only matches bnpo's token weights
    with pytest.raises(ValueError, match="entropy_coef"):
        lt.enable(trainer, fused_loss=True)
    trainer.loss_type = "bnpo"
    trainer.args.delta = 1.1                           # < 1 + epsilon_high: not a dual clip
    trainer.beta, trainer.args.use_bias_correction_kl = 0.04, True
    with pytest.raises(ValueError) as err:
        lt.enable(trainer, fused_loss=True)
    assert "delta=1.1" in str(err.value) and "use_bias_correction_kl" in str(err.value)
    assert "entropy_coef" not in str(err.value)


CONFIGS = {
    "grpo-kl-dual_clip": dict(loss_type="grpo", beta=0.04, delta=1.5, temperature=0.7, use_bias_correction_kl=False),
    "bnpo-entropy_bonus": dict(loss_type="bnpo", entropy_coef=0.02, epsilon=0.1),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.02, temperature=1.3, use_bias_correction_kl=False),
    "dapo-clip_high": dict(loss_type="dapo", epsilon_high=0.28),
}


def _perturb(model, gen, scale=0.2):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_mapped_loss_equals_trl(folder, tmp_path, seed, config):
    gen = torch.Generator().manual_seed(seed)
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, num_iterations=2, **CONFIGS[config])
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    # signed advantages whatever the rewards drew: a group whose completions all score the same has
    # advantages 0 and a loss of 0, which would compare nothing
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=gen)
    _perturb(trainer.model, gen)                   # ratios away from 1, some clipped
    model = trainer.model

    model.zero_grad(set_to_none=True)
    loss_trl = GRPOTrainer._compute_loss(trainer, model, inputs)
    loss_trl.backward()
    g_trl = _grads(model)

    p = policy_inputs(trainer, inputs)
    model.zero_grad(set_to_none=True)
    hidden = model.model(input_ids=p.input_ids, attention_mask=p.attention_mask).last_hidden_state
    out = losses.fused_policy_loss(hidden, model.lm_head.weight, p.labels, **p.settings)
    loss = out.loss * p.scale
    loss.backward()
    g = _grads(model)
    print(f"{config}: fused {loss.item():.8f} TRL {loss_trl.item():.8f} clip_fraction {out.clip_fraction.item():.3f}")
    assert loss_trl.abs() > 0
    assert abs(loss.item() - loss_trl.item()) <= TOL
    assert g.keys() == g_trl.keys() and g_trl
    for name, gt in g_trl.items():
        assert float((g[name] - gt).norm() / gt.norm().clamp_min(1e-30)) <= GRAD_TOL, name


def test_enable_fused_loss_trains_and_matches_trl(folder, tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, beta=0.04, num_iterations=2,
                                    use_bias_correction_kl=False)
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=gen)    # never all 0
    _perturb(trainer.model, gen)
    loss_trl = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    lt.enable(trainer, fused_loss=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    assert abs(loss.item() - loss_trl.item()) <= TOL
    trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert [h["step"] for h in steps] == [1, 2, 3]        # num_iterations=2: rewards are logged on steps 1 and 3
    for h in steps:
        assert all(abs(h[key]) < 1e3 for key in ("loss", "entropy", "kl", "clip_ratio/region_mean")), h
    lt.disable(trainer)
    assert "_compute_loss" not in trainer.__dict__
