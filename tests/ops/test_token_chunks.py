"""Token chunks: inputs with more tokens than one backend call takes are fed in chunks (ops/token_chunks.py).

Small knob budgets make every backend walk several token chunks here, with a ragged last one, ignored
rows spread over them, per-token temperatures, both stages: each result is checked against float64 and
every gradient element is bounded (a chunk written at the wrong offset, or not at all, would show). The
GPU check at N x V > 2^31 is benchmarks/gpu_large.py (the interpreter cannot run such sizes).
"""
from __future__ import annotations

import pytest
import torch

from logitless.ops import token_chunks
from logitless.ops.chunked import MIN_COLUMNS
from logitless.ops.registry import load_backend
from logitless.ops.triton.common import INTERPRETER_TILES, INTERPRETING
from reference64 import check_op, make_inputs

N, H, V = 53, 96, 1031     # 53 tokens: three full chunks of 16 and a ragged one of 5
CHUNK = 16
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"


@pytest.fixture
def small_chunks(monkeypatch):
    """Knobs so that one call of each backend takes CHUNK tokens (triton's interpreter tiles are 16 x 64)."""
    n_tiles = -(-V // INTERPRETER_TILES.block_n)
    if DEVICE == "cpu":
        monkeypatch.setenv("LOGITLESS_TRITON_STATS_BYTES", str(CHUNK * 12 * n_tiles))
        monkeypatch.setenv("LOGITLESS_TRITON_BWD_TOKENS", str(CHUNK))
    else:   # compiled kernels: the token tile is 128 (64 in float32), so chunks of one tile
        monkeypatch.setenv("LOGITLESS_TRITON_STATS_BYTES", "1")
        monkeypatch.setenv("LOGITLESS_TRITON_BWD_TOKENS", "1")
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(CHUNK * MIN_COLUMNS))
    monkeypatch.setenv("LOGITLESS_TRITON_DLOGITS_ELEMENTS", str(CHUNK * 128))


def count_calls(monkeypatch, backend: str) -> dict:
    """Count the backend's stats / grads calls and the tokens each was given."""
    mod = load_backend(backend)
    seen = {"stats": [], "grads": []}
    for stage in seen:
        real = getattr(mod, stage)

        def spy(hidden, *args, _real=real, _stage=stage, **kw):
            seen[_stage].append(hidden.shape[0])
            return _real(hidden, *args, **kw)
        monkeypatch.setattr(mod, stage, spy)
    return seen


@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_token_chunks_match_float64(backend, dtype, small_chunks, monkeypatch):
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V, dtype=dtype, device=DEVICE)
    labels[[0, 15, 16, 40, 52]] = -100          # ignored rows on chunk edges, and the very last row
    temperature = torch.rand(N, device=DEVICE) + 0.5
    seen = count_calls(monkeypatch, backend)
    out = check_op(hidden, weight, labels, backend, temperature=temperature, elementwise=True)
    assert (out.logprobs[[0, 15, 16, 40, 52]] == 0).all() and (out.entropy[[0, 52]] == 0).all()
    if DEVICE == "cpu":   # 48 kept rows: three chunks per stage
        assert seen["stats"] == [CHUNK] * 3 and seen["grads"] == [CHUNK] * 3, seen
    else:
        assert len(seen["stats"]) >= 1 and len(seen["grads"]) >= 1


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_chunks_without_ignored_rows_softcap_and_gradient_subsets(backend, small_chunks, monkeypatch):
    # every row kept: chunks are views of hidden, d_hidden written in place per chunk
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V, dtype=torch.bfloat16, logit_std=12.0,
                                         device=DEVICE)
    seen = count_calls(monkeypatch, backend)
    check_op(hidden, weight, labels, backend, temperature=0.8, softcap=8.0, elementwise=True)
    if DEVICE == "cpu":
        assert seen["stats"] == [16, 16, 16, 5] and seen["grads"] == [16, 16, 16, 5], seen
    check_op(hidden, weight, labels, backend, with_entropy=False, grad_hidden=False, elementwise=True)
    check_op(hidden, weight, labels, backend, b_scale=0.0, grad_weight=False, elementwise=True)


def test_token_rows_follow_the_knobs(small_chunks):
    hidden, weight, _ = make_inputs(lead=(N,), h=H, v=V, device=DEVICE)
    chunked = load_backend("chunked")
    assert chunked.token_rows("forward", hidden, weight, True) == CHUNK
    assert chunked.token_rows("backward", hidden, weight, True) == CHUNK
    if DEVICE == "cpu":
        triton = load_backend("triton")
        assert triton.token_rows("forward", hidden, weight, True) == CHUNK
        # two statistics per tile without entropy: the same budget holds more tokens, in whole tiles
        assert triton.token_rows("forward", hidden, weight, False) == 16 * (CHUNK * 12 // 8 // 16)
        assert triton.token_rows("backward", hidden, weight, True) == CHUNK
    assert load_backend("reference").token_rows("forward", hidden, weight, True) == N


def test_weight_gradient_accumulates_in_float32_across_chunks(small_chunks):
    # bf16 inputs, four chunks: d_weight must be summed in float32 and rounded once (a bf16 running sum
    # rounds after every chunk); compare with the float32 sum of one call over every token. On the CPU only:
    # on CUDA the chunked backend rounds dlogits to bf16 before its GEMMs, and cuBLAS reduces a chunk's and
    # the whole call's products in different orders, so the two differ by as much as this test isolates (seen
    # on the H200). The accumulation it checks is the same code on every device.
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V, dtype=torch.bfloat16, device="cpu")
    mod = load_backend("chunked")
    ones = torch.ones(N)
    lse, ent, _ = token_chunks.stats(mod, hidden, weight, labels, ones, None, True, None)
    g_lp, g_ent = torch.randn(N), torch.randn(N)
    dh, dw = token_chunks.grads(mod, hidden, weight, labels, ones, lse, ent, g_lp, g_ent, None, True, True, None)
    assert dh.dtype == dw.dtype == torch.bfloat16 and dh.shape == hidden.shape and dw.shape == weight.shape
    acc = torch.zeros(weight.shape)
    _, none = mod.grads(hidden, weight, labels, ones, lse, ent, g_lp, g_ent, False, True, dw_acc=acc)
    assert none is None and acc.abs().max() > 0
    # one rounding of the float32 total: within half a bf16 ulp (2^-8 relative), plus float32 order noise
    assert ((dw.float() - acc).abs() <= acc.abs() * 2 ** -8 + 1e-6 * acc.abs().max()).all()
