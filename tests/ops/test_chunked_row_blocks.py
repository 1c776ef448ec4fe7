"""The chunked backend's CPU row blocks (ops/chunked.py, ops/maths.row_blocks): each vocabulary chunk's statistics
and dlogits are taken block by block of token rows, and the chunks' statistics are merged into running ones. Small
blocks here, so that every call walks several blocks and several vocabulary chunks (a ragged last one of each):
against float64, with and without softcap, entropy, per-token temperatures and ignored rows."""
from __future__ import annotations

import pytest
import torch

from logitless import fused_logprobs
from logitless.ops import chunked, maths
from reference64 import check_op, make_inputs

N, H, V = 37, 96, 4099


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # an explicit budget: tiles of 1024 columns (4099 = 4 x 1024 + 3), 41 tokens a call; blocks of 5 rows
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(41 * 1024))
    monkeypatch.setattr(maths, "BLOCK_ELEMENTS", 5 * 1024)


def test_the_fixture_cuts_blocks_and_chunks():
    cpu = torch.device("cpu")
    assert chunked.stats_columns(N, V, cpu) == 1024
    assert len(maths.row_blocks(N, 1024, cpu)) == 8           # 7 blocks of 5 rows and one of 2
    assert chunked.chunk_rows(N, V, cpu) == 41 * 1024 // N    # the backward's chunks: 1134 columns, a ragged last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_row_blocks_match_float64(dtype, softcap):
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V, dtype=dtype, logit_std=6.0)
    labels[3] = labels[30] = -100
    temperature = torch.rand(N) * 1.5 + 0.5
    check_op(hidden, weight, labels, "chunked", temperature=temperature, softcap=softcap, elementwise=True)


def test_row_blocks_without_entropy_match_float64():
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V)
    check_op(hidden, weight, labels, "chunked", with_entropy=False, temperature=0.7)


def test_labels_in_every_chunk_and_at_its_edges():
    """Labels on the first and last column of a chunk and in the 3-column last chunk: each row's label logit is
    picked from its own chunk and block (a label read from another chunk's columns would be off by far more)."""
    hidden, weight, _ = make_inputs(lead=(N,), h=H, v=V)
    labels = torch.tensor([0, 1023, 1024, 2047, 4096, 4098, 3000] * 5 + [17, 4097])
    check_op(hidden, weight, labels, "chunked", elementwise=True)


def _direction_of_row(hidden: torch.Tensor, row: int) -> torch.Tensor:
    """A unit vector orthogonal to every other row of hidden (H > N): a weight row moved along it changes only
    that row's logits."""
    h = hidden.double()
    others = torch.cat([h[:row], h[row + 1:]])
    q, _ = torch.linalg.qr(others.t())              # [H, N - 1]: the other rows' span
    u = h[row] - q @ (q.t() @ h[row])
    return (u / u.norm()).float()


def test_the_merge_keeps_the_running_max_when_a_later_chunk_is_far_below():
    """Row 0's logits in the first chunk and row 1's in the 3-column last chunk sit ~30 above the rest of their row:
    the chunk statistics are rescaled onto the running max in both directions (the other chunks' exp(m - m') ~
    e^-30, below float32's epsilon); labels in the high chunks, so the log-probs stay small."""
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V)
    weight = weight.clone()
    for row, cols in ((0, slice(0, 1024)), (1, slice(4096, V))):
        u = _direction_of_row(hidden, row)
        weight[cols] += (30.0 / float(hidden[row] @ u)) * u
    for row, start in ((0, 0), (1, 4096)):     # each row's label: the largest logit of its high chunk
        labels[row] = start + int((weight[start:start + 1024].double() @ hidden[row].double()).argmax())
    # logits of ~30 carry float32 rounding of several ulps of 30 (3.8e-6): the reference backend's float32 logits
    # are off by as much (measured up to 2.5e-5 on both, 1 draw in 200)
    out = check_op(hidden, weight, labels, "chunked", elementwise=True, tol=(1e-4, 1e-4, 1e-4))
    assert out.logprobs[0] > -10 and out.logprobs[1] > -10          # the high chunk holds the row's mass
    assert torch.isfinite(out.entropy).all()


def test_the_same_bits_with_one_block_or_many(monkeypatch):
    """The row blocks cut only the token rows: a row's statistics are computed the same way in any block."""
    hidden, weight, labels = make_inputs(lead=(N,), h=H, v=V)
    many = fused_logprobs(hidden, weight, labels, backend="chunked")
    monkeypatch.setattr(maths, "BLOCK_ELEMENTS", 1 << 20)
    assert len(maths.row_blocks(N, 1024, torch.device("cpu"))) == 1
    one = fused_logprobs(hidden, weight, labels, backend="chunked")
    assert torch.equal(many.logprobs, one.logprobs) and torch.equal(many.entropy, one.entropy)
