"""fused_distillation_loss refuses bad input with a TypeError / ValueError naming the argument, before any
kernel runs (the op is replaced by one that fails the test if it is reached)."""
from __future__ import annotations

import pytest
import torch

import logitless.losses.distillation as distillation
from logitless.losses import fused_distillation_loss

V, HS, HT = 37, 12, 10


@pytest.fixture
def no_kernel(monkeypatch):
    def reached(*args, **kwargs):
        raise AssertionError("the op ran: the refusal came too late")
    monkeypatch.setattr(distillation, "fused_distillation_loss_op", reached)


def inputs():
    return dict(student_hidden=torch.randn(2, 5, HS), student_weight=torch.randn(V, HS),
                labels=torch.randint(0, V, (2, 5)), teacher_hidden=torch.randn(2, 5, HT),
                teacher_weight=torch.randn(V, HT))


def call(**changes):
    kw = inputs()
    kw.setdefault("divergence", "reverse_kl")
    kw.update(changes)
    kw = {k: v for k, v in kw.items() if not (isinstance(v, str) and v == "DROP")}
    args = [kw.pop("student_hidden"), kw.pop("student_weight"), kw.pop("labels")]
    return fused_distillation_loss(*args, **kw)


@pytest.mark.parametrize("changes,error,match", [
    ({"divergence": "kl"}, ValueError, "divergence must be one of"),
    ({"divergence": 3}, TypeError, "divergence must be a str"),
    ({"divergence": "jsd"}, ValueError, "needs beta"),
    ({"divergence": "jsd", "beta": 1.5}, ValueError, r"beta must lie in \[0, 1\]"),
    ({"divergence": "jsd", "beta": -0.1}, ValueError, r"beta must lie in \[0, 1\]"),
    ({"divergence": "jsd", "beta": float("nan")}, ValueError, r"beta must lie in \[0, 1\]"),
    ({"divergence": "jsd", "beta": True}, TypeError, "beta must be a real number"),
    ({"divergence": "forward_kl", "beta": 0.5}, ValueError, "does not use it"),
    ({"teacher_hidden": None}, ValueError, "needs teacher_hidden"),
    ({"teacher_weight": None}, ValueError, "needs teacher_weight"),
    ({"teacher_topk_ids": torch.zeros(2, 5, 3, dtype=torch.long)}, ValueError, "teacher_topk_ids is for the top-k"),
    ({"teacher_topk_logprobs": torch.zeros(2, 5, 3)}, ValueError, "teacher_topk_logprobs is for the top-k"),
    ({"divergence": "forward_kl_topk"}, ValueError, "teacher_hidden is for the full-vocabulary"),
    ({"teacher_weight": torch.randn(V + 1, HT)}, ValueError, "teacher_weight has 38 vocabulary rows"),
    ({"teacher_weight": torch.randn(V, HT + 1)}, ValueError, "teacher_weight has H=11"),
    ({"teacher_hidden": torch.randn(2, 4, HT)}, ValueError, "teacher_hidden"),
    ({"student_weight": torch.randn(V, HS + 1)}, ValueError, "student_weight has H=13"),
    ({"student_weight": torch.randn(V, HS, dtype=torch.float64)}, TypeError, "student_weight dtype"),
    ({"teacher_hidden": torch.randn(2, 5, HT).bfloat16()}, TypeError, "teacher_weight dtype"),
    ({"teacher_hidden": torch.randn(2, 5, HT, device="meta")}, ValueError, "teacher_hidden is on meta"),
    ({"teacher_weight": torch.randn(V, HT, device="meta")}, ValueError, "teacher_weight is on meta"),
    ({"log_prob_min_clamp": -10.0}, TypeError, "log_prob_min_clamp is only for the top-k divergences"),
    ({"divergence": "jsd", "beta": 0.5, "loss_max_clamp": 1.0}, TypeError, "loss_max_clamp is only for the top-k"),
    ({"temprature": 0.5}, TypeError, "unknown argument.*temprature.*did you mean 'temperature'"),
    ({"clamp": 1.0}, TypeError, "unknown argument.*clamp.*fused_distillation_loss takes"),
    ({"student_softcap": -1.0}, ValueError, "student_softcap"),
    ({"teacher_softcap": "x"}, TypeError, "teacher_softcap"),
    ({"student_logit_scale": float("inf")}, ValueError, "student_logit_scale"),
    ({"student_logit_scale": 0.0}, ValueError, "student_logit_scale must be > 0"),      # every logit 0
    ({"teacher_logit_scale": -1.0}, ValueError, "teacher_logit_scale must be > 0"),
    ({"loss_agg": "mean"}, ValueError, "loss_agg must be one of"),
    ({"num_items_in_batch": 10, "loss_agg": "token-sum"}, ValueError, "num_items_in_batch replaces"),
    ({"num_items_in_batch": 0}, ValueError, "num_items_in_batch must be > 0"),
    ({"cu_seqlens": torch.tensor([0, 10])}, ValueError, "cu_seqlens delimits sequences"),
    ({"token_weight": torch.rand(5)}, ValueError, "token_weight of shape"),
    ({"token_weight": torch.rand(2, 5, requires_grad=True)}, ValueError, "token_weight must not require grad"),
    ({"temperature": torch.rand(5)}, ValueError, "temperature of shape"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"backend": "fast"}, ValueError, "backend must be one of"),
    ({"ignore_index": 1.5}, TypeError, "ignore_index"),
    ({"reduce_grad_hidden": False}, ValueError, "reduce_grad_hidden=False has no effect without tp_group"),
])
def test_refused_before_any_kernel(no_kernel, changes, error, match):
    with pytest.raises(error, match=match):
        call(**changes)


def test_values_refused_inside_the_op():
    """Labels out of range, temperatures out of range (as tensors) and non-finite weights at scored tokens are
    checked in the op's one host read, still before any product."""
    labels = torch.randint(0, V, (2, 5))
    labels[1, 2] = V
    with pytest.raises(ValueError, match="labels must lie in"):
        call(labels=labels)
    with pytest.raises(ValueError, match="temperature"):
        call(temperature=torch.full((2, 1), -1.0))
    tw = torch.rand(2, 5)
    tw[0, 1] = float("inf")
    with pytest.raises(ValueError, match="token_weight must be finite"):
        call(token_weight=tw)
    # a negative weight would make that token's divergence a term to maximise (a negative loss)
    with pytest.raises(ValueError, match="token_weight must be finite and >= 0"):
        call(token_weight=torch.rand(2, 5) - 2.0)
    labels = torch.randint(0, V, (2, 5))
    labels[0, 1] = -100
    call(labels=labels, token_weight=tw)        # not read at an ignored token


@pytest.mark.parametrize("name", ["student_hidden", "teacher_hidden"])
def test_non_finite_hidden_at_a_scored_token_is_refused(name):
    """A NaN in a scored row of either head's hidden states is refused, naming that argument; on an ignored row it
    is never read (the loss and gradients stay finite)."""
    kw = inputs()
    kw[name][0, 3, 1] = float("nan")
    labels = kw["labels"]
    with pytest.raises(ValueError, match=f"{name} holds a NaN"):
        call(**kw)
    labels[0, 3] = -100
    sh = kw["student_hidden"].requires_grad_(True)
    sw = kw["student_weight"].requires_grad_(True)
    out = call(**kw)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(sw.grad).all() and torch.isfinite(sh.grad).all()
