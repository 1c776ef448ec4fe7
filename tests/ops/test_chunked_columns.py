"""Where the chunked backend's forward cuts the vocabulary (LOGITLESS_CHUNKED_COLUMNS, ops/chunked.py).

"fixed": the same columns for every batch, on any device (a function of the vocabulary and the tile budget);
"batch": the budget over the call's tokens; "auto": fixed on CPU, batch on CUDA. The column rule is checked for a
CUDA device without a GPU (it reads only the device type); the values under both rules against float64 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from logitless import fused_logprobs
from logitless.ops import chunked
from reference64 import check_op, make_inputs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")   # a device object only: nothing runs on it
TOKENS = (1, 7, 16, 300, 4096, 4103, 12288, 16384)


def _widths(device, vocab=151936):
    return [chunked.stats_columns(n, vocab, device) for n in TOKENS]


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("budget", [None, 5 * 1024 + 17])
def test_fixed_columns_are_the_same_for_every_batch(device, budget, monkeypatch):
    monkeypatch.setenv("LOGITLESS_CHUNKED_COLUMNS", "fixed")
    if budget is not None:
        monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(budget))
    widths = set(_widths(device))
    # the budget over the most tokens of a call: 2^24 / 16384 (CUDA) = 1024, 2^23 / 1024 (CPU) = 8192; an explicit
    # budget keeps 1024 columns on both: 5137 // 5
    default = {"cpu": 8192, "cuda": 1024}[device.type]
    assert widths == {default if budget is None else budget // (budget // 1024)}
    assert chunked.stats_columns(7, 1000, device) == min(1000, widths.pop())    # never wider than the vocabulary


def test_the_default_rule_is_fixed_on_cpu_and_batch_on_cuda(monkeypatch):
    monkeypatch.delenv("LOGITLESS_CHUNKED_COLUMNS", raising=False)
    assert len(set(_widths(CPU))) == 1
    cuda = _widths(CUDA)
    assert cuda == [min(151936, (1 << 24) // n) for n in TOKENS]      # 2^24 / N columns: changes with N
    monkeypatch.setenv("LOGITLESS_CHUNKED_COLUMNS", "batch")
    assert _widths(CUDA) == cuda and _widths(CPU) == [min(151936, (1 << 23) // n) for n in TOKENS]
    monkeypatch.setenv("LOGITLESS_CHUNKED_COLUMNS", " Auto ")
    assert _widths(CUDA) == cuda


def test_a_bad_columns_knob_names_the_variable(monkeypatch):
    hidden, weight, labels = make_inputs(lead=(7,), h=96, v=1031)
    monkeypatch.setenv("LOGITLESS_CHUNKED_COLUMNS", "wide")
    with pytest.raises(ValueError, match="LOGITLESS_CHUNKED_COLUMNS"):
        fused_logprobs(hidden, weight, labels, backend="chunked")


@pytest.mark.parametrize("rule", ["fixed", "batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_column_rules_match_float64(rule, dtype, monkeypatch):
    """A 5137-element budget: calls of at most 5 tokens (6 kept here: calls of 5 and 1); "fixed" cuts both at 1027
    columns, "batch" the one-token call at 4099 (the whole vocabulary): both give float64's values."""
    monkeypatch.setenv("LOGITLESS_CHUNKED_COLUMNS", rule)
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(5 * 1024 + 17))
    hidden, weight, labels = make_inputs(lead=(7,), h=96, v=4099, dtype=dtype)
    labels[3] = -100
    widths = []
    real = chunked.stats_columns
    monkeypatch.setattr(chunked, "stats_columns", lambda n, v, d: widths.append(real(n, v, d)) or widths[-1])
    temperature = torch.rand(7) + 0.5
    check_op(hidden, weight, labels, "chunked", temperature=temperature, elementwise=True)
    assert widths == ([1027, 1027] if rule == "fixed" else [1027, 4099])
