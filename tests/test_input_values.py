"""Numbers that cannot be what their names say are refused (check_inputs=True, the default), inside the op, in
the synchronisation the other checks already make, so compiled callers see the same ValueError:

- a NaN or an infinity in a hidden row that is scored (fused_logprobs, fused_policy_loss): ValueError naming
  hidden; in a row that is not scored it stays harmless;
- old_logprobs / ref_logprobs / rollout_logprobs above 0 at a scored token (probabilities passed by mistake)."""
from __future__ import annotations

import pytest
import torch

from logitless import fused_logprobs
from logitless.losses import fused_policy_loss

V, N, H = 4099, 7, 96
BACKENDS = ["reference", "chunked", "triton"]


def inputs():
    hidden = torch.randn(3, N, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.05).requires_grad_(True)
    labels = torch.randint(0, V, (3, N))
    labels[:, :2] = -100
    return hidden, weight, labels


def poisoned(hidden, row, col, value):
    h = hidden.detach().clone()
    h[row, col, 5] = value
    return h.requires_grad_(True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_scored_hidden_row_is_refused(backend, value):
    hidden, weight, labels = inputs()
    bad = poisoned(hidden, 1, 4, value)
    with pytest.raises(ValueError, match="hidden must be finite at every scored row"):
        fused_logprobs(bad, weight, labels, backend=backend)
    adv = torch.randn(3, 1)
    with pytest.raises(ValueError, match="hidden must be finite at every scored row"):
        fused_policy_loss(bad, weight, labels, adv, backend=backend)
    with pytest.raises(ValueError, match="hidden must be finite"):        # the two-pass path too
        fused_policy_loss(bad, weight, labels, adv, backend=backend, ratio_level="sequence")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_ignored_hidden_row_is_harmless(backend):
    hidden, weight, labels = inputs()
    bad = poisoned(hidden, 1, 0, float("nan"))       # position 0 is not scored
    out = fused_logprobs(bad, weight, labels, backend=backend)
    out.logprobs.sum().backward()
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(weight.grad).all()
    weight.grad = None
    pl = fused_policy_loss(bad, weight, labels, torch.randn(3, 1), backend=backend)
    pl.loss.backward()
    assert torch.isfinite(pl.loss) and torch.isfinite(weight.grad).all()


def test_compiled_call_refuses_a_non_finite_scored_row():
    torch._dynamo.reset()
    hidden, weight, labels = inputs()

    def step(h, w, y):
        return fused_logprobs(h, w, y, backend="chunked").logprobs.sum()

    compiled = torch.compile(step, fullgraph=True)
    assert torch.isfinite(compiled(hidden, weight, labels))
    with pytest.raises(ValueError, match="hidden must be finite"):
        compiled(poisoned(hidden, 2, 6, float("nan")), weight, labels)


def test_unchecked_call_makes_no_check():
    """check_inputs=False reads nothing on the host: the NaN goes through (the documented trade)."""
    hidden, weight, labels = inputs()
    out = fused_logprobs(poisoned(hidden, 1, 4, float("nan")), weight, labels, backend="chunked",
                         check_inputs=False)
    assert out.logprobs[1, 4].isnan()


@pytest.mark.parametrize("name", ["old_logprobs", "ref_logprobs", "rollout_logprobs"])
@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_logprobs_above_zero_are_refused(name, backend):
    hidden, weight, labels = inputs()
    with torch.no_grad():
        lp = fused_logprobs(hidden, weight, labels).logprobs
    given = {"old_logprobs": lp, name: lp}      # each with what reads it (a setting without effect is refused)
    extra = {"ref_logprobs": {"kl_coef": 0.1}, "rollout_logprobs": {"off_policy_threshold": 0.5}}.get(name, {})
    adv = torch.randn(3, 1)
    call = dict(given, **extra)
    fused_policy_loss(hidden, weight, labels, adv, backend=backend, **call)      # real log-probs run
    # the usual mistake: the sampled tokens' probabilities (the check reads the largest over the scored tokens,
    # so one probability above LOGPROB_MAX = 1e-3 is enough; log-probs may exceed 0 by float32 rounding only)
    probs = torch.rand(labels.shape).masked_fill(labels == -100, 0.0)
    with pytest.raises(ValueError, match=f"{name} must be log-probabilities") as err:
        fused_policy_loss(hidden, weight, labels, adv, backend=backend, **dict(call, **{name: probs}))
    assert "above 0" in str(err.value)
    # above 0 only where nothing is scored: accepted (ignored positions may hold anything)
    padded = given[name].masked_fill(labels == -100, 5.0)
    fused_policy_loss(hidden, weight, labels, adv, backend=backend, **dict(call, **{name: padded}))
