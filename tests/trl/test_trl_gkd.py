"""logitless.trl.enable on real GKDTrainer and GOLDTrainer instances of trl.experimental (tiny Qwen2 student H = 32
and teacher H = 48 built from configs, a word-level tokenizer with a chat template, CPU): the enabled trainer's loss
against the class's own ``compute_loss`` (both models' logits, ``generalized_jsd_loss``) on the same batch, through
the trainer's own ``compute_loss`` / ``training_step``: the loss within 1e-5, every parameter gradient within 1e-4 of
its largest element, and what the trainer logs (same names, values within 1e-5)."""
import copy
import os
import random
import sys

import pytest
import torch

from required import import_or_skip

import_or_skip("trl", "the test extra installs trl")

import logitless.trl as lt  # noqa: E402
from logitless.record import serial_now  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import trl_tiny  # noqa: E402

TOL = 1e-5
GRAD_TOL = 1e-4
# bf16 autocast: the class's loss rounds both models' logits to bf16 before its float32 softmax; the fused op keeps
# the float32 products of the bf16 operands. The difference is bf16's rounding of the logits (2^-9 relative).
BF16_TOL = 2e-3
BF16_GRAD_TOL = 2.0 ** -5
KINDS = ["gkd", "gold"]


def _grads(model):
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _trainer(kind, folder, teacher, tmp_path, **config):
    return trl_tiny.experimental_distillation_trainer(kind, folder, teacher, str(tmp_path), **config)


def _batch(trainer, masked=False):
    """A collated batch of the trainer's own collator (prompts masked in labels, left padding)."""
    examples = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    inputs = trainer._prepare_inputs(trainer.data_collator(examples)) if "gkd" in type(trainer).__name__.lower() \
        else trainer.data_collator(examples)
    if masked:
        labels = inputs["labels"].clone()
        labels[0] = -100                         # a completion truncated away whole
        labels[2, -2:] = -100                    # completions scored in part
        inputs["labels"] = labels
    return inputs


def _loss_call(trainer, inputs, num_items):
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, dict(inputs), num_items_in_batch=num_items)
    loss.backward()
    return loss.detach().float(), _grads(trainer.model)


def _both(trainer, call):
    """call(trainer) with the class's loss, then with logitless' (compute_loss replaced on the instance)."""
    return trl_tiny.theirs_and_ours(trainer, call, "compute_loss")


def _assert_close(theirs, ours, tol=TOL, grad_tol=GRAD_TOL):
    (loss_t, g_t), (loss_o, g_o) = theirs[:2], ours[:2]
    assert loss_t.item() != 0.0
    assert abs(loss_o.item() - loss_t.item()) <= tol * max(1.0, abs(loss_t.item())), (loss_o.item(), loss_t.item())
    assert set(g_o) == set(g_t) and len(g_t) > 0
    for name, g in g_t.items():
        scale = g.abs().max().item()
        if name.endswith("k_proj.bias"):   # 0 in exact arithmetic (the softmax ignores a constant per query)
            scale = max(scale, 1e-3 * max(x.abs().max().item() for x in g_t.values()))
        assert scale > 0, name
        err = (g_o[name] - g).abs().max().item()
        assert err <= grad_tol * scale, (name, err, scale)


CASES = {
    "forward_kl": dict(beta=0.0),
    "jsd-0.3-temperature-0.7": dict(beta=0.3, temperature=0.7),
    "jsd-0.5": dict(beta=0.5),
    "reverse_kl-temperature-1.3": dict(beta=1.0, temperature=1.3),
    "jsd-0.7-masked": dict(beta=0.7, _masked=True),
}


@pytest.mark.parametrize("normalisation", ["num_items_in_batch", "batchmean"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_loss_and_gradients(folder, teacher, tmp_path, kind, case, normalisation):
    """GKD's loss ignores its temperature (the sampling's); GOLD's divides both models' logits by it: the enabled
    trainer does each. num_items_in_batch: the sum over that count (the Trainer's, over the whole accumulated batch:
    here 1.5 times this batch's); batchmean: the mean over the scored tokens."""
    config = dict(CASES[case])
    masked = config.pop("_masked", False)
    trainer = _trainer(kind, folder, teacher, tmp_path, **config)
    trainer.model.train()
    inputs = _batch(trainer, masked)
    num_items = None
    if normalisation == "num_items_in_batch":
        num_items = 1.5 * (inputs["labels"][:, 1:] != -100).sum()
    theirs, ours = _both(trainer, lambda t: _loss_call(t, inputs, num_items))
    _assert_close(theirs, ours)


def _log(trainer):
    """What the trainer logs now (its log() with an empty dict, as the Trainer's loop adds the loss itself)."""
    trainer.state.log_history.clear()
    trainer.log({})
    return trainer.state.log_history[-1]


@pytest.mark.parametrize("setting", ["off-policy", "on-policy (lmbda=1)", "seq_kd"])
def test_gkd_training_step(folder, teacher, tmp_path, setting):
    """GKD's training_step: with lmbda=1 the student samples the completions, with seq_kd the teacher does (the
    same samples in both runs, from the same seed); the loss, the gradients and what is logged."""
    config = {"off-policy": dict(lmbda=0.0), "on-policy (lmbda=1)": dict(lmbda=1.0),
              "seq_kd": dict(lmbda=0.0, seq_kd=True)}[setting]
    trainer = _trainer("gkd", folder, teacher, tmp_path, beta=0.5, **config)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1       # what Trainer's loop sets
    batch = _batch(trainer)

    def step(t):
        t.model.zero_grad(set_to_none=True)
        random.seed(0)
        torch.manual_seed(0)
        loss = t.training_step(t.model, copy.copy(batch), num_items_in_batch=None).detach().float()
        return loss, _grads(t.model), _log(t)

    since = serial_now()
    theirs, ours = _both(trainer, step)
    trl_tiny.assert_step_record(since, "trl.gkd")
    _assert_close(theirs, ours)
    assert ours[2].keys() == theirs[2].keys()
    assert ours[2] == {k: pytest.approx(v, rel=TOL, abs=TOL) for k, v in theirs[2].items()}


@pytest.mark.parametrize("lmbda", [0.0, 0.5, 1.0])
def test_gold_training_steps_and_metrics(folder, teacher, tmp_path, lmbda):
    """GOLD's training_step over two accumulation steps (one generation batch split in two, each slice on- or
    off-policy by lmbda): each step's loss, the accumulated gradients, and the on_policy_loss / off_policy_loss it
    logs from them."""
    trainer = _trainer("gold", folder, teacher, tmp_path, beta=0.3, temperature=0.8, lmbda=lmbda,
                       per_device_train_batch_size=4, gradient_accumulation_steps=2)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    batch = _batch(trainer)

    def steps(t):
        t.model.zero_grad(set_to_none=True)
        t._step, t._buffered_inputs = 0, None
        random.seed(1)                           # GOLD draws each slice's on-policy flag with random.random()
        torch.manual_seed(0)
        losses = [t.training_step(t.model, copy.copy(batch)).detach().float() for _ in range(2)]
        return torch.stack(losses), _grads(t.model), _log(t)

    since = serial_now()
    theirs, ours = _both(trainer, steps)
    trl_tiny.assert_step_record(since, "trl.gold")
    assert torch.allclose(ours[0], theirs[0], rtol=TOL, atol=TOL), (ours[0], theirs[0])
    _assert_close((theirs[0].sum(), theirs[1]), (ours[0].sum(), ours[1]))
    logged = theirs[2]
    assert ("on_policy_loss" in logged) == (lmbda > 0) and ("off_policy_loss" in logged) == (lmbda < 1)
    assert ours[2].keys() == logged.keys()
    # GOLD rounds these to 4 decimals: equal losses give the same rounding unless one sits on a boundary
    assert ours[2] == {k: pytest.approx(v, rel=TOL, abs=1e-4) for k, v in logged.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_autocast(folder, teacher, tmp_path, kind):
    """bf16=True on float32 models: both heads multiplied in autocast's bf16, as the models' own lm_head is."""
    trainer = _trainer(kind, folder, teacher, tmp_path, beta=0.5, bf16=True)
    trainer.model.train()
    inputs = _batch(trainer)

    def call(t):
        with t.compute_loss_context_manager():
            return _loss_call(t, inputs, None)

    theirs, ours = _both(trainer, call)
    _assert_close(theirs, ours, tol=BF16_TOL, grad_tol=BF16_GRAD_TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_return_outputs_and_refusals(folder, teacher, tmp_path, kind):
    trainer = _trainer(kind, folder, teacher, tmp_path, beta=0.5)
    trainer.model.eval()
    inputs = _batch(trainer)
    lt.enable(trainer)
    assert lt.enable(trainer, fused_loss=True) is trainer and lt.is_enabled(trainer)
    # evaluation asking for the student's logits gets the class's own compute_loss (it computes them)
    with torch.no_grad():
        fused = trainer.compute_loss(trainer.model, dict(inputs))
        loss, outputs = trainer.compute_loss(trainer.model, dict(inputs), return_outputs=True)
    assert outputs.logits.shape[-1] == trainer.model.lm_head.out_features
    assert abs(fused.item() - loss.item()) <= TOL * max(1.0, abs(loss.item()))
    lt.disable(trainer)
    assert not lt.is_enabled(trainer) and "compute_loss" not in trainer.__dict__
    with pytest.raises(ValueError, match="fused_loss=False"):
        lt.enable(trainer, fused_loss=False)

    def refused(match, **attrs):
        trl_tiny.assert_enable_refuses(trainer, match, **attrs)

    refused(r"beta=1\.5", beta=1.5)
    refused("teacher_model=None", teacher_model=None)
    refused("vision-language", _is_vlm=True)
    if kind == "gold":
        refused(r"use_uld_loss=True", use_uld_loss=True)
        refused(r"temperature=0\.0", temperature=0.0)
    head = trainer.teacher_model.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    try:
        with pytest.raises(ValueError, match=r"trainer\.teacher_model: .*lm_head\.bias"):
            lt.enable(trainer)
    finally:
        head.bias = None
    # a softcap Qwen2's forward does not apply: which logits the class's loss sees is unknown, so refused
    trainer.model.config.final_logit_softcapping = 5.0
    try:
        with pytest.raises(ValueError, match=r"trainer\.model: .*final_logit_softcapping"):
            lt.enable(trainer)
    finally:
        trainer.model.config.final_logit_softcapping = None
    # a subclass with a loss of its own
    cls = type(trainer)
    own = staticmethod(lambda *args, **kwargs: cls.generalized_jsd_loss(*args, **kwargs))
    trainer.__class__ = type("Mine", (cls,), {"generalized_jsd_loss": own})
    try:
        with pytest.raises(ValueError, match=r"Mine\.generalized_jsd_loss"):
            lt.enable(trainer)
    finally:
        trainer.__class__ = cls
    if kind == "gold":
        # GOLD forwards every other tensor of the batch to both models: refused by name in the enabled loss
        lt.enable(trainer)
        with pytest.raises(ValueError, match="token_type_ids"):
            trainer.compute_loss(trainer.model, {**inputs, "token_type_ids": torch.zeros_like(inputs["input_ids"])})
        lt.disable(trainer)


@pytest.mark.parametrize("kind", KINDS)
def test_model_head_transforms(tmp_path, kind):
    """These trainers take the logits from each model's own forward: a Cohere student (its forward multiplies the
    logits by logit_scale, with the head tied to the embedding) and a Gemma 2 teacher (its forward softcaps them by
    final_logit_softcapping); the enabled loss applies each as the forward does."""
    student = trl_tiny.save_tiny(str(tmp_path / "cohere"), "cohere", int.from_bytes(os.urandom(4), "little"),
                                 logit_scale=0.6)
    teacher = trl_tiny.save_tiny(str(tmp_path / "gemma2"), "gemma2", int.from_bytes(os.urandom(4), "little"),
                                 hidden_size=48, final_logit_softcapping=3.0)
    trainer = _trainer(kind, student, teacher, tmp_path / "out", beta=0.3, temperature=1.2)
    trainer.model.train()
    inputs = _batch(trainer)
    theirs, ours = _both(trainer, lambda t: _loss_call(t, inputs, None))
    _assert_close(theirs, ours)
