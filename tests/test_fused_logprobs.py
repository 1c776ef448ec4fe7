"""Accuracy of the public op on the backends that run on any device, against float64."""
from __future__ import annotations

import pytest
import torch

from logitless import fused_logprobs, last_backend
from reference64 import check_op as check
from reference64 import logprobs_entropy64, make_inputs

CPU_BACKENDS = ["reference", "chunked"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # force several vocab chunks with a ragged last one (4099 = 3 * 1301 + 196 at N = 7)
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(7 * 1301))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64(backend, dtype):
    check(*make_inputs(dtype=dtype), backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", [1, 7])
def test_token_counts(backend, n):
    check(*make_inputs(lead=(n,)), backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_three_d_inputs_and_int32_labels(backend):
    hidden, weight, labels = make_inputs(lead=(3, 5))
    check(hidden, weight, labels.int(), backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_non_contiguous_inputs(backend):
    hidden, weight, labels = make_inputs(lead=(5, 3))
    # transposed views: neither hidden nor weight is contiguous
    hidden_t = hidden.transpose(0, 1).contiguous().transpose(0, 1)
    weight_t = weight.t().contiguous().t()
    assert not hidden_t.is_contiguous() and not weight_t.is_contiguous()
    check(hidden_t, weight_t, labels, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("temperature", [1e-2, 0.7, 1e2])
def test_temperature_extremes(backend, temperature):
    # keep the tempered logits' std about 4, so fp32 rounding of z stays comparable across T
    check(*make_inputs(logit_std=4.0 * temperature), backend, temperature=temperature)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_per_token_and_per_sequence_temperature(backend):
    hidden, weight, labels = make_inputs(lead=(3, 4))
    per_token = torch.rand(3, 4) * 1.5 + 0.5
    check(hidden, weight, labels, backend, temperature=per_token)
    per_seq = torch.rand(3, 1) * 1.5 + 0.5
    check(hidden, weight, labels, backend, temperature=per_seq)


def _with_row_offsets(hidden, weight, offsets, column=None):
    """Append one feature so that logits[i, j] += offsets[i] * column[j] (column of ones by default)."""
    column = torch.ones(weight.shape[0]) if column is None else column
    h = torch.cat([hidden, offsets.unsqueeze(-1).to(hidden.dtype)], dim=-1)
    w = torch.cat([weight, column.unsqueeze(1).to(weight.dtype)], dim=1)
    return h, w


# Rows whose logits sit near +-120: float32 spacing there is 7.6e-6, and the H-term sums that make
# z round at that scale, so errors reach ~1e-4, above the
# 2e-5 meant for logits of order 1. A running max started at 0 gives inf / NaN here, not 5e-4.
LARGE_LOGIT_TOL = (5e-4, 5e-4, 1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_all_logits_of_a_row_negative(backend):
    hidden, weight, labels = make_inputs()
    # -120: far enough below 0 that a running max started at 0 (a peer's bug) underflows every exp
    h, w = _with_row_offsets(hidden, weight, torch.full((hidden.shape[0],), -120.0))
    assert (h.double() @ w.double().t()).max() < 0
    # float32 holds logits near -120 to ~8e-6: the tolerance scales with that (the bug gives inf/NaN)
    check(h, w, labels, backend, grad_features=hidden.shape[-1], tol=LARGE_LOGIT_TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_shift_invariance(backend):
    hidden, weight, labels = make_inputs()
    base = fused_logprobs(hidden, weight, labels, backend=backend)
    offsets = (torch.rand(hidden.shape[0]) - 0.5) * 240   # a different constant per row, up to +-120
    h, w = _with_row_offsets(hidden, weight, offsets)
    shifted = fused_logprobs(h, w, labels, backend=backend)
    assert (shifted.logprobs - base.logprobs).abs().max() <= LARGE_LOGIT_TOL[0]
    assert (shifted.entropy - base.entropy).abs().max() <= LARGE_LOGIT_TOL[1]
    check(h, w, labels, backend, grad_features=hidden.shape[-1], tol=LARGE_LOGIT_TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_one_logit_far_above_the_rest(backend):
    hidden, weight, labels = make_inputs()
    column = torch.zeros(weight.shape[0])
    column[1234] = 1.0
    h, w = _with_row_offsets(hidden, weight, torch.full((hidden.shape[0],), 50.0), column)
    # the outlier itself, and the row's least likely token (log-prob below -50)
    labels[0], labels[1] = 1234, int((hidden[1] @ weight.t()).argmin())
    out = check(h, w, labels, backend, grad_features=hidden.shape[-1])
    assert out.logprobs[1] < -40


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ignore_index_rows(backend):
    hidden, weight, labels = make_inputs(lead=(9,))
    labels[[0, 4, 8]] = -100
    h = hidden.clone().requires_grad_(True)
    out = fused_logprobs(h, weight, labels, backend=backend)
    assert (out.logprobs[[0, 4, 8]] == 0).all() and (out.entropy[[0, 4, 8]] == 0).all()
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert (h.grad[[0, 4, 8]] == 0).all() and (h.grad[[1, 2, 3]] != 0).any()
    check(hidden, weight, labels, backend)
    custom = labels.clone()
    custom[custom == -100] = 5000   # a custom ignore_index outside [0, V)
    check(hidden, weight, custom, backend, ignore_index=5000)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_loss_on_one_output_only(backend):
    hidden, weight, labels = make_inputs()
    check(hidden, weight, labels, backend, b_scale=0.0)   # log-probs only
    check(hidden, weight, labels, backend, a_scale=0.0)   # entropy only
    check(hidden, weight, labels, backend, with_entropy=False)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gradients_only_where_required(backend):
    hidden, weight, labels = make_inputs()
    check(hidden, weight, labels, backend, grad_weight=False)
    check(hidden, weight, labels, backend, grad_hidden=False)
    out = check(hidden, weight, labels, backend, grad_hidden=False, grad_weight=False)
    assert not out.logprobs.requires_grad


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_entropy_only_loss_reaches_hidden(backend):
    # the flatten inside the op must keep the link to the caller's tensor (a peer's bug)
    hidden, weight, labels = make_inputs(lead=(2, 3))
    h = hidden.clone().requires_grad_(True)
    fused_logprobs(h, weight, labels, backend=backend).entropy.sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_empty_token_batch(backend):
    _, weight, _ = make_inputs()
    h = torch.randn(0, 96, requires_grad=True)
    w = weight.clone().requires_grad_(True)
    out = fused_logprobs(h, w, torch.zeros(0, dtype=torch.long), backend=backend)
    assert out.logprobs.shape == (0,) and out.entropy.shape == (0,)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == (0, 96) and (w.grad == 0).all()


# ------------------------------------------------ softcap: z = c * tanh(hidden @ weight.T / c) / T
# Raw logits of std 12 against a cap of 8: most logits are bent by the tanh, the largest saturate.
SOFTCAP, CAPPED_STD = 8.0, 12.0


def assert_cap_is_active(hidden, weight, labels, temperature=1.0):
    """Guard against inputs on which softcap=None would pass the softcap tests too."""
    capped, _ = logprobs_entropy64(hidden, weight, labels, temperature, -100, SOFTCAP)
    plain, _ = logprobs_entropy64(hidden, weight, labels, temperature, -100)
    assert (capped - plain).abs().max() > 0.5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_float64(backend, dtype):
    hidden, weight, labels = make_inputs(dtype=dtype, logit_std=CAPPED_STD)
    assert_cap_is_active(hidden, weight, labels, 0.7)
    check(hidden, weight, labels, backend, temperature=0.7, softcap=SOFTCAP)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_per_token_temperature_and_ignored_rows(backend, dtype):
    hidden, weight, labels = make_inputs(lead=(3, 4), dtype=dtype, logit_std=CAPPED_STD)
    labels[0, 1] = labels[2, 3] = -100
    per_token = torch.rand(3, 4) * 1.5 + 0.5
    out = check(hidden, weight, labels, backend, temperature=per_token, softcap=SOFTCAP)
    assert out.logprobs[0, 1] == 0 and out.entropy[2, 3] == 0
    h = hidden.clone().requires_grad_(True)
    res = fused_logprobs(h, weight, labels, temperature=per_token, softcap=SOFTCAP, backend=backend)
    (res.logprobs.sum() + res.entropy.sum()).backward()
    assert (h.grad[0, 1] == 0).all() and (h.grad[2, 3] == 0).all() and (h.grad[1] != 0).any()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_softcap_without_entropy_and_gradient_subsets(backend):
    hidden, weight, labels = make_inputs(logit_std=CAPPED_STD)
    check(hidden, weight, labels, backend, temperature=1.3, softcap=SOFTCAP, with_entropy=False)
    check(hidden, weight, labels, backend, softcap=SOFTCAP, grad_weight=False)
    check(hidden, weight, labels, backend, softcap=SOFTCAP, grad_hidden=False, b_scale=0.0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_softcap_saturated_logits(backend):
    # raw logits of std 200 against a cap of 5: nearly every tanh is within 1e-6 of +-1 and its
    # derivative tiny; nothing may overflow or lose the gradient of the few unsaturated logits
    hidden, weight, labels = make_inputs(logit_std=200.0)
    out = check(hidden, weight, labels, backend, softcap=5.0, temperature=0.5)
    assert out.logprobs.min() > -21.0   # |z| <= 10 after the cap: no log-prob below -20 - log V


def test_backends_agree_with_each_other_on_bf16():
    hidden, weight, labels = make_inputs(dtype=torch.bfloat16, lead=(2, 7))
    a = fused_logprobs(hidden, weight, labels, backend="reference")
    b = fused_logprobs(hidden, weight, labels, backend="chunked")
    assert (a.logprobs - b.logprobs).abs().max() <= 1e-4
    assert (a.entropy - b.entropy).abs().max() <= 1e-4


def test_auto_on_cpu_picks_chunked():
    fused_logprobs(*make_inputs(), backend="auto")
    assert last_backend() == "chunked"


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["triton"])
def test_non_finite_hidden_on_an_ignored_row_stays_out(backend):
    # ignored rows never reach a backend: 0 * inf there would otherwise poison every row of d_weight
    # triton runs on CUDA tensors where there is a GPU, else in its interpreter on CPU tensors
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    hidden, weight, labels = make_inputs(lead=(9,), device=device)
    hidden[4] = float("inf")
    hidden[6] = float("nan")
    labels[4] = labels[6] = -100
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fused_logprobs(h, w, labels, backend=backend)
    assert out.logprobs[4] == 0 and out.entropy[6] == 0 and torch.isfinite(out.logprobs).all()
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()
    assert (h.grad[[4, 6]] == 0).all()
    keep = labels != -100
    check(hidden[keep], weight, labels[keep], backend)


def test_per_sequence_temperature_must_not_be_one_dimensional():
    hidden, weight, labels = make_inputs(lead=(4, 4))   # b == s: broadcasting [b] would pick positions
    with pytest.raises(ValueError, match="ambiguous"):
        fused_logprobs(hidden, weight, labels, temperature=torch.rand(4) + 0.5)


def test_second_order_gradients_are_refused():
    hidden, weight, labels = make_inputs()
    h = hidden.clone().requires_grad_(True)
    out = fused_logprobs(h, weight, labels)
    (g,) = torch.autograd.grad(out.logprobs.sum(), h, create_graph=True)
    with pytest.raises(RuntimeError, match="grad"):
        g.sum().backward()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_without_entropy_in_the_labels_shape(backend):
    """with_entropy=False on [b, s] labels: log-probs in that shape, entropy None (the MTP path calls it so)."""
    torch.manual_seed(11)
    hidden, weight = torch.randn(3, 7, 96), torch.randn(4099, 96)
    labels = torch.randint(0, 4099, (3, 7))
    out = fused_logprobs(hidden, weight, labels, with_entropy=False, backend=backend)
    assert out.entropy is None and out.logprobs.shape == (3, 7)
    want = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(out.logprobs.double(), want, atol=1e-5)
