"""Bad input to the policy losses: a TypeError / ValueError naming the argument, before any kernel runs."""
from __future__ import annotations

import math

import pytest
import torch

from logitless.losses import fused_policy_loss, policy_loss, policy_loss_reference

B, S, H, V = 2, 5, 16, 37


def inputs():
    hidden = torch.randn(B, S, H)
    weight = torch.randn(V, H)
    labels = torch.randint(0, V, (B, S))
    labels[0, 0] = -100
    return hidden, weight, labels, torch.randn(B, S), (torch.randn(B, S) - 3.0).clamp(max=0.0)


def nan_at_scored(t):
    t = t.clone()
    t[1, 2] = math.nan
    return t


CASES = [
    # (name, change to the call's keyword arguments, exception, text the message must contain)
    ("advantages not a tensor", dict(advantages=[1.0]), TypeError, "advantages"),
    ("advantages None", dict(advantages=None), TypeError, "advantages"),
    ("advantages bool", dict(advantages=torch.ones(B, S, dtype=torch.bool)), TypeError, "advantages"),
    ("advantages require grad", dict(advantages=torch.randn(B, S, requires_grad=True)), ValueError, "advantages"),
    ("advantages shape", dict(advantages=torch.randn(B, S + 1)), ValueError, "advantages"),
    ("advantages [b] ambiguous", dict(advantages=torch.randn(B)), ValueError, "ambiguous"),
    ("advantages device", dict(advantages=torch.randn(B, S, device="meta")), ValueError, "advantages"),
    ("advantages NaN at a scored token", dict(advantages=nan_at_scored(torch.randn(B, S))), ValueError,
     "advantages must be finite"),
    ("old_logprobs NaN at a scored token", dict(old_logprobs=nan_at_scored(torch.randn(B, S))), ValueError,
     "old_logprobs"),
    ("advantages -inf at a scored token", dict(advantages=nan_at_scored(torch.randn(B, S)).nan_to_num(-math.inf)),
     ValueError, "advantages must be finite"),
    ("old_logprobs inf at a scored token", dict(old_logprobs=nan_at_scored(torch.randn(B, S)).nan_to_num(math.inf)),
     ValueError, "old_logprobs must be finite"),
    ("old_logprobs not a tensor", dict(old_logprobs=0.5), TypeError, "old_logprobs"),
    ("ref_logprobs shape", dict(ref_logprobs=torch.randn(3, S)), ValueError, "ref_logprobs"),
    ("clip_low negative", dict(clip_low=-0.1), ValueError, "clip_low"),
    ("clip_low str", dict(clip_low="0.2"), TypeError, "clip_low"),
    ("clip_high inf", dict(clip_high=math.inf), ValueError, "clip_high"),
    ("clip_high bool", dict(clip_high=True), TypeError, "clip_high"),
    ("dual_clip 1", dict(dual_clip=1.0), ValueError, "dual_clip"),
    ("dual_clip tensor", dict(dual_clip=torch.tensor(3.0)), TypeError, "dual_clip"),
    ("kl_coef without ref", dict(kl_coef=0.1), ValueError, "ref_logprobs"),
    ("kl_coef NaN", dict(kl_coef=math.nan), ValueError, "kl_coef"),
    ("kl_type unknown", dict(kl_type="full", ref_logprobs=torch.randn(B, S)), ValueError, "kl_type"),
    ("kl_type int", dict(kl_type=3), TypeError, "kl_type"),
    ("entropy_coef NaN", dict(entropy_coef=math.nan), ValueError, "entropy_coef"),
    ("loss_agg GSPO", dict(loss_agg="seq-ratio"), ValueError, "fused_logprobs"),
    ("loss_agg int", dict(loss_agg=0), TypeError, "loss_agg"),
    ("cu_seqlens with 2-D labels", dict(cu_seqlens=torch.tensor([0, S, 2 * S])), ValueError, "cu_seqlens"),
    ("cu_seqlens float", dict(cu_seqlens=torch.tensor([0.0, 10.0])), TypeError, "cu_seqlens"),
    ("labels out of range", dict(labels=torch.full((B, S), V)), ValueError, "labels"),
    ("labels far out of range", dict(labels=torch.full((B, S), 2 ** 60)), ValueError, "got 1152921504606846976"),
    ("labels float", dict(labels=torch.zeros(B, S)), TypeError, "labels"),
    ("hidden size", dict(hidden=torch.randn(B, S, H + 1)), ValueError, "H="),
    ("weight dtype", dict(weight=torch.randn(V, H, dtype=torch.float64)), TypeError, "weight"),
    ("temperature", dict(temperature=-1.0), ValueError, "temperature"),
    ("temperature [b] ambiguous", dict(temperature=torch.ones(B)), ValueError, "temperature"),
    ("temperature tensor with a 0", dict(temperature=nan_at_scored(torch.ones(B, S)).nan_to_num(0.0)), ValueError,
     "temperature must be finite and >= 1e-30"),
    ("temperature tensor NaN", dict(temperature=nan_at_scored(torch.ones(B, S))), ValueError,
     "temperature must be finite and >= 1e-30"),
    ("temperature tensor inf", dict(temperature=nan_at_scored(torch.ones(B, S)).nan_to_num(math.inf)), ValueError,
     "temperature must be finite and >= 1e-30"),
    ("temperature tensor negative", dict(temperature=-torch.ones(B, 1)), ValueError,
     "temperature must be finite and >= 1e-30"),
    ("ref_logprobs NaN at a scored token", dict(ref_logprobs=nan_at_scored(torch.randn(B, S))), ValueError,
     "ref_logprobs must be finite"),
    ("labels negative, not ignore_index", dict(labels=torch.full((B, S), -2)), ValueError,
     r"labels must lie in \[0, 37\) or equal ignore_index=-100; got -2"),
    ("ignore_index float", dict(ignore_index=-100.0), TypeError, "ignore_index"),
    ("backend unknown", dict(backend="cuda"), ValueError, "backend"),
    ("reduce_grad_hidden int", dict(reduce_grad_hidden=1), TypeError, "reduce_grad_hidden"),
    ("reduce_grad_hidden False without tp_group", dict(reduce_grad_hidden=False), ValueError,
     "reduce_grad_hidden=False has no effect without tp_group"),
    ("clip_low 1.5", dict(clip_low=1.5), ValueError, r"clip_low must lie in \[0, 1\]"),
    ("no features", dict(hidden=torch.randn(B, S, 0), weight=torch.randn(V, 0)), ValueError, r"H == 0"),
    ("temperature 1e-50", dict(temperature=1e-50), ValueError, "temperature must be finite and >= 1e-30"),
    ("temperature tensor 1e-50", dict(temperature=torch.full((B, 1), 1e-50, dtype=torch.float64)), ValueError,
     "temperature must be finite and >= 1e-30 everywhere"),
    ("advantages float64 beyond float32", dict(advantages=torch.full((B, S), 1e300, dtype=torch.float64)),
     ValueError, "advantages must be finite at every scored token .*as float32"),
    ("mixed dtypes", dict(hidden=torch.randn(B, S, H, dtype=torch.bfloat16)), TypeError, "under torch.autocast"),
]


@pytest.mark.parametrize("fn", [fused_policy_loss, policy_loss_reference], ids=["fused", "reference"])
@pytest.mark.parametrize("name,change,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input(fn, name, change, exc, match):
    hidden, weight, labels, adv, old = inputs()
    kw = dict(hidden=hidden, weight=weight, labels=labels, advantages=adv, old_logprobs=old, backend="chunked")
    kw.update(change)
    with pytest.raises(exc, match=match):
        fn(**kw)


def test_packed_labels_need_cu_seqlens_for_sequence_aggregation():
    hidden, weight, labels, adv, old = inputs()
    flat = dict(hidden=hidden.reshape(-1, H), weight=weight, labels=labels.reshape(-1),
                advantages=adv.reshape(-1), backend="chunked")
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_policy_loss(**flat, loss_agg="seq-mean-token-mean")
    for bad in ([0, 4, 3, 10], [1, 10], [0, 9], [[0, 10]]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            fused_policy_loss(**flat, loss_agg="seq-mean-token-mean", cu_seqlens=torch.tensor(bad))
    fused_policy_loss(**flat, loss_agg="token-mean")   # no sequences needed


def test_policy_loss_needs_a_policy_loss():
    hidden, weight, labels, _, _ = inputs()
    with pytest.raises(TypeError, match="PolicyLoss"):
        policy_loss({"advantages": torch.ones(1)}, hidden, weight, labels)


@pytest.mark.parametrize("fn", [fused_policy_loss, policy_loss_reference], ids=["fused", "reference"])
def test_every_non_finite_input_is_named_and_padding_may_hold_nan(fn):
    """The call's checks come back together: all the inputs that are not finite at a scored token are
    named in one error; NaN where the label is ignore_index is accepted."""
    hidden, weight, labels, adv, old = inputs()
    bad = dict(advantages=nan_at_scored(adv), old_logprobs=old, ref_logprobs=nan_at_scored(-3 * torch.rand(B, S)))
    with pytest.raises(ValueError, match="advantages, ref_logprobs must be finite at every scored token"):
        fn(hidden, weight, labels, backend="chunked", **bad)
    padded = [t.clone() for t in (adv, old)]
    for t in padded:
        t[0, 0] = math.nan                               # labels[0, 0] is ignore_index
    out = fn(hidden, weight, labels, padded[0], padded[1], ref_logprobs=-3 * torch.rand(B, S), kl_coef=0.1,
             backend="chunked")
    assert torch.isfinite(out.loss) and out.logprobs[0, 0] == 0


def test_a_bad_statistics_kernel_knob_is_an_error_on_every_machine(monkeypatch):
    """LOGITLESS_POLICY_STATS_KERNEL is read by the triton backend on every machine (the interpreter here), not
    only where the Gluon kernel could run."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # CPU tensors: the interpreter (tests/conftest.py)
    hidden, weight, labels, adv, old = (t.to(dev) for t in inputs())
    monkeypatch.setenv("LOGITLESS_POLICY_STATS_KERNEL", "gluon")
    with pytest.raises(ValueError, match="LOGITLESS_POLICY_STATS_KERNEL"):
        fused_policy_loss(hidden, weight, labels, advantages=adv, old_logprobs=old, backend="triton")
    monkeypatch.setenv("LOGITLESS_POLICY_STATS_KERNEL", "triton")
    out = fused_policy_loss(hidden, weight, labels, advantages=adv, old_logprobs=old, backend="triton")
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("temperature", [1e-30, 1e300])
def test_extreme_temperatures_are_exact(temperature):
    from policy64 import loss64
    hidden, weight, labels, adv, old = inputs()
    out = fused_policy_loss(hidden, weight, labels, adv, old, temperature=temperature, backend="chunked")
    want = loss64(hidden, weight, labels, adv, old, temperature=temperature)
    assert abs(float(out.loss) - float(want[0])) <= 1e-5 * max(1.0, abs(float(want[0])))
    valid = labels != -100
    # a log-prob is a difference of float32 logits: its error scales with the row's largest logit / T (a
    # difference that cancels can be small against its error), not with the log-prob itself
    scale = (hidden.double() @ weight.double().T).abs().amax(-1) / temperature
    assert ((out.logprobs - want[1]).abs() / scale.clamp_min(1.0))[valid].max() <= 2e-6


def test_check_inputs_must_be_a_bool():
    hidden, weight, labels, adv, old = inputs()
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        fused_policy_loss(hidden, weight, labels, adv, old, check_inputs=1)
