"""The Triton backend's real kernels against float64, on small odd shapes.

Without a GPU these run in triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), with the
interpreter's small tiles (16 x 64 x 32): V = 1031 leaves a last vocabulary tile of 7 real columns and
57 padded ones, H = 100 a ragged last K tile, and a small dlogits budget makes the backward walk
several vocabulary chunks with a ragged last one. On a CUDA machine the same tests run the compiled
kernels on the GPU (with the GPU's tiles, where every shape here is ragged too).

Float32 operands run with precision="ieee" here (the default on the CPU; on CUDA the default is the bf16x3
split, which runs the half-precision kernels that the bfloat16 cases test): these hold the float32 kernels to
float32's own error. The default on CUDA is checked at its own bounds in test_compiled_kernels_on_cuda and
tests/test_precision.py.
"""
from __future__ import annotations

import pytest
import torch

from logitless import fused_logprobs, last_precision
from logitless.ops.triton import backend as triton_backend
from logitless.ops.triton.common import INTERPRETING
from reference64 import check_op, logprobs_entropy64
from reference64 import make_inputs as shared_inputs

DEVICE = "cpu" if INTERPRETING or not torch.cuda.is_available() else "cuda"



@pytest.fixture(autouse=True)
def several_backward_chunks(monkeypatch):
    # 7 tokens x 128 columns -> chunks of 128 vocabulary rows; 1031 = 8 * 128 + 7
    monkeypatch.setenv("LOGITLESS_TRITON_DLOGITS_ELEMENTS", str(7 * 128))


def make_inputs(lead=(7,), h=96, v=1031, dtype=torch.float32, logit_std=4.0):
    """Shared inputs (tests/reference64.py) on this file's device, V = 1031 by default."""
    return shared_inputs(lead, h, v, dtype, logit_std, device=DEVICE)


def check(hidden, weight, labels, **kw):
    """The shared float64 comparison (tests/reference64.py) through backend="triton", every gradient
    element bounded too (an unwritten tile would hide in a norm); float32 operands with IEEE float32
    products unless ``precision`` says otherwise."""
    if hidden.dtype == torch.float32:
        kw.setdefault("precision", "ieee")
    return check_op(hidden, weight, labels, "triton", elementwise=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_float64(dtype):
    check(*make_inputs(dtype=dtype), temperature=0.7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_temperature_and_ignored_rows(dtype):
    hidden, weight, labels = make_inputs(dtype=dtype)
    labels[1] = labels[4] = -100
    temperature = torch.rand(7, device=DEVICE) + 0.5
    out = check(hidden, weight, labels, temperature=temperature)
    assert out.logprobs[1] == 0 and out.entropy[4] == 0


def test_ignored_rows_get_no_gradient():
    hidden, weight, labels = make_inputs()
    labels[2] = 7                      # 7 is the ignore_index below: not a label
    h = hidden.clone().requires_grad_()
    out = fused_logprobs(h, weight, labels, ignore_index=7, backend="triton")
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert h.grad[2].abs().max() == 0 and h.grad.abs().sum() > 0


def test_three_dimensional_ragged_k():
    # [2, 5, 100]: H = 100 is not a multiple of the K tile; per-sequence temperature [2, 1]
    hidden, weight, labels = make_inputs(lead=(2, 5), h=100)
    labels[0, 3] = -100
    check(hidden, weight, labels, temperature=torch.tensor([[0.8], [1.3]], device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_entropy(dtype):
    check(*make_inputs(dtype=dtype), with_entropy=False, temperature=1.3)


@pytest.mark.parametrize("dtype,h", [(torch.float32, 96), (torch.bfloat16, 100)])
def test_pointer_loads(dtype, h, monkeypatch):
    # the path for layouts the bulk copy engine cannot take (and with bf16 H = 100, a masked last K tile)
    monkeypatch.setenv("LOGITLESS_TRITON_TMA", "0")
    check(*make_inputs(h=h, dtype=dtype), temperature=0.8)


def test_int32_labels():
    hidden, weight, labels = make_inputs()
    check(hidden, weight, labels.int())


def test_non_contiguous_inputs():
    hidden, weight, labels = make_inputs(lead=(7,), h=96)
    hidden_t = hidden.t().contiguous().t()             # column-major [7, 96]
    wide = torch.randn(1031, 192, device=DEVICE)
    wide[:, ::2] = weight
    weight_strided = wide[:, ::2]                       # row stride 192, column stride 2
    assert not hidden_t.is_contiguous() and not weight_strided.is_contiguous()
    check(hidden_t, weight_strided, labels, temperature=0.9)


@pytest.mark.parametrize("grad_hidden,grad_weight", [(True, False), (False, True), (False, False)])
def test_gradients_only_where_required(grad_hidden, grad_weight):
    check(*make_inputs(dtype=torch.bfloat16), grad_hidden=grad_hidden, grad_weight=grad_weight)


def test_all_logits_negative():
    # a constant last feature shifts every logit by about -120: a running max started at 0 instead of
    # -inf would underflow every exp to 0 here
    hidden, weight, labels = make_inputs(h=48)
    hidden[:, -1] = 1.0
    weight[:, -1] = -120.0
    # d_hidden's last feature cancels exactly; float32 rounding times 120 is all it holds: not compared
    out = check(hidden, weight, labels, grad_hidden=False)
    assert out.entropy.min() > 0


def test_large_outlier_logit():
    # one vocabulary row sits at about +50 for every token: nearly all mass there
    hidden, weight, labels = make_inputs(h=48)
    hidden[:, -1] = 1.0
    weight[:, -1] = 0.0
    weight[517, -1] = 50.0
    labels[0], labels[1] = 517, 3
    check(hidden, weight, labels)


def test_padded_last_tile_carries_no_mass():
    # every label of one distribution: the probabilities must sum to 1 and every log-prob be <= 0.
    # V = 131 leaves 3 real columns in the last tile of 64.
    v = 131
    hidden, weight, _ = make_inputs(lead=(1,), h=48, v=v)
    out = fused_logprobs(hidden.expand(v, 48), weight, torch.arange(v, device=DEVICE), backend="triton")
    assert (out.logprobs <= 0).all()
    assert abs(out.logprobs.double().exp().sum().item() - 1.0) <= 1e-5
    assert torch.allclose(out.entropy, out.entropy[0].expand(v))


def test_labels_in_first_and_last_column():
    hidden, weight, labels = make_inputs()
    labels[0], labels[1], labels[2] = 0, 1030, 1024     # 1024: first column of the padded last tile
    check(hidden, weight, labels)


# ------------------------------------------------ softcap: z = c * tanh(hidden @ weight.T / c) / T
# Raw logits of std 12 against a cap of 8: most logits bent by the tanh, the largest saturated.
SOFTCAP, CAPPED_STD = 8.0, 12.0


def capped_inputs(**kw):
    hidden, weight, labels = make_inputs(logit_std=CAPPED_STD, **kw)
    capped, _ = logprobs_entropy64(hidden, weight, labels, softcap=SOFTCAP)
    plain, _ = logprobs_entropy64(hidden, weight, labels)
    assert (capped - plain).abs().max() > 0.5   # inputs on which ignoring the cap would fail
    return hidden, weight, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_float64(dtype):
    check(*capped_inputs(dtype=dtype), temperature=0.7, softcap=SOFTCAP)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_per_token_temperature_and_ignored_rows(dtype):
    hidden, weight, labels = capped_inputs(dtype=dtype)
    labels[1] = labels[4] = -100
    temperature = torch.rand(7, device=DEVICE) + 0.5
    out = check(hidden, weight, labels, temperature=temperature, softcap=SOFTCAP)
    assert out.logprobs[1] == 0 and out.entropy[4] == 0
    h = hidden.clone().requires_grad_()
    res = fused_logprobs(h, weight, labels, temperature=temperature, softcap=SOFTCAP, backend="triton")
    (res.logprobs.sum() + res.entropy.sum()).backward()
    assert h.grad[1].abs().max() == 0 and h.grad[4].abs().max() == 0 and h.grad.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_without_entropy(dtype):
    check(*capped_inputs(dtype=dtype), with_entropy=False, temperature=1.3, softcap=SOFTCAP)


@pytest.mark.parametrize("grad_hidden,grad_weight", [(True, False), (False, True)])
def test_softcap_gradients_only_where_required(grad_hidden, grad_weight):
    check(*capped_inputs(dtype=torch.bfloat16), softcap=SOFTCAP, grad_hidden=grad_hidden, grad_weight=grad_weight)


def test_softcap_pointer_loads_ragged_k(monkeypatch):
    # pointer loads with a masked last K tile (H = 100): clamped padding rows / columns go through the tanh too
    monkeypatch.setenv("LOGITLESS_TRITON_TMA", "0")
    hidden, weight, labels = capped_inputs(h=100)
    labels[0], labels[1] = 0, 1030     # first column, and the last real column of the padded last tile
    check(hidden, weight, labels, temperature=0.9, softcap=SOFTCAP)


def test_softcap_saturated_logits():
    # raw logits of std 200 against a cap of 5: the exp2 form of tanh must neither overflow nor lose the
    # unsaturated logits' gradient
    hidden, weight, labels = make_inputs(logit_std=200.0)
    out = check(hidden, weight, labels, temperature=0.5, softcap=5.0)
    assert out.logprobs.min() > -21.0   # |z| <= 10 after the cap


def test_softcap_padded_last_tile_carries_no_mass():
    # padding is masked after the tanh: tanh(-inf) would be -1, a real logit
    v = 131
    hidden, weight, _ = make_inputs(lead=(1,), h=48, v=v, logit_std=CAPPED_STD)
    out = fused_logprobs(hidden.expand(v, 48), weight, torch.arange(v, device=DEVICE), softcap=SOFTCAP,
                         backend="triton")
    assert (out.logprobs <= 0).all()
    assert abs(out.logprobs.double().exp().sum().item() - 1.0) <= 1e-5


def test_availability():
    cpu = torch.zeros(2, 3)
    if INTERPRETING:
        assert triton_backend.unavailable_reason(cpu, cpu) is None
    else:
        assert "TRITON_INTERPRET=1" in triton_backend.unavailable_reason(cpu, cpu)
    if torch.cuda.is_available():
        gpu = cpu.cuda()
        assert triton_backend.unavailable_reason(gpu, gpu) is None
    meta = torch.empty(2, 3, device="meta")
    assert "CUDA" in triton_backend.unavailable_reason(meta, meta)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(triton_backend, "INTERPRETING", False)
    hidden, weight, labels = (t.cpu() for t in make_inputs())
    assert "TRITON_INTERPRET=1" in triton_backend.unavailable_reason(hidden, weight)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_logprobs(hidden, weight, labels, backend="triton")


@pytest.mark.skipif(DEVICE != "cuda", reason="compiled (non-interpreted) kernels need a CUDA GPU")
@pytest.mark.parametrize("dtype,precision", [(torch.bfloat16, None), (torch.float32, "ieee"), (torch.float32, None)])
def test_compiled_kernels_on_cuda(dtype, precision, monkeypatch):
    """Larger shapes with the GPU's own tiles and dlogits chunks; float32 operands both ways: IEEE float32
    (float32's bounds) and the default (the bf16x3 split with bfloat16 gradient products, at their bounds)."""
    monkeypatch.delenv("LOGITLESS_TRITON_DLOGITS_ELEMENTS")
    want = {(torch.bfloat16, None): ("native", "native"), (torch.float32, "ieee"): ("ieee", "ieee"),
            (torch.float32, None): ("bf16x3", "bf16")}[dtype, precision]
    hidden, weight, labels = make_inputs(lead=(300,), h=200, v=5003, dtype=dtype)
    labels[::7] = -100
    check(hidden, weight, labels, temperature=torch.rand(300, device=DEVICE) + 0.5, precision=precision)
    assert last_precision() == want
    hidden, weight, labels = make_inputs(lead=(300,), h=200, v=5003, dtype=dtype, logit_std=CAPPED_STD)
    labels[::7] = -100
    check(hidden, weight, labels, temperature=torch.rand(300, device=DEVICE) + 0.5, softcap=SOFTCAP,
          precision=precision)
    assert last_precision() == want


@pytest.mark.skipif(DEVICE != "cuda", reason="TF32 exists on CUDA only")
@pytest.mark.parametrize("backend", ["triton", "chunked"])
@pytest.mark.parametrize("precision", [None, "ieee"])
def test_a_global_tf32_switch_changes_nothing(backend, precision, monkeypatch):
    """A trainer's torch.backends.cuda.matmul.allow_tf32 = True must not change what runs on float32
    operands: the default stays the bf16x3 split on CUDA, "ieee" stays IEEE float32 (TF32 would cost ~3e-4
    relative, 1e-3 in log-probs here) in the forward, d_hidden and d_weight. The same precision is recorded,
    the same log-probs and entropy come out as without the switch, within that precision's bounds of float64,
    and the switch is left as the caller set it."""
    monkeypatch.delenv("LOGITLESS_TRITON_DLOGITS_ELEMENTS", raising=False)
    want = ("bf16x3", "bf16") if precision is None else ("ieee", "ieee")
    hidden, weight, labels = make_inputs(lead=(300,), h=200, v=5003)
    outs = []
    # saved and restored by hand: torch 2.11's matmul settings object is not an ordinary attribute holder, and
    # monkeypatch's undo failed on it on an H100 (AttributeError at teardown)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        for switch in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = switch
            outs.append(check_op(hidden, weight, labels, backend, elementwise=backend == "triton", temperature=0.8,
                                 precision=precision))
            assert last_precision() == want, switch
            assert torch.backends.cuda.matmul.allow_tf32 == switch
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    assert torch.equal(outs[0].logprobs, outs[1].logprobs) and torch.equal(outs[0].entropy, outs[1].entropy)
