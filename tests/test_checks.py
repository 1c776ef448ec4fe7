"""One rule per argument, whatever the entry point: the same bad temperature gets the same error type from
the op, the Megatron context and the transformers integration; a LOGITLESS_* knob that does not parse is
a ValueError naming the variable."""
import math

import pytest
import torch

from logitless import checks, fused_logprobs, knobs

BAD_TEMPERATURES = [
    (0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
    ("0.7", TypeError), (True, TypeError), (None, TypeError),
    (torch.tensor([0.5, 0.0, 1.0]), ValueError), (torch.tensor([0.5, math.nan, 1.0]), ValueError),
    (torch.tensor([0.5, 0.7, 1.0], requires_grad=True), ValueError),
    (torch.tensor([True, False, True]), TypeError), (torch.ones(3, dtype=torch.complex64), TypeError),
]


def _op(temperature):
    hidden, weight = torch.randn(3, 96), torch.randn(4099, 96)
    fused_logprobs(hidden, weight, torch.randint(0, 4099, (3,)), temperature=temperature, backend="chunked")


def _megatron(temperature):
    pytest.importorskip("megatron.core", reason="megatron-core not installed")
    from logitless.megatron import FusedOutputProcessorContext
    FusedOutputProcessorContext(temperature=temperature)


def _transformers(temperature):
    pytest.importorskip("transformers", reason="transformers not installed")
    from logitless.transformers.labels import per_token_temperature
    per_token_temperature(temperature, (3, 1), None, torch.device("cpu"))


@pytest.mark.parametrize("entry", [_op, _megatron, _transformers], ids=["op", "megatron", "transformers"])
@pytest.mark.parametrize("value, error", BAD_TEMPERATURES, ids=lambda v: repr(v)[:24])
def test_every_entry_point_refuses_a_bad_temperature_alike(entry, value, error):
    if isinstance(value, torch.Tensor) and entry is _transformers:
        value = value.view(3, 1) if value.dim() == 1 else value
    with pytest.raises(error, match="temperature"):
        entry(value)


def test_temperature_accepts_numbers_and_real_tensors():
    assert checks.temperature(2) == 2.0 and isinstance(checks.temperature(0.5), float)
    t = checks.temperature(torch.tensor([1, 2], dtype=torch.int32))
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="at most 2 dimensions"):
        checks.temperature(torch.ones(1, 1, 1), max_dim=2)
    with pytest.raises(ValueError, match="temperature is on"):
        checks.temperature(torch.ones(2), device=torch.device("meta"))
    # check_values=False skips the host-synchronising value check, nothing else
    assert checks.temperature(torch.zeros(2), check_values=False).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("check, args, error", [
    (checks.tensor, ([1.0], "x"), TypeError),
    (checks.index_tensor, (torch.ones(2), "labels"), TypeError),
    (checks.boolean, (1, "with_entropy"), TypeError),
    (checks.integer, (True, "dim"), TypeError),
    (checks.integer, (0, "tp_size", 1), ValueError),
    (checks.ignore_index, (2**63, "ignore_index"), ValueError),
    (checks.optional_positive_float, (0, "softcap"), ValueError),
])
def test_checks_name_the_argument(check, args, error):
    with pytest.raises(error, match=args[1]):
        check(*args)


@pytest.mark.parametrize("var, value, call", [
    ("LOGITLESS_CHUNK_ELEMENTS", "lots", lambda: knobs.chunk_elements(8)),
    ("LOGITLESS_CHUNK_ELEMENTS", "0", lambda: knobs.chunk_elements(8)),
    ("LOGITLESS_TRITON_DLOGITS_ELEMENTS", "-3", lambda: knobs.dlogits_elements(8)),
    ("LOGITLESS_TRITON_FWD", "128,256", lambda: knobs.triton_tiles("FWD")),
    ("LOGITLESS_TRITON_BWD", "a,b,c,d,e,f", lambda: knobs.triton_tiles("BWD")),
    ("LOGITLESS_POLICY_STATS_KERNEL", "gluon", knobs.policy_stats_kernel),
    ("LOGITLESS_TRITON_FWD_KERNEL", "gluon", knobs.forward_stats_kernel),
    ("LOGITLESS_CHUNKED_COLUMNS", "wide", knobs.chunked_columns),
])
def test_a_knob_that_does_not_parse_names_the_variable(monkeypatch, var, value, call):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        call()


def test_knobs_are_read_at_call_time(monkeypatch):
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", "4099")
    assert knobs.chunk_elements(8) == 4099
    monkeypatch.setenv("LOGITLESS_TRITON_FWD", "64,128,32,4,4,2")
    assert knobs.triton_tiles("FWD") == (64, 128, 32, 4, 4, 2)
    monkeypatch.setenv("LOGITLESS_POLICY_STATS_KERNEL", "Triton")
    assert knobs.policy_stats_kernel() == "triton"
    monkeypatch.setenv("LOGITLESS_TRITON_FWD_KERNEL", " TRITON ")
    assert knobs.forward_stats_kernel() == "triton"
    monkeypatch.setenv("LOGITLESS_CHUNKED_COLUMNS", " FIXED ")
    assert knobs.chunked_columns() == "fixed"
    monkeypatch.setenv("LOGITLESS_STRICT", "yes")
    assert knobs.strict()
    monkeypatch.delenv("LOGITLESS_STRICT")
    assert not knobs.strict() and knobs.triton_tma()


def test_the_op_uses_the_chunk_knob(monkeypatch):
    """A bad LOGITLESS_CHUNK_ELEMENTS surfaces from the op itself, naming the variable."""
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", "many")
    with pytest.raises(ValueError, match="LOGITLESS_CHUNK_ELEMENTS"):
        _op(1.0)
