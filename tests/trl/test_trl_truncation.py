"""``logitless.trl.enable(trainer, truncation=True)`` on a real trl.GRPOTrainer (tiny Qwen2, CPU, float32): the
rollout's own top_k / top_p / min_p read from GRPOConfig; the log-probs and entropies against float64 ground truth
from the model's logits with vLLM's truncation applied (truncation64.py); TRL's vLLM importance-sampling correction
with a float64 vLLM-order sampler standing where TRL's vLLM generation is (TRL's own IS code runs); the fused loss
against TRL's own _compute_loss fed logitless' truncated log-probs; the refusals; the record."""
import os
import sys

import pytest
import torch

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

import logitless.trl as lt  # noqa: E402
from logitless import Truncation  # noqa: E402
from logitless.record import last_path, serial_now  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from truncation64 import row_kept_mask64, truth64  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trl_tiny  # noqa: E402

TOL = 1e-5
GRAD_TOL = 1e-4


def _logits64(model, ids, mask, temperature):
    """float64 logits / temperature of every position, from the backbone's float32 hidden states."""
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return (hidden.double() @ model.lm_head.weight.detach().double().t()) / temperature


def _batch(trainer):
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return inputs, ids, mask, inputs["completion_ids"].size(1)


@pytest.mark.parametrize("config", [dict(top_k=30, top_p=0.9), dict(top_k=40, min_p=0.05),
                                    dict(top_p=1.0, generation_kwargs={"top_p": 0.8})])
def test_logps_and_entropies_equal_float64_truncated(folder, tmp_path, seed, config):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, **config)
    lt.enable(trainer, truncation=True)
    inputs, ids, mask, keep = _batch(trainer)
    since = serial_now()
    with torch.no_grad():
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_entropy=True)
    rec = last_path()
    want = " ".join(f"{k}={v}" for k, v in config.items() if k != "generation_kwargs") if "top_k" in config \
        else "top_p=0.8"
    assert rec.serial > since and (rec.path, rec.entry, rec.truncation) == ("fused", "trl.grpo.logprobs", want), rec
    settings = {k: v for k, v in config.items() if k in ("top_k", "top_p", "min_p")}
    settings.update(config.get("generation_kwargs", {}))
    with torch.no_grad():
        hidden = trainer.model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -keep - 1:-1]
    weight = trainer.model.lm_head.weight.detach()
    scored = inputs["completion_mask"].bool()
    labels = inputs["completion_ids"].masked_fill(~scored, -100)
    t64 = truth64(hidden.double(), weight.double(), labels, temperature=trainer.temperature, **settings)
    lp64, ent64, inside, kept = t64.logprobs, t64.entropy, t64.inside, t64.kept
    sizes = kept[scored].sum(-1)
    print(f"{config}: kept-set sizes {sizes.min().item()}..{sizes.max().item()} of {weight.shape[0]}, "
          f"labels inside {inside[scored].float().mean().item():.3f}")
    assert bool((sizes < weight.shape[0]).all()) and bool(inside[scored].all())   # the rollout's tokens are kept
    assert float((lp.double() - lp64)[scored].abs().max()) <= TOL
    assert float((ent.double() - ent64)[scored].abs().max()) <= TOL
    assert (lp[~scored] == 0).all()
    lt.enable(trainer)                                   # without truncation: the full softmax's log-probs
    with torch.no_grad():
        full, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep)
    assert last_path().truncation is None
    assert float((full - lp)[scored].max()) <= 1e-6 and float((full - lp)[scored].min()) < -1e-3


class StandInSampler:
    """Where TRL's VLLMGeneration sits (``trainer.vllm_generation``): samples each completion token from the
    policy's float64 logits truncated in vLLM's order (temperature, min_p, top_k, top_p) and returns what vLLM's
    processed log-probs are, log q(token) under the truncated distribution; records each token's log kept mass."""

    def __init__(self, trainer, settings, seed):
        self.trainer, self.settings = trainer, settings
        self.gen = torch.Generator().manual_seed(seed)
        self.log_mass = []

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        t = self.trainer
        model, eos = t.model, t.eos_token_id if hasattr(t, "eos_token_id") else 1
        completions, logprobs, masses = [], [], []
        for prompt in prompts:
            ids, lps, mass = list(prompt), [], []
            for _ in range(t.max_completion_length):
                x = torch.tensor([ids])
                z = _logits64(model, x, torch.ones_like(x), t.temperature)[0, -1]
                keep = row_kept_mask64(z, **self.settings)
                zk = z.masked_fill(~keep, float("-inf"))
                logq = zk - torch.logsumexp(zk, dim=-1)
                token = int(torch.multinomial(logq.exp(), 1, generator=self.gen))
                ids.append(token)
                lps.append([float(logq[token])])
                mass.append(float(torch.logsumexp(zk, -1) - torch.logsumexp(z, -1)))
                if token == eos:
                    break
            completions.append(ids[len(prompt):])
            logprobs.append(lps)
            masses.append(mass)
        self.log_mass.extend(masses)
        return prompts, completions, logprobs, None


def _vllm_trainer(folder, tmp_path, seed, settings, **overrides):
    # 8 completions of at most 8 tokens per batch
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, per_device_train_batch_size=8,
                                    **settings, **overrides)
    # TRL's vLLM path without vLLM: its generate() is the stand-in; TRL's own importance-sampling code runs
    trainer.use_vllm, trainer.vllm_mode = True, "colocate"
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max = None, 3.0
    trainer._last_loaded_step = trainer.state.global_step
    sampler_settings = {k: v for k, v in settings.items() if k in ("top_k", "top_p", "min_p")}
    trainer.vllm_generation = StandInSampler(trainer, sampler_settings, seed)
    return trainer


SAMPLERS = {"top_p": dict(top_p=0.9), "top_k-top_p-min_p": dict(top_k=20, top_p=0.95, min_p=0.05)}


@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_importance_ratio_is_one_with_truncation_and_log_mass_without(folder, tmp_path, seed, sampler):
    settings = SAMPLERS[sampler]
    results = {}
    for truncation in (True, False):
        trainer = _vllm_trainer(folder, tmp_path, seed, settings)
        lt.enable(trainer, truncation=truncation)
        inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
        mask = inputs["completion_mask"].bool()
        diff = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"])[mask].double()
        ratio = inputs["importance_sampling_ratio"][mask].double()
        masses = trainer.vllm_generation.log_mass
        log_mass = torch.zeros(mask.shape, dtype=torch.float64)
        for row, m in enumerate(masses):
            log_mass[row, :len(m)] = torch.tensor(m, dtype=torch.float64)
        results[truncation] = (diff, ratio, log_mass[mask])
        print(f"{sampler} truncation={truncation}: {mask.sum().item()} tokens, log-ratio old - sampling "
              f"mean {diff.mean().item():.6f} max|.| {diff.abs().max().item():.2e}; IS ratio mean "
              f"{ratio.mean().item():.6f} min {ratio.min().item():.6f}; mean log S {log_mass[mask].mean().item():.6f}")
    diff, ratio, _ = results[True]
    assert float(diff.abs().max()) < 1e-4 and float((ratio - 1).abs().max()) < 1e-4
    diff, ratio, log_s = results[False]
    assert float((diff - log_s).abs().max()) < 1e-4        # without: the ratio is the kept mass S exactly
    assert float(diff.mean()) < -1e-3 and float(diff.max()) <= 1e-4


def _perturb(model, gen, scale=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _loss_and_grads(trainer, inputs, compute):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("config", [dict(loss_type="grpo", beta=0.04, top_k=30, top_p=0.9, entropy_coef=0.01),
                                    dict(loss_type="dapo", beta=0.0, min_p=0.05, epsilon_high=0.28)])
def test_fused_loss_with_truncation_equals_trl_fed_truncated_logps(folder, tmp_path, seed, config):
    gen = torch.Generator().manual_seed(seed)
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, num_iterations=2, temperature=0.8,
                                    **config)
    lt.enable(trainer, truncation=True)            # old and reference log-probs truncated too
    inputs, _, _, _ = _batch(trainer)
    inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=gen)
    _perturb(trainer.model, gen)
    state = trl_tiny.trainer_state(trainer)
    # TRL's own loss, its log-probs from logitless' truncated method
    loss_trl, g_trl = _loss_and_grads(trainer, inputs, lambda m, i: GRPOTrainer._compute_loss(trainer, m, i))
    for k, v in state.items():
        setattr(trainer, k, v)
    lt.enable(trainer, fused_loss=True, truncation=True)
    since = serial_now()
    loss, g = _loss_and_grads(trainer, inputs, trainer._compute_loss)
    rec = last_path()
    want = " ".join(f"{k}={config[k]}" for k in ("top_k", "top_p", "min_p") if k in config)
    assert rec.serial > since and (rec.path, rec.entry, rec.truncation) == ("fused", "trl.grpo", want), rec
    print(f"{config}: loss fused {loss.item():.8f} TRL {loss_trl.item():.8f} ({rec.truncation})")
    assert loss_trl.abs() > 0 and abs(loss.item() - loss_trl.item()) <= TOL
    assert g.keys() == g_trl.keys() and g_trl
    for name, want in g_trl.items():
        assert float((g[name] - want).norm() / want.norm().clamp_min(1e-30)) <= GRAD_TOL, name
    # the untruncated fused loss is another number: the truncation reached the loss
    lt.enable(trainer, fused_loss=True)
    assert abs(trainer._compute_loss(trainer.model, inputs).item() - loss.item()) > 1e-5


def test_refusals(folder, tmp_path, teacher):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path))
    with pytest.raises(ValueError, match="truncates nothing"):
        lt.enable(trainer, truncation=True)                 # TRL's defaults: top_k 0, top_p 1, min_p None
    with pytest.raises(TypeError, match="True or False"):
        lt.enable(trainer, truncation=Truncation(top_p=0.9))
    with pytest.raises(TypeError, match="truncation"):
        lt.enable(trainer, truncation="top_p")
    assert not lt.is_enabled(trainer)
    cases = [(dict(top_p=0.9, repetition_penalty=1.1), "repetition_penalty"),
             (dict(top_p=0.9, generation_kwargs={"no_repeat_ngram_size": 2}), "no_repeat_ngram_size"),
             (dict(top_p=0.9, min_p=0.05), "min_p"),                      # transformers' order: min_p after top_p
             (dict(top_k=20, generation_kwargs={"temperature": 0.5}), "temperature"),
             (dict(top_p=0.9, generation_kwargs={"repetition_penalty": 1.2}), "repetition_penalty")]
    for config, name in cases:
        trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), **config)
        with pytest.raises(ValueError, match=name):
            lt.enable(trainer, truncation=True)
        assert not lt.is_enabled(trainer)
    # vLLM applies min_p before top_p, as logitless does: accepted there
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), top_p=0.9, min_p=0.05)
    trainer.use_vllm = True
    lt.enable(trainer, truncation=True)
    assert lt.truncation.rollout_truncation_of(trainer) == Truncation(top_p=0.9, min_p=0.05)
    distill = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path))
    with pytest.raises(ValueError, match="truncation"):
        lt.enable(distill, truncation=True)
