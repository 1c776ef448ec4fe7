"""logitless.trl.enable on a real trl.DistillationTrainer (tiny Qwen2 student H = 32 and teacher H = 48 built from
configs, CPU): the enabled trainer's loss against TRL's own (``DistillationTrainer._compute_loss``, its
``ChunkedDivergenceFunction``) on the same batch through the trainer's own ``compute_loss`` / ``training_step``:
the loss within 1e-5, every parameter gradient within 1e-4 of the largest (relative, per parameter), and the
metrics TRL logs (same names, values within 1e-5). bf16 runs have bounds of their own (below)."""
import os
import sys

import pytest
import torch

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

import logitless.trl as lt  # noqa: E402
from logitless.record import serial_now  # noqa: E402
from trl import DistillationTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_tiny  # noqa: E402

TOL = 1e-5
GRAD_TOL = 1e-4
# bf16: TRL's chunked divergence accumulates both gradients in float32 and returns them in the operands' dtype
# before its cast; the fused op hands out the bf16 operands' gradients in bf16. One bf16 rounding (2^-9 relative)
# more on the head's gradient, and the decoder's bf16 backward then flips roundings of its own (see
# test_trl_fused_loss.py): bf16's bound for every parameter, float32's for the loss and metrics within bf16 noise.
BF16_GRAD_TOL = 2.0 ** -6
BF16_TOL = 2e-3
# ... except for a gradient that is 0 in exact arithmetic, which holds rounding noise alone: k_proj.bias's (a bias
# on every key adds one constant to each query's scores, which the softmax ignores). In bf16 its noise is measured
# against the model's largest gradient, times this: bf16 rounds each cancelling term by up to 2^-9, so noise of a few
# thousandths of the largest gradient is expected (at 1e-3 one CI draw missed by 15%; the bound on k_proj.bias's
# difference stays 6e-5 of the largest gradient).
BF16_NOISE_FLOOR = 4e-3


def _grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _metrics(trainer):
    return {mode: {k: list(v) for k, v in trainer._metrics[mode].items()} for mode in ("train", "eval")}


def _loss_call(trainer, inputs):
    """TRL's compute_loss (whatever _compute_loss the instance has) and its backward: (loss, grads, metrics)."""
    trainer.model.zero_grad(set_to_none=True)
    for mode in ("train", "eval"):
        trainer._metrics[mode].clear()
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach().float(), _grads(trainer.model), _metrics(trainer)


def _both(trainer, call):
    """call(trainer) with the class's loss, then with logitless' (_compute_loss replaced on the instance)."""
    return trl_tiny.theirs_and_ours(trainer, call, "_compute_loss")


def _assert_close(theirs, ours, tol=TOL, grad_tol=GRAD_TOL, noise_floor=0.0):
    loss_t, g_t, m_t = theirs
    loss_o, g_o, m_o = ours
    assert loss_t.item() != 0.0
    assert abs(loss_o.item() - loss_t.item()) <= tol * max(1.0, abs(loss_t.item())), (loss_o.item(), loss_t.item())
    assert set(g_o) == set(g_t) and len(g_t) > 0
    largest = max(g.abs().max().item() for g in g_t.values())
    for name, g in g_t.items():
        scale = g.abs().max().item()
        if name.endswith("k_proj.bias"):
            scale = max(scale, noise_floor * largest)
        assert scale > 0, name
        err = (g_o[name] - g).abs().max().item()
        assert err <= grad_tol * scale, (name, err, scale)
    assert m_o == {mode: {k: pytest.approx(v, rel=tol, abs=tol) for k, v in d.items()} for mode, d in m_t.items()}
    assert m_t["train"].get("entropy") or m_t["eval"].get("entropy")


def _batch(trainer, masked=False, tool=False):
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    if masked:
        mask = inputs["completion_mask"].clone()
        mask[0] = 0                          # a completion masked whole
        mask[1, 5:] = 0                      # completions that ended early: their padding
        mask[3, 2:] = 0
        inputs["completion_mask"] = mask
        inputs["num_items_in_batch"] = mask.sum()
    if tool:
        tool_mask = torch.ones_like(inputs["completion_mask"])
        tool_mask[:, 2:4] = 0                # a tool's output inside each completion: not scored
        inputs["tool_mask"] = tool_mask
        inputs["num_items_in_batch"] = (inputs["completion_mask"] * tool_mask).sum()
    return inputs


CASES = {
    "forward_kl": dict(beta=0.0),
    "jsd-0.3-temperature": dict(beta=0.3, temperature=0.7),
    "jsd-0.5": dict(beta=0.5),
    "reverse_kl-temperature": dict(beta=1.0, temperature=1.3),
    "jsd-0.3-masked": dict(beta=0.3, _masked=True),
    "reverse_kl-tool_mask": dict(beta=1.0, _tool=True),
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_gradients_metrics(folder, teacher, tmp_path, case, mode):
    """train: TRL's num_items_in_batch (the generated completions' scored tokens); eval: the token mean."""
    config = dict(CASES[case])
    masked, tool = config.pop("_masked", False), config.pop("_tool", False)
    trainer = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path), **config)
    inputs = _batch(trainer, masked, tool)
    getattr(trainer.model, mode)()
    theirs, ours = _both(trainer, lambda t: _loss_call(t, inputs))
    _assert_close(theirs, ours)


def test_logit_scale_and_softcap(folder, teacher, tmp_path):
    """Each model's logit multiplier and final_logit_softcapping, read from its config as TRL reads them (Qwen2's
    own forward ignores both; TRL's loss applies them, and so does the enabled one)."""
    trainer = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path), beta=0.5, temperature=1.2)
    trainer.model.config.final_logit_softcapping = 4.0
    trainer.model.config.logits_scaling = 2.5            # TRL divides by it
    trainer.teacher_model.config.logit_scale = 0.6
    trainer.teacher_model.config.final_logit_softcapping = 7.0
    inputs = _batch(trainer)
    theirs, ours = _both(trainer, lambda t: _loss_call(t, inputs))
    _assert_close(theirs, ours)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_gradient_accumulation(folder, teacher, tmp_path, beta):
    """Two accumulation steps through the trainer's own training_step (TRL splits one generation batch into two
    micro-batches; num_items_in_batch counts the whole batch's scored tokens): each step's loss and the
    accumulated gradients."""
    trainer = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path), beta=beta, gradient_accumulation_steps=2,
                                            per_device_train_batch_size=4)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2       # what Trainer's loop sets
    generation = trainer._generate_and_score_completions(
        [{"prompt": p} for p in trl_tiny.prompts()])
    generation["completion_mask"][2, 4:] = 0
    generation["num_items_in_batch"] = generation["completion_mask"].sum()
    trainer._generate_and_score_completions = lambda _inputs: generation

    def steps(t):
        t.model.zero_grad(set_to_none=True)
        t._metrics["train"].clear()
        t._step, t._buffered_inputs = 0, None
        torch.manual_seed(0)                 # TRL shuffles the generation batch before splitting it
        losses = [t.training_step(t.model, [], None).detach().float() for _ in range(2)]
        return torch.stack(losses), _grads(t.model), {"train": {"entropy": list(t._metrics["train"]["entropy"])}}

    since = serial_now()
    theirs, ours = _both(trainer, steps)
    trl_tiny.assert_step_record(since, "trl.distillation")
    assert torch.allclose(ours[0], theirs[0], rtol=TOL, atol=TOL), (ours[0], theirs[0])
    _assert_close((theirs[0].sum(), *theirs[1:]), (ours[0].sum(), *ours[1:]))


def test_bf16_autocast(folder, teacher, tmp_path):
    """bf16=True on float32 models: TRL multiplies the heads in autocast's bf16 (float32 products); so does the
    enabled trainer."""
    trainer = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path), beta=0.5, bf16=True)
    inputs = _batch(trainer)

    def call(t):
        with t.compute_loss_context_manager():
            return _loss_call(t, inputs)

    theirs, ours = _both(trainer, call)
    _assert_close(theirs, ours, tol=BF16_TOL, grad_tol=BF16_GRAD_TOL, noise_floor=BF16_NOISE_FLOOR)


@pytest.mark.parametrize("fp32_heads", [False, True])
def test_bf16_models(folder, teacher, tmp_path, fp32_heads):
    """bf16 models (no autocast): both heads multiplied in bf16 with float32 products, as TRL does. fp32_heads: the
    lm_heads cast to float32 after the batch was generated (DistillationConfig has no cast_lm_head_to_fp32, and
    TRL's generation cannot run a float32 head on bf16 hidden states): TRL still multiplies each head in its hidden
    states' dtype, bf16, and so does the enabled trainer; the head's gradient is float32 in both."""
    trainer = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path), beta=0.3)
    for model in (trainer.model, trainer.teacher_model):
        model.to(torch.bfloat16)
    inputs = _batch(trainer)
    if fp32_heads:
        for model in (trainer.model, trainer.teacher_model):
            model.lm_head.to(torch.float32)
    theirs, ours = _both(trainer, lambda t: _loss_call(t, inputs))
    head_dtype = torch.float32 if fp32_heads else torch.bfloat16
    assert trainer.model.lm_head.weight.grad.dtype == head_dtype
    _assert_close(theirs, ours, tol=BF16_TOL, grad_tol=BF16_GRAD_TOL, noise_floor=BF16_NOISE_FLOOR)


def test_enable_disable_and_refusals(folder, teacher, tmp_path):
    trainer = trl_tiny.distillation_trainer(folder, teacher, str(tmp_path), beta=0.5)
    assert lt.enable(trainer) is trainer and lt.is_enabled(trainer)
    assert lt.enable(trainer, fused_loss=True) is trainer        # idempotent; the loss is the fused one anyway
    assert DistillationTrainer._compute_loss is not trainer._compute_loss.__func__
    lt.disable(trainer)
    assert not lt.is_enabled(trainer) and "_compute_loss" not in trainer.__dict__
    with pytest.raises(ValueError, match="fused_loss=False"):
        lt.enable(trainer, fused_loss=False)
    with pytest.raises(TypeError, match="fused_loss"):
        lt.enable(trainer, fused_loss=1)
    with pytest.raises(TypeError, match="GRPOTrainer or trl.DistillationTrainer"):
        lt.enable(object())

    def refused(match, **attrs):
        trl_tiny.assert_enable_refuses(trainer, match, **attrs)

    refused(r"beta=1\.5", beta=1.5)
    refused(r"temperature=0\.0", temperature=0.0)
    refused("teacher_model=None", teacher_model=None)
    refused("vision-language", _is_vlm=True)
    head = trainer.teacher_model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    try:
        with pytest.raises(ValueError, match=r"trainer\.teacher_model's lm_head\.bias"):
            lt.enable(trainer)
    finally:
        head.bias = None
    trainer.model.config.final_logit_softcapping = -1.0
    try:
        with pytest.raises(ValueError, match=r"trainer\.model's final_logit_softcapping=-1\.0"):
            lt.enable(trainer)
    finally:
        trainer.model.config.final_logit_softcapping = None
    # a multimodal batch reaching an enabled trainer is refused by name, before any forward
    lt.enable(trainer)
    inputs = _batch(trainer)
    inputs["pixel_values"] = torch.zeros(1)
    with pytest.raises(ValueError, match="pixel_values"):
        trainer.compute_loss(trainer.model, inputs)
