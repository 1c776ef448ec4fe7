"""enable(trainer, fused_loss=True): every GRPOTrainer loss setting mapped onto logitless' fused policy loss,
one test per setting on a real trl.GRPOTrainer (tiny Qwen2, CPU, float32): the enabled trainer's
_compute_loss against TRL's own GRPOTrainer._compute_loss on the same batch: the loss within 1e-5, every
parameter gradient within 1e-4 (relative), and every metric TRL logs (same names, values within 1e-5)."""
import copy
import os
import sys
import types

import pytest
import torch

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

import logitless.trl as lt  # noqa: E402
from logitless import losses  # noqa: E402
from logitless.record import serial_now  # noqa: E402
from logitless.trl.loss import policy_inputs  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_tiny  # noqa: E402

TOL = 1e-5
GRAD_TOL = 1e-4
# Under bf16 autocast the decoder's backward runs in bf16: the gradient at the head's input (the final norm's
# float32 output) equals TRL's within HIDDEN_GRAD_TOL, but a 1-ulp float32 difference there flips bf16 roundings
# in the decoder's backward, which moves its weights' gradients by up to about bf16's epsilon (2^-8 = 3.9e-3;
# 3.7e-3 was the largest in 80 random models, and 9 of them exceeded GRAD_TOL). So the decoder's parameters get
# a bf16 bound; the head's gradient and the gradient entering the decoder keep the float32 ones.
HIDDEN_GRAD_TOL = 1e-5
BF16_DECODER_GRAD_TOL = 2.0 ** -6

# GRPOConfig overrides; "_train": model.train() with 2 accumulation steps; "_vllm": TRL's vLLM importance-
# sampling correction with this mode (the trainer's flags set after construction: no vLLM on CPU; the
# batch gets sampling log-probs and TRL's importance_sampling_ratio computed from them as TRL does);
# "_sampling": the batch carries sampling_per_token_logps (the off-policy mask reads them); "_mask": some
# completions masked whole or in part; "_tool": a tool_mask (multi-turn tool outputs, not scored); "_nan":
# a quarter of the sampling log-probs NaN (vLLM could not score them; TRL's nan_to_num)
CONFIGS = {
    "grpo-k3-bias_corrected": dict(loss_type="grpo", beta=0.1),                  # TRL's defaults with a KL
    "grpo-k3-uncorrected-dual_clip": dict(loss_type="grpo", beta=0.04, delta=1.5, temperature=0.7,
                                          use_bias_correction_kl=False),
    "bnpo-two_sided_delta": dict(loss_type="bnpo", delta=1.1, epsilon=0.1),      # delta < 1 + epsilon_high
    "bnpo-entropy_bonus": dict(loss_type="bnpo", entropy_coef=0.02, epsilon=0.1),
    "grpo-entropy_bonus-train": dict(loss_type="grpo", entropy_coef=0.05, beta=0.02, _train=True),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.02, temperature=1.3),
    "dapo-entropy_bonus": dict(loss_type="dapo", epsilon_high=0.28, entropy_coef=0.03),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "gspo-sequence-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05,
                             epsilon=3e-4, epsilon_high=4e-4),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3, beta=0.02),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.2, sapo_temperature_neg=0.9),
    "sapo-sequence": dict(loss_type="sapo", importance_sampling_level="sequence", entropy_coef=0.01),
    "vespo": dict(loss_type="vespo"),
    "vespo-vllm_is": dict(loss_type="vespo", _vllm="token_truncate"),
    "top_entropy_quantile": dict(loss_type="grpo", top_entropy_quantile=0.4, entropy_coef=0.02),
    "adaptive_entropy-train": dict(loss_type="dapo", use_adaptive_entropy=True, entropy_coef=0.01,
                                   entropy_target=100.0, _train=True),
    "off_policy_mask": dict(loss_type="grpo", off_policy_mask_threshold=0.05),
    "off_policy_mask-sampling": dict(loss_type="bnpo", off_policy_mask_threshold=0.05, _sampling=True),
    # NaN sampling log-probs (tokens vLLM could not score): no drift evidence in the mask, IS weight 1
    "off_policy_mask-sampling-nan": dict(loss_type="bnpo", off_policy_mask_threshold=0.05, _sampling=True, _nan=True),
    "vllm_is-sequence_mask-off_policy_mask-nan": dict(loss_type="grpo", off_policy_mask_threshold=0.02,
                                                      _vllm="sequence_mask", _nan=True),
    "vllm_is-token_truncate": dict(loss_type="grpo", _vllm="token_truncate", beta=0.02),
    "vllm_is-token_mask": dict(loss_type="dapo", _vllm="token_mask"),
    "vllm_is-sequence_truncate": dict(loss_type="bnpo", _vllm="sequence_truncate"),
    "vllm_is-sequence_mask": dict(loss_type="dr_grpo", _vllm="sequence_mask"),
    "cast_lm_head_to_fp32": dict(loss_type="grpo", cast_lm_head_to_fp32=True, beta=0.02),
    # bf16 autocast: the backbone in bf16, the head in float32 (TRL's patched head; logitless' head_in_fp32)
    "cast_lm_head_to_fp32-bf16_autocast": dict(loss_type="dapo", cast_lm_head_to_fp32=True, bf16=True, beta=0.02),
    # what mask_truncated_completions and EOS padding do to the batch (the tiny model never emits EOS within
    # 8 tokens, so TRL's generation would mask every completion): whole completions and tails masked
    "masked_completions-grpo": dict(loss_type="grpo", beta=0.02, _mask=True),
    "masked_completions-dapo-sequence": dict(loss_type="dapo", importance_sampling_level="sequence", _mask=True),
    "luspo-token-kl-entropy_mask": dict(loss_type="luspo", beta=0.02, top_entropy_quantile=0.5),
    "dr_grpo-entropy_bonus-train": dict(loss_type="dr_grpo", entropy_coef=0.04, beta=0.01, _train=True),
    "vespo-entropy_bonus-kl": dict(loss_type="vespo", entropy_coef=0.02, beta=0.03),
    "bnpo-sequence-two_sided_delta": dict(loss_type="bnpo", importance_sampling_level="sequence", delta=1.1,
                                          epsilon=0.05),
    "luspo-train-entropy_bonus": dict(loss_type="luspo", entropy_coef=0.03, _train=True),
    "cispo-sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.2),
    "cispo-train-entropy_bonus": dict(loss_type="cispo", epsilon_high=1.3, entropy_coef=0.02, _train=True),
    "sapo-train-kl": dict(loss_type="sapo", beta=0.03, _train=True),
    "vespo-vllm_is-token_mask": dict(loss_type="vespo", _vllm="token_mask"),
    "vespo-vllm_is-sequence_truncate": dict(loss_type="vespo", _vllm="sequence_truncate"),
    "vespo-vllm_is-sequence_mask": dict(loss_type="vespo", _vllm="sequence_mask"),
    "gspo-vllm_is-sequence_mask-off_policy_mask": dict(loss_type="grpo", importance_sampling_level="sequence",
                                                       off_policy_mask_threshold=0.05, _vllm="sequence_mask"),
    # multi-turn tool calls: TRL scores completion_mask * tool_mask
    "tool_mask-bnpo-kl": dict(loss_type="bnpo", beta=0.02, _tool=True),
    "tool_mask-dapo-sequence": dict(loss_type="dapo", importance_sampling_level="sequence", _tool=True),
}


def _perturb(model, gen, scale=0.2):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sampling_logps(inputs, gen, noise=0.3, nan=False):
    """Sampling log-probs around the old ones; nan: a quarter NaN (tokens vLLM could not score)."""
    old = inputs["old_per_token_logps"]
    sampling = (old + noise * torch.randn(old.shape, generator=gen)).clamp(max=0.0)
    if nan:
        sampling[torch.rand(old.shape, generator=gen) < 0.25] = float("nan")
    return sampling


def _vllm_batch(trainer, inputs, mode, gen, nan=False):
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions' formula) from
    sampling log-probs drawn around the old ones."""
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_importance_sampling_mode = mode
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = 0.6, 1.8
    sampling = _sampling_logps(inputs, gen, 0.2 if mode.startswith("token") else 0.05, nan)
    mask = inputs["completion_mask"]
    diff = torch.nan_to_num((inputs["old_per_token_logps"] - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = ratio.clamp(min=0.6, max=1.8)
    else:
        ratio = ratio.masked_fill((ratio < 0.6) | (ratio > 1.8), 0.0)
    inputs["sampling_per_token_logps"] = sampling
    inputs["importance_sampling_ratio"] = ratio


def _run(trainer, inputs, compute, hidden_grads=None):
    """One loss call and its backward: (loss, parameter gradients, logged metrics); hidden_grads, if a list,
    receives the gradient at the final norm's output (the head's input) of each forward."""
    model = trainer.model
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer._metrics["eval"].clear()

    def tap(module, args, out):
        if hidden_grads is not None and out.requires_grad:
            out.register_hook(lambda g: hidden_grads.append(g.detach().clone()))

    handle = model.model.norm.register_forward_hook(tap)
    try:
        loss = compute(model, inputs)
        loss.backward()
    finally:
        handle.remove()
    metrics = {mode: {k: list(v) for k, v in trainer._metrics[mode].items()} for mode in ("train", "eval")}
    return loss.detach(), _grads(model), metrics


def _setup(folder, tmp_path, seed, config):
    config = dict(config)
    train, vllm, sampling = config.pop("_train", False), config.pop("_vllm", None), config.pop("_sampling", False)
    masked, tool, nan = config.pop("_mask", False), config.pop("_tool", False), config.pop("_nan", False)
    gen = torch.Generator().manual_seed(seed)
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, num_iterations=2, **config)
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    # signed advantages whatever the rewards drew: a group whose completions all score the same has
    # advantages 0 and a loss of 0, which would compare nothing
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=gen)
    if vllm is not None:
        _vllm_batch(trainer, inputs, vllm, gen, nan)
    if sampling:
        inputs["sampling_per_token_logps"] = _sampling_logps(inputs, gen, nan=nan)
    if masked:
        mask = inputs["completion_mask"].clone()
        mask[0] = 0                                  # a truncated completion, masked whole
        mask[1, 5:] = 0                              # a completion that ended early: its padding
        mask[3, 2:] = 0
        inputs["completion_mask"] = mask
    if tool:
        tool_mask = torch.ones_like(inputs["completion_mask"])
        tool_mask[:, 2:4] = 0                        # a tool's output inside each completion
        tool_mask[3, 1:] = 0
        inputs["tool_mask"] = tool_mask
    _perturb(trainer.model, gen)                   # ratios away from 1, some clipped
    if train:
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2
    else:
        trainer.model.eval()
    return trainer, inputs


def _assert_matches_trl(trainer, inputs, label):
    """TRL's own _compute_loss, then the enabled trainer's (fused) on the same batch and trainer state: the
    loss within 1e-5 (relative beyond 1), every parameter gradient within 1e-4 (relative), every metric
    with the same name and value, the adaptive-entropy state. Returns the fused (loss, gradients)."""
    state = trl_tiny.trainer_state(trainer)
    h_trl, h = [], []
    loss_trl, g_trl, m_trl = _run(trainer, inputs, lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), h_trl)
    state_trl = trl_tiny.trainer_state(trainer)
    for k, v in state.items():
        setattr(trainer, k, v)
    lt.enable(trainer, fused_loss=True)
    loss, g, m = _run(trainer, inputs, trainer._compute_loss, h)
    print(f"{label}: fused {loss.item():.8g} TRL {loss_trl.item():.8g}; metrics {m_trl}")
    assert loss_trl.abs() > 0
    assert abs(loss.item() - loss_trl.item()) <= TOL * max(1.0, abs(loss_trl.item()))
    assert len(h) == len(h_trl) == 1
    # an all-zero hidden gradient (seen once in CI: both 0, the test then divided 0 by 0) must be matched exactly
    assert float((h[0].double() - h_trl[0].double()).norm() / h_trl[0].double().norm().clamp_min(1e-30)) \
        <= HIDDEN_GRAD_TOL
    _assert_grads_close(g, g_trl, BF16_DECODER_GRAD_TOL if trainer.args.bf16 else GRAD_TOL)
    for mode in ("train", "eval"):
        assert m[mode].keys() == m_trl[mode].keys(), mode
        for key, want in m_trl[mode].items():
            assert len(m[mode][key]) == len(want), key
            for got_v, want_v in zip(m[mode][key], want, strict=True):
                assert abs(got_v - want_v) <= TOL * max(1.0, abs(want_v)), (key, got_v, want_v)
    assert trl_tiny.trainer_state(trainer).keys() == state_trl.keys()
    assert trainer.entropy_coef == state_trl["entropy_coef"]
    lt.disable(trainer)
    return loss, g


def _assert_grads_close(g, want, decoder_tol=GRAD_TOL):
    """Every parameter's gradient within GRAD_TOL (relative); the decoder's (all but the head and the final
    norm) within decoder_tol."""
    assert g.keys() == want.keys() and want
    for name, gt in want.items():
        tol = GRAD_TOL if name.startswith(("lm_head.", "model.norm.")) else decoder_tol
        assert float((g[name].double() - gt.double()).norm() / gt.double().norm().clamp_min(1e-30)) <= tol, name


@pytest.mark.parametrize("config", list(CONFIGS))
def test_enabled_loss_gradients_and_metrics_equal_trl(folder, tmp_path, seed, config):
    trainer, inputs = _setup(folder, tmp_path, seed, CONFIGS[config])
    _assert_matches_trl(trainer, inputs, config)


# the policy far from the old one (lp - old > 20 at some tokens): TRL's ratio is exp(lp - old), unclamped
DRIFT_CONFIGS = {
    "grpo": dict(loss_type="grpo"),
    "bnpo-bias_corrected_kl": dict(loss_type="bnpo", beta=0.02),
    "gspo-sequence": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "dapo-train": dict(loss_type="dapo", _train=True),
}


def _drift(trainer, inputs, gen):
    """Old log-probs 20.5-21.5 below the policy's (TRL's own log-probs) at every token of row 1 (its sequence
    mean too) and the first 3 of row 2. Row 1's advantage is -3e-9, so that its unclipped terms (-A exp(lp -
    old), about 4 each) weigh like the other rows' (with TRL's k3 times the ratio, the bias-corrected KL, they
    dominate); row 2's is positive: the clip binds at a ratio of e^21."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        lp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask,
                                                                  inputs["completion_ids"].size(1))
    old = inputs["old_per_token_logps"].clone()
    far = torch.zeros_like(old, dtype=torch.bool)
    far[1] = True
    far[2, :3] = True
    old[far] = lp[far] - 20.5 - torch.rand(int(far.sum()), generator=gen)
    inputs["old_per_token_logps"] = old
    inputs["advantages"][1] = -3e-9
    inputs["advantages"][2] = inputs["advantages"][2].abs() + 0.1
    assert inputs["completion_mask"][1].sum() > 0 and inputs["completion_mask"][2, :3].all()


def _float64_trl(trainer, inputs):
    """TRL's own _compute_loss in float64 throughout: (loss, gradients), float64. A float64 copy of the model and
    batch, and the log-probs (and entropies) from its float64 logits: TRL's fused head keeps float32 statistics
    and float32 backward GEMMs whatever the model's dtype, so TRL's call on a float64 model alone would be a
    float32 evaluation from the log-probs on."""
    model = copy.deepcopy(trainer.model).double()
    inputs64 = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}

    def logps64(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                **_):
        hidden = model.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = model.lm_head(hidden[:, -logits_to_keep - 1:-1]) / self.temperature
        assert logits.dtype == torch.float64
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, input_ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1)
        return lp, (-(logp.exp() * logp).sum(-1) if compute_entropy else None), None

    state = trl_tiny.trainer_state(trainer)
    trainer._get_per_token_logps_and_entropies = types.MethodType(logps64, trainer)
    try:
        loss = GRPOTrainer._compute_loss(trainer, model, inputs64)
        loss.backward()
    finally:
        del trainer._get_per_token_logps_and_entropies
        for k, v in state.items():
            setattr(trainer, k, v)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", list(DRIFT_CONFIGS))
def test_policy_far_from_the_old_one_equals_trl(folder, tmp_path, seed, config):
    """lp - old beyond 20 (verl's clamp, which the TRL mapping does not apply): loss, gradients and metrics
    equal TRL's own, and loss and gradients equal TRL's formula evaluated in float64; logitless' clamped
    ratio (ratio_log_clamp=20) would not."""
    gen = torch.Generator().manual_seed(seed + 1)
    trainer, inputs = _setup(folder, tmp_path, seed, DRIFT_CONFIGS[config])
    _drift(trainer, inputs, gen)
    loss, g = _assert_matches_trl(trainer, inputs, config)
    loss64, g64 = _float64_trl(trainer, inputs)
    print(f"{config}: float64 TRL {loss64.item():.10g}")
    assert abs(loss.item() - loss64.item()) <= TOL * max(1.0, abs(loss64.item()))
    _assert_grads_close(g, g64)
    p = policy_inputs(trainer, inputs)
    assert p.settings["ratio_log_clamp"] is None
    model = trainer.model
    hidden = model.model(input_ids=p.input_ids, attention_mask=p.attention_mask).last_hidden_state
    clamped = losses.fused_policy_loss(hidden, model.lm_head.weight, p.labels, **dict(p.settings, ratio_log_clamp=20.0))
    assert abs(clamped.loss.item() * p.scale - loss64.item()) > 1e-3 * max(1.0, abs(loss64.item()))


# TRL's on-policy batch (old_per_token_logps None: TRL takes the current log-probs, detached): the ratio is 1, so
# the mapped settings that act on it (epsilons, delta, vespo's) are dropped, as PolicyLoss refuses them there; CISPO's
# bound below 1 (epsilon_high 0.2, TRL's default) still binds
ON_POLICY_CONFIGS = {
    "grpo-clip_higher-delta": dict(loss_type="grpo", epsilon_high=0.28, delta=1.5),
    "dapo-kl": dict(loss_type="dapo", beta=0.02),
    "cispo-default_bound": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "vespo": dict(loss_type="vespo", vespo_k_pos=1.5),
}


@pytest.mark.parametrize("config", list(ON_POLICY_CONFIGS))
def test_on_policy_batch_equals_trl(folder, tmp_path, seed, config):
    trainer, inputs = _setup(folder, tmp_path, seed, ON_POLICY_CONFIGS[config])
    inputs["old_per_token_logps"] = None
    _assert_matches_trl(trainer, inputs, config)


# CISPO's bound below 1: TRL's epsilon_high defaults to epsilon (0.2), and TRL clamps the ratio at it
CISPO_LOW_BOUND_CONFIGS = {
    "default_bound-kl": dict(loss_type="cispo", beta=0.02),
    "bound_0.5-sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon=0.5),
    "bound_0.5-train-entropy_bonus": dict(loss_type="cispo", epsilon=0.3, epsilon_high=0.5, entropy_coef=0.02,
                                          _train=True),
}


@pytest.mark.parametrize("config", list(CISPO_LOW_BOUND_CONFIGS))
def test_cispo_with_a_bound_below_one_equals_trl(folder, tmp_path, seed, config):
    """TRL's cispo weight min(ratio, epsilon_high), detached, with epsilon_high < 1: old log-probs moved so that
    the ratios of a random half of the tokens spread over (0.05, 1) (at sequence level: every token of the
    even sequences, by 1.5-3 nats), on both sides of the bound."""
    gen = torch.Generator().manual_seed(seed + 2)
    trainer, inputs = _setup(folder, tmp_path, seed, CISPO_LOW_BOUND_CONFIGS[config])
    assert trainer.epsilon_high < 1.0
    old = inputs["old_per_token_logps"].clone()
    if trainer.importance_sampling_level == "sequence":
        low = torch.zeros(old.shape, dtype=torch.bool)
        low[0::2] = True
        old[low] += torch.empty(int(low.sum())).uniform_(1.5, 3.0, generator=gen)
    else:
        low = torch.rand(old.shape, generator=gen) < 0.5
        old[low] += torch.empty(int(low.sum())).uniform_(0.0, 3.0, generator=gen)     # ratio below exp(-d)
    inputs["old_per_token_logps"] = old
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        lp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask,
                                                                  inputs["completion_ids"].size(1))
    log_ratio = lp - old
    if trainer.importance_sampling_level == "sequence":
        log_ratio = log_ratio.mean(-1)
    below = log_ratio.exp() < trainer.epsilon_high
    assert below.any() and not below.all()          # the clamp binds at some ratios, not at others
    _assert_matches_trl(trainer, inputs, config)


# dapo with beta=0.1 and TRL's bias-corrected KL (its default), the policy far from the reference
FAR_FROM_REF = {
    # the EOS logit boosted after the rollout: every other token's log-prob falls 10-25 nats below the
    # reference's (exp(ref - lp) up to about 1e10); on-policy (old = lp, detached), or the rollout's old
    # log-probs (lp - old as far below 0)
    "eos_boosted-on_policy": dict(boost=12.0, on_policy=True),
    "eos_boosted-rollout_old": dict(boost=12.0, on_policy=False),
    # the reference 15-20 nats below the policy at half the tokens, and 8-12 nats above it at a quarter
    "ref_shifted-on_policy": dict(ref_shift=True, on_policy=True),
    "ref_shifted-rollout_old": dict(ref_shift=True, on_policy=False),
}


def _worst(g, want):
    return max(float((g[n].double() - want[n]).norm() / want[n].norm().clamp_min(1e-300)) for n in want)


@pytest.mark.parametrize("case", list(FAR_FROM_REF))
def test_far_from_the_reference_no_further_from_float64_than_trl(folder, tmp_path, seed, case):
    """The fused loss's parameter gradients are no further from TRL's loss evaluated in float64 (float64 logits)
    than TRL's own float32 gradients on the same batch (worst parameter, relative; below GRAD_TOL both are at
    float32's resolution); the loss within 1e-5. TRL's bias-corrected k3 loses its gradient in float32 there:
    (lp - ref) r is the difference of two parts of size exp(ref - lp) r (``policy_terms.kl_times_ratio``)."""
    spec = FAR_FROM_REF[case]
    gen = torch.Generator().manual_seed(seed + 3)
    trainer, inputs = _setup(folder, tmp_path, seed, dict(loss_type="dapo", beta=0.1))
    assert trainer.args.use_bias_correction_kl
    if spec["on_policy"]:
        inputs["old_per_token_logps"] = None
    if "boost" in spec:
        with torch.no_grad():
            w = trainer.model.lm_head.weight
            w[1] += spec["boost"] * w.std() * torch.sign(w[1])          # <eos> is token 1
    else:
        ref = inputs["ref_per_token_logps"].clone()
        u = torch.rand(ref.shape, generator=gen)
        # still log-probs (<= 0: above 0 they are refused)
        ref = torch.where(u < 0.5, ref - 15.0 - 5.0 * u, torch.where(u < 0.75, ref + 8.0 + 4.0 * u, ref)).clamp(max=0.0)
        inputs["ref_per_token_logps"] = ref
    state = trl_tiny.trainer_state(trainer)
    loss_trl, g_trl, _ = _run(trainer, inputs, lambda m, i: GRPOTrainer._compute_loss(trainer, m, i))
    for k, v in state.items():
        setattr(trainer, k, v)
    loss64, g64 = _float64_trl(trainer, inputs)
    lt.enable(trainer, fused_loss=True)
    loss, g, _ = _run(trainer, inputs, trainer._compute_loss)
    lt.disable(trainer)
    err, err_trl = _worst(g, g64), _worst(g_trl, g64)
    print(f"{case}: loss fused {loss.item():.8g} TRL {loss_trl.item():.8g} float64 {loss64.item():.8g}; "
          f"worst parameter gradient from float64: fused {err:.2e}, TRL float32 {err_trl:.2e}")
    assert abs(loss.item() - loss64.item()) <= TOL * max(1.0, abs(loss64.item()))
    assert err <= max(err_trl, GRAD_TOL)


def test_the_metrics_of_an_entropy_bonus_are_logged(folder, tmp_path, seed):
    """TRL logs policy_loss and entropy_coef with an entropy bonus (train mode, at an optimizer step)."""
    trainer, inputs = _setup(folder, tmp_path, seed, CONFIGS["grpo-entropy_bonus-train"])
    lt.enable(trainer, fused_loss=True)
    _, _, m = _run(trainer, inputs, trainer._compute_loss)
    assert {"policy_loss", "entropy_coef", "entropy", "kl", "clip_ratio/region_mean"} <= m["train"].keys()


def test_low_level_mapping_equals_trl(folder, tmp_path, seed):
    """policy_inputs' settings given to logitless.losses.fused_policy_loss on the policy's hidden states."""
    trainer, inputs = _setup(folder, tmp_path, seed, CONFIGS["grpo-k3-bias_corrected"])
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss_trl = GRPOTrainer._compute_loss(trainer, model, inputs)
    p = policy_inputs(trainer, inputs)
    hidden = model.model(input_ids=p.input_ids, attention_mask=p.attention_mask).last_hidden_state
    out = losses.fused_policy_loss(hidden, model.lm_head.weight, p.labels, **p.settings)
    assert abs((out.loss * p.scale).item() - loss_trl.item()) <= TOL


def test_unmappable_settings_are_named(folder, tmp_path):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path))
    trainer.loss_type = "made_up"
    with pytest.raises(ValueError, match="loss_type='made_up'"):
        lt.enable(trainer, fused_loss=True)
    assert not lt.is_enabled(trainer)
    trainer.loss_type, trainer.epsilon_high = "cispo", -0.1                # a negative weight bound
    with pytest.raises(ValueError, match="epsilon_high=-0.1"):
        lt.enable(trainer, fused_loss=True)
    trainer.loss_type, trainer.epsilon_high = "sapo", 0.28
    trainer.args.sapo_temperature_neg = -1.0
    with pytest.raises(ValueError, match="sapo_tau_neg"):                # checked at enable(), not the first step
        lt.enable(trainer, fused_loss=True)
    trainer.loss_type = "grpo"
    trainer.aux_loss_enabled = True
    with pytest.raises(ValueError, match="aux_loss_enabled"):
        lt.enable(trainer, fused_loss=True)
    trainer.aux_loss_enabled = False
    trainer.epsilon_low = 1.5                                            # TRL's epsilon is clip_low, in [0, 1]
    with pytest.raises(ValueError, match="epsilon_low=1.5"):
        lt.enable(trainer, fused_loss=True)
    assert not lt.is_enabled(trainer)


def test_a_head_logitless_cannot_compute_is_refused_at_enable(folder, tmp_path):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path))
    head = trainer.model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    with pytest.raises(ValueError, match="trainer.model .*bias"):
        lt.enable(trainer, fused_loss=True)
    assert not lt.is_enabled(trainer)


def test_enable_fused_loss_trains_and_matches_trl(folder, tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, beta=0.04, num_iterations=2,
                                    entropy_coef=0.01)
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=gen)    # never all 0
    _perturb(trainer.model, gen)
    loss_trl = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
    lt.enable(trainer, fused_loss=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    assert abs(loss.item() - loss_trl.item()) <= TOL
    since = serial_now()
    trainer.train()
    trl_tiny.assert_step_record(since, "trl.grpo")
    steps = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert [h["step"] for h in steps] == [1, 2, 3]        # num_iterations=2: rewards are logged on steps 1 and 3
    for h in steps:
        assert all(abs(h[key]) < 1e3 for key in ("loss", "entropy", "kl", "clip_ratio/region_mean", "policy_loss",
                                                  "entropy_coef")), h
    lt.disable(trainer)
    assert "_compute_loss" not in trainer.__dict__
