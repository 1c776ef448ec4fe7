"""Bad input gets a clear TypeError/ValueError naming the argument, before any kernel runs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from logitless import fused_logprobs

N, H, V = 7, 48, 1031


def inputs():
    return torch.randn(N, H), torch.randn(V, H) * 0.3, torch.randint(0, V, (N,))


@pytest.mark.parametrize("case, exc, match", [
    ("hidden_not_tensor", TypeError, "hidden"),
    ("weight_not_tensor", TypeError, "weight"),
    ("labels_not_tensor", TypeError, "labels"),
    ("hidden_int", TypeError, "hidden"),
    ("dtype_mismatch", TypeError, "weight dtype"),
    ("h_mismatch", ValueError, "H="),
    ("weight_1d", ValueError, "weight must be 2-D"),
    ("empty_vocab", ValueError, "empty vocabulary"),
    ("leading_shape", ValueError, "labels shape"),
    ("float_labels", TypeError, "labels must be int32 or int64"),
    ("label_too_big", ValueError, r"labels must lie in \[0, 1031\)"),
    ("label_negative", ValueError, "labels must lie"),
    ("device_mismatch", ValueError, "weight is on meta"),
    ("labels_device", ValueError, "labels are on meta"),
    ("temperature_zero", ValueError, "temperature"),
    ("temperature_negative", ValueError, "temperature"),
    ("temperature_nan", ValueError, "temperature"),
    ("temperature_inf", ValueError, "temperature"),
    ("temperature_str", TypeError, "temperature"),
    ("temperature_bool", TypeError, "temperature"),
    ("temperature_shape", ValueError, "does not broadcast"),
    ("temperature_tensor_zero", ValueError, "temperature"),
    ("temperature_tensor_nan", ValueError, "temperature"),
    ("temperature_requires_grad", ValueError, "temperature"),
    ("with_entropy_str", TypeError, "with_entropy"),
    ("ignore_index_float", TypeError, "ignore_index"),
    ("ignore_index_huge", ValueError, "ignore_index"),
    ("unknown_backend", ValueError, "backend must be one of"),
    ("backend_not_str", TypeError, "backend"),
    ("softcap_zero", ValueError, "softcap"),
    ("softcap_negative", ValueError, "softcap"),
    ("softcap_nan", ValueError, "softcap"),
    ("softcap_inf", ValueError, "softcap"),
    ("softcap_bool", TypeError, "softcap"),
    ("softcap_str", TypeError, "softcap"),
    ("softcap_tensor", TypeError, "softcap"),
    ("softcap_too_large", ValueError, r"softcap must be None or in \[1e-06, 1e\+06\], got 1e\+300"),
    ("softcap_too_small", ValueError, r"softcap must be None or in \[1e-06, 1e\+06\], got 1e-50"),
    ("no_features", ValueError, r"no features \(H == 0\)"),
    ("temperature_tiny", ValueError, r"temperature must be finite and >= 1e-30 .*got 1e-50"),
    ("temperature_tensor_tiny", ValueError, "temperature must be finite and >= 1e-30 everywhere"),
    ("temperature_tensor_inf", ValueError, "temperature must be finite and >= 1e-30 everywhere"),
    ("mixed_dtypes", TypeError, "differs from hidden dtype .* under torch.autocast only"),
    ("reduce_grad_hidden_without_group", ValueError, "reduce_grad_hidden=False has no effect without tp_group"),
])
def test_bad_input_is_named(case, exc, match):
    h, w, y = inputs()
    kw = {}
    if case == "hidden_not_tensor":
        h = h.tolist()
    elif case == "weight_not_tensor":
        w = w.numpy()
    elif case == "labels_not_tensor":
        y = y.tolist()
    elif case == "hidden_int":
        h, w = h.long(), w.long()
    elif case == "dtype_mismatch":
        w = w.double()
    elif case == "no_features":
        h, w = torch.randn(N, 0), torch.randn(V, 0)
    elif case == "mixed_dtypes":
        h = h.bfloat16()
    elif case == "h_mismatch":
        w = torch.randn(V, H + 1)
    elif case == "weight_1d":
        w = torch.randn(H)
    elif case == "empty_vocab":
        w = torch.randn(0, H)
    elif case == "leading_shape":
        y = torch.randint(0, V, (N + 1,))
    elif case == "float_labels":
        y = y.float()
    elif case == "label_too_big":
        y[3] = V
    elif case == "label_negative":
        y[3] = -1
    elif case == "device_mismatch":
        w = torch.empty(V, H, device="meta")
    elif case == "labels_device":
        y = torch.empty(N, dtype=torch.long, device="meta")
    elif case.startswith("temperature"):
        kw["temperature"] = {
            "temperature_zero": 0.0, "temperature_negative": -1.0, "temperature_nan": float("nan"),
            "temperature_inf": float("inf"), "temperature_str": "1.0", "temperature_bool": True,
            "temperature_shape": torch.ones(N + 2),
            "temperature_tensor_zero": torch.tensor([1.0] * (N - 1) + [0.0]),
            "temperature_tensor_nan": torch.tensor([1.0] * (N - 1) + [float("nan")]),
            "temperature_requires_grad": torch.ones(N, requires_grad=True),
            "temperature_tiny": 1e-50,
            "temperature_tensor_tiny": torch.tensor([1.0] * (N - 1) + [1e-50], dtype=torch.float64),
            "temperature_tensor_inf": torch.tensor([1.0] * (N - 1) + [float("inf")]),
        }[case]
    elif case == "reduce_grad_hidden_without_group":
        kw["reduce_grad_hidden"] = False
    elif case == "with_entropy_str":
        kw["with_entropy"] = "yes"
    elif case == "ignore_index_float":
        kw["ignore_index"] = -100.0
    elif case == "ignore_index_huge":
        kw["ignore_index"] = 2 ** 70
    elif case == "unknown_backend":
        kw["backend"] = "cuda_magic"
    elif case == "backend_not_str":
        kw["backend"] = None
    elif case.startswith("softcap"):
        kw["softcap"] = {
            "softcap_zero": 0.0, "softcap_negative": -30.0, "softcap_nan": float("nan"),
            "softcap_inf": float("inf"), "softcap_bool": True, "softcap_str": "30",
            "softcap_tensor": torch.tensor(30.0), "softcap_too_large": 1e300, "softcap_too_small": 1e-50,
        }[case]
    with pytest.raises(exc, match=match):
        fused_logprobs(h, w, y, **kw)


@pytest.mark.parametrize("backend", ["reference", "chunked", "triton"])
def test_bad_softcap_is_refused_before_any_kernel(backend):
    h, w, y = inputs()
    with pytest.raises(ValueError, match="softcap"):
        fused_logprobs(h, w, y, softcap=-1.0, backend=backend)


def test_integer_softcap_is_accepted():
    h, w, y = inputs()
    a = fused_logprobs(h, w, y, softcap=30)
    b = fused_logprobs(h, w, y, softcap=30.0)
    assert torch.equal(a.logprobs, b.logprobs)


def test_ignore_index_labels_are_not_range_checked():
    h, w, y = inputs()
    y[2] = -100
    out = fused_logprobs(h, w, y)
    assert out.logprobs[2] == 0 and torch.isfinite(out.logprobs).all()


def test_triton_on_cpu_without_interpreter_says_why():
    # the interpreter is chosen when triton is imported, so this needs a fresh process without it
    code = ("import torch, logitless\n"
            "h = torch.randn(3, 8); w = torch.randn(11, 8); y = torch.randint(0, 11, (3,))\n"
            "try:\n    logitless.fused_logprobs(h, w, y, backend='triton')\n"
            "except RuntimeError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ERR backend 'triton' cannot run" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "TRITON_INTERPRET" in out.stdout or "cannot be imported" in out.stdout


@pytest.mark.parametrize("backend", ["chunked", "reference", "triton"])
@pytest.mark.parametrize("temperature", [1e-30, 1e30, 1e300, "float64 tensor 1e300"])
def test_extreme_temperatures_are_exact(backend, temperature):
    # the supported range's ends: 1 / T scales float32 logits; a huge T (1 / T below float32's range) gives
    # every logit the float32 value of raw / T, the uniform softmax
    from reference64 import logprobs_entropy64
    h, w, y = inputs()
    if temperature == "float64 tensor 1e300":
        temperature = torch.full((N,), 1e300, dtype=torch.float64)
    out = fused_logprobs(h, w, y, temperature=temperature, backend=backend)
    lp64, ent64 = logprobs_entropy64(h, w, y, temperature)
    # relative: at T = 1e-30 the log-probs are ~1e30
    assert ((out.logprobs - lp64).abs() / lp64.abs().clamp_min(1.0)).max() <= 2e-6
    assert (out.entropy - ent64).abs().max() <= 2e-5


@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("softcap", [1e-6, 0.7, 30.0, 1e4, 1e6])
def test_softcap_range_is_exact(backend, softcap):
    # the triton tile's tanh keeps full relative precision near 0, where large caps put every logit
    from reference64 import logprobs_entropy64
    h, w, y = inputs()
    out = fused_logprobs(h, w, y, softcap=softcap, backend=backend)
    lp64, ent64 = logprobs_entropy64(h, w, y, softcap=softcap)
    assert (out.logprobs - lp64).abs().max() <= 2e-5 and (out.entropy - ent64).abs().max() <= 2e-5
