"""logitless.trl on a real trl.GRPOTrainer (tiny Qwen2 from a config, in-memory dataset, rule-based
reward, CPU, float32): three training steps with logitless enabled, and on one batch the per-token
log-probs, entropies, the loss and its gradients against TRL's own computation."""
import os
import re
import subprocess
import sys

import pytest
import torch

import logitless
from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

import logitless.trl as lt  # noqa: E402
from logitless import last_backend  # noqa: E402
from logitless.record import serial_now  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import trl_tiny  # noqa: E402

TOL = 1e-5
GRAD_TOL = 1e-4


def _count_trl_fused_head(model, counter):
    """Count calls of TRL's own fused LM head (its instance forward with fused_lm_head=True)."""
    trl_forward = model.__dict__["forward"]

    def forward(*args, **kwargs):
        if kwargs.get("fused_lm_head"):
            counter["trl"] += 1
        return trl_forward(*args, **kwargs)

    model.__dict__["forward"] = forward


def test_three_grpo_steps_with_logitless(folder, tmp_path):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), beta=0.04, max_steps=3)
    lt.enable(trainer)
    counter = {"trl": 0, "logitless": 0}
    _count_trl_fused_head(trainer.model, counter)
    _count_trl_fused_head(trainer.ref_model, counter)
    ours = trainer.__dict__["_get_per_token_logps_and_entropies"]

    def counted(*args, **kwargs):
        counter["logitless"] += 1
        return ours(*args, **kwargs)

    trainer.__dict__["_get_per_token_logps_and_entropies"] = counted
    since = serial_now()
    trainer.train()
    trl_tiny.assert_step_record(since, "trl.grpo.logprobs")
    steps = [h for h in trainer.state.log_history if "loss" in h and "reward" in h]
    for h in steps:
        print(f"step {h['step']}: loss={h['loss']:.6f} reward={h['reward']:.4f} entropy={h['entropy']:.4f}")
    assert [h["step"] for h in steps] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor([h["loss"], h["reward"], h["entropy"]])).all() for h in steps)
    assert counter["trl"] == 0 and counter["logitless"] >= 6      # policy + reference every step, no TRL head
    assert last_backend() in ("chunked", "triton")


def _perturb(model, gen, scale=0.05):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=gen))


def _loss_and_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


CONFIGS = {
    "grpo-kl-entropy_mask-bonus": dict(loss_type="grpo", beta=0.04, top_entropy_quantile=0.5, entropy_coef=0.01,
                                        temperature=0.7, num_iterations=2),
    "dapo-clip_high": dict(loss_type="dapo", beta=0.0, epsilon_high=0.28, temperature=1.2, num_iterations=2),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_logps_and_loss_equal_trl(folder, tmp_path, seed, config):
    gen = torch.Generator().manual_seed(seed)
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, **CONFIGS[config])
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)       # TRL's own rollout, old and ref log-probs
    assert "old_per_token_logps" in inputs
    if not bool(inputs["advantages"].any()):
        # a tiny model's completions can all earn their group's reward: advantages 0 and TRL's loss 0 whatever the
        # log-probs (one CI draw), which would compare nothing: advantages of the rollout's shape instead
        inputs["advantages"] = torch.randn(inputs["advantages"].shape, generator=gen)
    _perturb(trainer.model, gen)                                   # as after an optimizer step: ratios != 1
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    keep = inputs["completion_ids"].size(1)

    with torch.no_grad():
        lp_trl, ent_trl, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep,
                                                                       compute_entropy=True)
        lt.enable(trainer)
        lp, ent, aux = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_entropy=True)
        lp_chunks = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, batch_size=3)[0]
    assert aux is None and lp.dtype == lp_trl.dtype == torch.float32 and lp.shape == lp_trl.shape
    scored = inputs["completion_mask"].bool()
    assert lp[scored].abs().sum() > 0 and (lp[~scored] == 0).all() and (lp_trl[~scored] == 0).all()
    assert float((lp - lp_trl).abs().max()) <= TOL
    assert float((ent - ent_trl).abs().max()) <= TOL
    assert float((lp_chunks - lp).abs().max()) <= TOL             # TRL's micro-batching (batch_size) honoured

    loss, grads = _loss_and_grads(trainer, inputs)
    lt.disable(trainer)
    loss_trl, grads_trl = _loss_and_grads(trainer, inputs)
    print(f"{config}: loss logitless {loss.item():.8f} TRL {loss_trl.item():.8f}")
    assert loss_trl.abs() > 0
    assert abs(loss.item() - loss_trl.item()) <= TOL
    assert grads.keys() == grads_trl.keys() and grads_trl
    for name, g in grads_trl.items():
        assert float((grads[name] - g).norm() / g.norm().clamp_min(1e-30)) <= GRAD_TOL, name


def test_per_instance_and_disable_restores(folder, tmp_path):
    a = trl_tiny.grpo_trainer(folder, str(tmp_path / "a"))
    b = trl_tiny.grpo_trainer(folder, str(tmp_path / "b"))
    cls_dict = dict(vars(GRPOTrainer))
    before = dict(vars(a))
    assert lt.enable(a) is a and lt.is_enabled(a) and not lt.is_enabled(b)
    assert a._get_per_token_logps_and_entropies.__func__ is not GRPOTrainer._get_per_token_logps_and_entropies
    assert b._get_per_token_logps_and_entropies.__func__ is GRPOTrainer._get_per_token_logps_and_entropies
    assert dict(vars(GRPOTrainer)) == cls_dict
    lt.enable(a)                                                   # idempotent
    lt.disable(a)
    assert dict(vars(a)) == before and not lt.is_enabled(a)
    lt.disable(a)                                                  # a no-op when not enabled
    assert dict(vars(a)) == before


def test_bad_input(folder, tmp_path):
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path))
    with pytest.raises(TypeError, match="trainer"):
        lt.enable(object())
    with pytest.raises(TypeError, match="trainer"):
        lt.disable("GRPOTrainer")
    with pytest.raises(TypeError, match="fused_loss"):
        lt.enable(trainer, fused_loss="yes")
    assert not lt.is_enabled(trainer)
    lt.enable(trainer)
    ids = torch.randint(3, 50, (2, 6))
    mask = torch.ones_like(ids)
    with pytest.raises(ValueError, match="pixel_values"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3, pixel_values=torch.zeros(1))
    with pytest.raises(ValueError, match="compute_aux_loss"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3, compute_aux_loss=True)
    with pytest.raises(ValueError, match="logits_to_keep"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 0)
    lt.disable(trainer)
    trainer.aux_loss_enabled = True
    with pytest.raises(ValueError, match="aux_loss_enabled"):
        lt.enable(trainer)
    assert not lt.is_enabled(trainer)


def test_cast_lm_head_to_fp32_under_bf16_autocast(folder, tmp_path, seed):
    """TRL's cast_lm_head_to_fp32 with bf16 autocast: the backbone in bf16, the head in float32 (logitless'
    head_in_fp32), as TRL's patched head computes it; the log-probs as TRL's within bf16's backbone noise
    (both read the same bf16-autocast hidden states, so the difference is the head's float32 rounding)."""
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), seed=seed % 2**31, bf16=True, cast_lm_head_to_fp32=True)
    assert trainer.model.lm_head.weight.dtype == torch.float32
    ids = torch.randint(3, 500, (3, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp_trl, ent_trl, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 5,
                                                                       compute_entropy=True)
        lt.enable(trainer)
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 5, compute_entropy=True)
    # the float32 head reached the op as float32 operands: its default precision ran (IEEE float32 on the CPU; on
    # CUDA the adaptive split, three products: this float32 model's residual stream stays float32 under autocast,
    # so its hidden states are not bfloat16 values; a bfloat16 model's are, test_cast_lm_head_to_fp32_runs_two_products)
    expected = ("bf16x3", "bf16") if lp.is_cuda else ("ieee", "ieee")
    assert logitless.last_precision() == expected
    assert float((lp - lp_trl).abs().max()) <= TOL and float((ent - ent_trl).abs().max()) <= TOL


# (grad_precision, the float32 head's gradient bound, the bfloat16 backbone's, relative norms): bfloat16 gradient
# products give the head a bfloat16 head's gradient error (1.2-1.6e-3 measured over batches) and the backbone a
# d_hidden of that error, which its bfloat16 backward carries (4.9-5.6e-3); float32-exact products (2.5-3.7e-6 on
# the head) leave the backbone's bfloat16 roundings (0 .. 1e-3)
GRADS = [(None, 1e-2, 2e-2), ("bf16x3", GRAD_TOL, 4e-3)]


@pytest.mark.parametrize("grad_precision,head_tol,backbone_tol", GRADS)
def test_cast_lm_head_to_fp32_runs_two_products(folder, tmp_path, monkeypatch, grad_precision, head_tol,
                                                backbone_tol):
    """TRL GRPO with cast_lm_head_to_fp32 under bf16 autocast and logitless on (its log-probs and its fused
    policy loss): the float32 head's operands are float32 copies of the bf16 backbone's hidden states and a
    float32 weight, so the adaptive split (CUDA's default, asked for by name here on the CPU) runs two bfloat16
    products ("bf16x2"). Its loss and gradients against TRL's own float32 head on the same batch: the loss to
    TOL; the gradients as ``GRADS`` says, by their dtype."""
    import logitless.transformers.forward as forward
    # a bfloat16 model (TRL loads it so with model_init_kwargs), its head cast to float32 by TRL
    trainer = trl_tiny.grpo_trainer(folder, str(tmp_path), bf16=True, cast_lm_head_to_fp32=True, beta=0.04,
                                    entropy_coef=0.01, num_iterations=2, model_init_kwargs={"dtype": "bfloat16"})
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert trainer.model.model.norm.weight.dtype == torch.bfloat16
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    _perturb(trainer.model, torch.Generator().manual_seed(3))
    loss_trl, grads_trl = _loss_and_grads(trainer, inputs)
    split = dict(precision="split", grad_precision=grad_precision)
    ran = []

    def forced(fn):
        def call(*args, **kw):
            out = fn(*args, **kw, **split)
            ran.append(tuple(logitless.last_precision()))
            return out
        return call
    monkeypatch.setattr(forward, "fused_logprobs", forced(forward.fused_logprobs))
    monkeypatch.setattr(forward, "policy_loss", forced(forward.policy_loss))
    lt.enable(trainer, fused_loss=True)
    loss, grads = _loss_and_grads(trainer, inputs)
    lt.disable(trainer)
    assert ran and set(ran) == {("bf16x2", grad_precision or "bf16")}, ran
    print(f"loss logitless {loss.item():.8f} TRL {loss_trl.item():.8f}")
    assert loss_trl.abs() > 0 and abs(loss.item() - loss_trl.item()) <= TOL
    assert grads.keys() == grads_trl.keys() and grads_trl
    head = float((grads["lm_head.weight"] - grads_trl["lm_head.weight"]).norm() / grads_trl["lm_head.weight"].norm())
    assert grads_trl["lm_head.weight"].dtype == torch.float32 and head <= head_tol, head
    # the backbone's gradients (bfloat16) as one vector: a small, cancelling gradient (an attention bias) has a
    # relative error of its own far above its share of the whole
    names = [n for n, g in grads_trl.items() if g.dtype == torch.bfloat16]
    assert len(names) == len(grads_trl) - 1
    diff = torch.cat([(grads[n].float() - grads_trl[n].float()).reshape(-1) for n in names])
    backbone = float(diff.norm() / torch.cat([grads_trl[n].float().reshape(-1) for n in names]).norm())
    print(f"relative gradient errors: head {head:.2e}, backbone {backbone:.2e}")
    assert backbone <= backbone_tol, backbone


def _peak(mode: str) -> int:
    proc = subprocess.run([sys.executable, os.path.join(HERE, "trl_memory_child.py"), mode],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"extra_bytes=(-?\d+) max_logp_diff=(\S+)", proc.stdout)
    assert m, proc.stdout
    return int(m.group(1)), float(m.group(2))


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc to reset peak RSS")
def test_peak_memory_of_the_logprob_step():
    """The log-prob step (forward + backward of the per-token log-probs and entropies of 16 sequences of
    48 tokens, vocabulary 32768), measured as peak RSS in a fresh process for TRL's own computation and
    for logitless'; both numbers are reported."""
    trl_bytes, _ = _peak("trl")
    ll_bytes, diff = _peak("logitless")
    logits_mib = 16 * 47 * 32768 * 4 / 2**20
    print(f"peak extra memory of the log-prob step: TRL {trl_bytes / 2**20:.1f} MiB, logitless "
          f"{ll_bytes / 2**20:.1f} MiB (one float32 logits tensor of the batch: {logits_mib:.1f} MiB)")
    assert diff <= TOL
    assert 0 < ll_bytes < trl_bytes
