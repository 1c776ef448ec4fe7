"""The above-threshold kernel (``logitless.ops.triton.above_select``): every tempered logit z >= tau per token,
compiled on a GPU, else through triton's interpreter on the CPU: the ids against float64 (away from the bound),
the counts exact also past the slots, no id twice, and the values the selection kernel's own bits
(``topk_select``: the same tiles and arithmetic), with temperatures, a softcap and a token with no match."""
from __future__ import annotations

import pytest
import torch

from logitless.ops.triton import above_select, topk_select
from logitless.ops.triton.above_select import above
from reference64 import device_for

DEV = device_for("triton")
N, H, V = 7, 96, 1031


def operands(dtype, seed, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * (scale / H ** 0.5)).to(dtype)
    inv_temp = 0.5 + torch.rand(N, generator=gen)
    return hidden, weight, inv_temp


def logits64(hidden, weight, inv_temp, softcap):
    raw = hidden.double() @ weight.double().T
    if softcap is not None:
        raw = torch.tanh(raw / softcap) * softcap
    return raw * inv_temp.double().unsqueeze(1)


@pytest.mark.parametrize("dtype,offsets", [(torch.bfloat16, "int32"), (torch.float16, "int32"),
                                           (torch.bfloat16, "int64")])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_ids_counts_and_values(dtype, offsets, softcap, monkeypatch):
    """Every id above its token's bound, counted, with the selection kernel's values; the slots' offsets in int32
    (below 2^31) and in int64 (the bound lowered to run them)."""
    if offsets == "int64":
        monkeypatch.setattr(above_select, "INT32_OFFSETS_BELOW", 0)
    hidden, weight, inv_temp = operands(dtype, 11)
    z = logits64(hidden, weight, inv_temp, softcap)
    # bounds between two logits far apart (float32 cannot move an id across), 20 to 300 ids above
    order = z.sort(dim=1, descending=True).values
    want = torch.tensor([20, 300, 150, 0, 77, 1, 250])
    tau = torch.empty(N, dtype=torch.float64)
    for i, k in enumerate(want.tolist()):
        gaps = order[i, k - 1:k + 40] - order[i, k:k + 41] if k else None
        if k == 0:
            tau[i] = order[i, 0] + 1.0                                  # no id above
            continue
        j = int(gaps.argmax())                                          # the widest gap near the k-th id
        want[i] = k + j
        tau[i] = (order[i, k - 1 + j] + order[i, k + j]) / 2
    cap = 400                                               # above every count: all written
    got = above(hidden.to(DEV), weight.to(DEV), inv_temp.to(DEV), tau.float().to(DEV), cap, softcap)
    count = got.count.cpu().long()
    assert torch.equal(count, want), (count, want)
    sel = topk_select.select(hidden.to(DEV), weight.to(DEV), inv_temp.to(DEV), int(want.max()), softcap)
    for i in range(N):
        c = int(count[i])
        ids = got.ids[i, :c].cpu().long()
        assert torch.equal(ids.sort().values, (z[i] >= tau[i]).nonzero().squeeze(1))
        if c:
            # the selection kernel's values of the same ids, bit for bit
            vals = dict(zip(sel.ids[i].cpu().tolist(), sel.vals[i].cpu().tolist(), strict=True))
            mine = got.values[i, :c].cpu()
            theirs = torch.tensor([vals[j] for j in ids.tolist()])
            assert torch.equal(mine, theirs)


def test_counts_past_the_slots():
    """A token with more matches than slots: its count exact, its slots filled with distinct ids above tau."""
    hidden, weight, inv_temp = operands(torch.bfloat16, 3)
    z = logits64(hidden, weight, inv_temp, None)
    tau = z.median(dim=1).values.float()
    tau[2] = float("-inf")                                  # every id
    got = above(hidden.to(DEV), weight.to(DEV), inv_temp.to(DEV), tau.to(DEV), 64)
    count = got.count.cpu().long()
    assert count[2] == V
    for i in range(N):
        ids = got.ids[i].cpu().long()
        assert count[i] > 64 and ids.unique().numel() == 64
        assert bool((z[i, ids] >= tau[i].double() - 1e-3).all())


def test_no_tokens_or_slots():
    hidden, weight, inv_temp = operands(torch.bfloat16, 4)
    tau = torch.zeros(0)
    got = above(hidden[:0].to(DEV), weight.to(DEV), inv_temp[:0].to(DEV), tau.to(DEV), 16)
    assert got.count.numel() == 0 and got.values.shape == (0, 16)
