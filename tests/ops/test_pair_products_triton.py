"""The kept pairs' Triton kernels (``logitless.ops.triton.pair_products``: the products, d_hidden grouped by row,
d_weight grouped by id) against float64, compiled on a GPU, else through triton's interpreter on CPU tensors: pairs
in no order, repeated rows and ids, ids of another rank (-1), zero coefficients, a row with many pairs, an id with
many pairs, a row with none; d_weight rounded once per row in its own dtype; and ``kept_pairs`` (the truncated
log-prob's pairs) taking the kernels, forced on the CPU as they are taken for CUDA tensors."""
from __future__ import annotations

import pytest
import torch

from logitless import Truncation, fused_logprobs
from logitless.ops import kept_pairs
from logitless.ops.triton import pair_products as kernels
from logitless.ops.triton.common import INTERPRETING
from reference64 import device_for

N, H, V = 7, 96, 4099
DEV = device_for("triton")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# the default blocks (H 96 in one tile of 128), and 4 pairs a step over two tiles of 64 (the second one cut)
BLOCKS = [None, "4,64,1"]


@pytest.fixture(params=BLOCKS)
def blocks(request, monkeypatch):
    if request.param is not None:
        monkeypatch.setenv("LOGITLESS_TRITON_PAIRS", request.param)
    return request.param


def pairs(gen, p=300):
    """rows, ids [p] int64 in no order: ids repeated (a pool of 40 ids), about 10% -1, row 2 holding 150 pairs
    (many BLOCK_P steps), id 17 kept by 90 pairs, row 6 with no pair."""
    rows = torch.randint(0, N - 1, (p,), generator=gen)
    rows[torch.randperm(p, generator=gen)[:150]] = 2
    pool = torch.randint(0, V, (40,), generator=gen)
    ids = pool[torch.randint(0, 40, (p,), generator=gen)]
    ids[torch.randperm(p, generator=gen)[:90]] = 17
    ids[torch.randperm(p, generator=gen)[:30]] = -1
    ids[:3] = torch.tensor([V - 1, 0, V - 1])       # the first and last rows of the weight
    return rows, ids


def operands(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H ** 0.5).to(dtype)
    rows, ids = pairs(gen)
    coef = torch.randn(rows.shape, generator=gen)
    coef[torch.randperm(rows.numel(), generator=gen)[:10]] = 0.0
    return hidden, weight, rows, ids, coef, gen


def to(dev, *tensors):
    return [t.to(dev) for t in tensors]


def products64(hidden, weight, rows, ids):
    keep = ids >= 0
    raw = (hidden.double()[rows] * weight.double()[ids.clamp(min=0)]).sum(1)
    return torch.where(keep, raw, 0.0), (hidden.double().abs()[rows] * weight.double().abs()[ids.clamp(min=0)]).sum(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_match_float64(dtype, seed, blocks):
    hidden, weight, rows, ids, _, _ = operands(dtype, seed)
    got = kernels.pair_products(*to(DEV, hidden, weight, rows, ids)).cpu()
    want, scale = products64(hidden, weight, rows, ids)
    assert got.dtype == torch.float32
    assert (got.double() - want).abs().le(1e-6 * scale + 1e-30).all(), (got.double() - want).abs().max()
    assert torch.equal(got[ids < 0], torch.zeros(int((ids < 0).sum())))
    assert want[ids >= 0].abs().max() > 0.1                   # not a test on zeros


@pytest.mark.parametrize("dtype", DTYPES)
def test_dh_adds_each_rows_pairs(dtype, seed, blocks):
    hidden, weight, rows, ids, coef, gen = operands(dtype, seed)
    start = torch.randn(N, H, generator=gen)
    want = start.double().clone()
    keep = ids >= 0
    want.index_add_(0, rows[keep], coef[keep].double().unsqueeze(1) * weight.double()[ids[keep]])
    dh = start.to(DEV)
    kernels.add_pairs_dh(dh, *to(DEV, weight, rows, ids, coef))
    dh = dh.cpu()
    scale = start.double().abs().clone().index_add_(
        0, rows[keep], (coef[keep].double().unsqueeze(1) * weight.double()[ids[keep]]).abs())
    assert (dh.double() - want).abs().le(1e-6 * scale).all(), (dh.double() - want).abs().max()
    assert torch.equal(dh[6], start[6])             # the row without a pair


def half_ulp(x: torch.Tensor, dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` at |x| (float64): the most one rounding to it moves x."""
    mant = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}[dtype]
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0 ** -60)))
    return torch.exp2(e - mant)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dw_adds_each_ids_pairs_with_one_rounding(dtype, seed, blocks):
    """dw[i] = round(dw[i] + sum of its pairs): within half a unit of dw's dtype of the float64 value (plus the float32
    sum's error), where rounding the sum first and then dw plus it (two roundings) is not."""
    hidden, weight, rows, ids, coef, gen = operands(dtype, seed)
    start = (torch.randn(V, H, generator=gen) * 4).to(dtype)
    keep = (ids >= 0) & (coef != 0)
    sums = torch.zeros(V, H, dtype=torch.float64).index_add_(
        0, ids[keep], coef[keep].double().unsqueeze(1) * hidden.double()[rows[keep]])
    slack = torch.zeros(V, H, dtype=torch.float64).index_add_(
        0, ids[keep], (coef[keep].double().unsqueeze(1) * hidden.double()[rows[keep]]).abs())
    want = start.double() + sums
    dw = start.to(DEV)
    kernels.add_pairs_dw(dw, *to(DEV, hidden, rows, ids, coef))
    dw = dw.cpu()
    assert dw.dtype == dtype
    touched = torch.zeros(V, dtype=torch.bool)
    touched[ids[keep]] = True
    assert torch.equal(dw[~touched], start[~touched])
    bound = half_ulp(want, dtype) + 1e-6 * (slack + start.double().abs())
    assert (dw.double() - want).abs().le(bound).all(), ((dw.double() - want).abs() / bound).max()
    if dtype != torch.float32:   # the check tells one rounding from two
        twice = (start.double() + sums.to(dtype).double()).to(dtype)
        assert (twice.double() - want).abs().gt(bound).any()


def test_a_row_and_an_id_with_thousands_of_pairs(seed):
    """3000 pairs, 2500 of them on row 2 and 2000 on id 17 (hundreds of BLOCK_P steps in one program): all three
    products against float64."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H ** 0.5
    p = 3000
    rows = torch.randint(0, N, (p,), generator=gen)
    rows[torch.randperm(p, generator=gen)[:2500]] = 2
    ids = torch.randint(0, V, (p,), generator=gen)
    ids[torch.randperm(p, generator=gen)[:2000]] = 17
    coef = torch.randn(p, generator=gen)
    raw = kernels.pair_products(*to(DEV, hidden, weight, rows, ids)).cpu()
    want, scale = products64(hidden, weight, rows, ids)
    assert (raw.double() - want).abs().le(1e-6 * scale).all()
    contrib_w = coef.double().unsqueeze(1) * weight.double()[ids]
    contrib_h = coef.double().unsqueeze(1) * hidden.double()[rows]
    dh = torch.zeros(N, H, device=DEV)
    kernels.add_pairs_dh(dh, *to(DEV, weight, rows, ids, coef))
    want_dh = torch.zeros(N, H, dtype=torch.float64).index_add_(0, rows, contrib_w)
    scale_dh = torch.zeros(N, H, dtype=torch.float64).index_add_(0, rows, contrib_w.abs())
    assert (dh.cpu().double() - want_dh).abs().le(4e-6 * scale_dh).all()
    dw = torch.zeros(V, H, device=DEV)
    kernels.add_pairs_dw(dw, *to(DEV, hidden, rows, ids, coef))
    want_dw = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids, contrib_h)
    scale_dw = torch.zeros(V, H, dtype=torch.float64).index_add_(0, ids, contrib_h.abs())
    assert (dw.cpu().double() - want_dw).abs().le(4e-6 * scale_dw).all()
    assert want_dw[17].abs().max() > 1 and want_dh[2].abs().max() > 1


def test_empty_pairs():
    hidden, weight, rows, ids, coef, _ = operands(torch.float32, 0)
    empty = torch.zeros(0, dtype=torch.int64)
    assert kernels.pair_products(*to(DEV, hidden, weight, empty, empty)).numel() == 0
    dh = torch.ones(N, H, device=DEV)
    kernels.add_pairs_dh(dh, *to(DEV, weight, empty, empty, empty.float()))
    dw = torch.ones(V, H, device=DEV)
    kernels.add_pairs_dw(dw, *to(DEV, hidden, empty, empty, empty.float()))
    # every pair on another rank
    kernels.add_pairs_dw(dw, *to(DEV, hidden, rows, torch.full_like(ids, -1), coef))
    assert bool((dh == 1).all()) and bool((dw == 1).all())


@pytest.mark.parametrize("value", ["16,128", "16,100,4", "a,b,c", "0,128,4"])
def test_bad_blocks_are_refused(value, monkeypatch):
    monkeypatch.setenv("LOGITLESS_TRITON_PAIRS", value)
    hidden, weight, rows, ids, _, _ = operands(torch.float32, 0)
    with pytest.raises(ValueError, match="LOGITLESS_TRITON_PAIRS"):
        kernels.pair_products(*to(DEV, hidden, weight, rows, ids))


@pytest.fixture
def triton_pairs(monkeypatch):
    """``kept_pairs`` taking the kernels for these tensors (as for CUDA ones), counting the calls."""
    calls = []

    class Spy:
        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                return getattr(kernels, name)(*args)
            return call
    monkeypatch.setattr(kept_pairs, "_kernels", lambda a, b: Spy())
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pair_products_function_gradients(dtype, seed, triton_pairs):
    """``kept_pairs.PairProducts`` on the kernels: the products and both gradients against float64 autograd."""
    hidden, weight, rows, ids, _, gen = operands(dtype, seed)
    g = torch.randn(rows.shape, generator=gen)
    h, w = (t.clone().to(DEV).requires_grad_() for t in (hidden, weight))
    raw = kept_pairs.PairProducts.apply(h, w, rows.to(DEV), ids.to(DEV), None, True)
    (raw * g.to(DEV)).sum().backward()
    assert sorted(set(triton_pairs)) == ["add_pairs_dh", "add_pairs_dw", "pair_products"]
    h64, w64 = (t.double().requires_grad_() for t in (hidden, weight))
    want, _ = products64(h64, w64, rows, ids)
    (want * g.double()).sum().backward()
    tol = 1e-6 if dtype == torch.float32 else 8e-3      # the gradients come back in the operands' dtype
    assert (raw.detach().cpu().double() - want.detach()).abs().max() <= 1e-5 * want.abs().max()
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert got.dtype == dtype
        err = (got.cpu().double() - ref).abs()
        assert err.le(tol * ref.abs() + 1e-6 * ref.abs().max()).all(), err.max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_truncated_logprobs_on_the_kernels_equal_the_torch_path(dtype, seed, triton_pairs, monkeypatch):
    """fused_logprobs(truncation=Truncation(kept_ids=...)) (the replay form: only the pairs' products run) with the
    pairs on the kernels: the torch path's log-probs, entropy and gradients (to float32's summation order)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) / H ** 0.5 * 3).to(dtype)
    labels = torch.randint(0, V, (N,), generator=gen)
    # 5 ids of 30 (shared between tokens), 15 others; the label kept on 4 tokens; token 2 keeps 10 ids
    kept = torch.stack([torch.cat([torch.randperm(30, generator=gen)[:5],
                                   30 + torch.randperm(V - 30, generator=gen)[:15]]) for _ in range(N)])
    labels[:4] = kept[:4, 7]
    kept[2, 10:] = -1
    results = {}
    for path in ("triton", "torch"):
        if path == "torch":
            monkeypatch.setattr(kept_pairs, "_kernels", lambda a, b: None)
        h, w = (t.clone().to(DEV).requires_grad_() for t in (hidden, weight))
        out = fused_logprobs(h, w, labels.to(DEV), temperature=0.8, backend="chunked",
                             truncation=Truncation(kept_ids=kept.to(DEV)))
        (out.logprobs.sum() + out.entropy.sum()).backward()
        results[path] = [out.logprobs.detach().cpu(), out.entropy.detach().cpu(), h.grad.cpu(), w.grad.cpu()]
    assert triton_pairs == ["pair_products", "add_pairs_dh", "add_pairs_dw"]
    assert bool(results["torch"][0][:4].lt(0).all())      # kept labels: finite log-probs
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, ref in zip(results["triton"], results["torch"], strict=True):
        assert ref.abs().max() > 0
        assert (got.double() - ref.double()).abs().max() <= tol * ref.abs().max().double()


def test_settings_form_through_the_path_knob_equals_the_torch_path(monkeypatch):
    """LOGITLESS_PAIRS_PATH=triton puts the settings form's pairs (the anchors and labels forward, every kept pair
    backward) on the kernels (CPU tensors in the interpreter, CUDA ones compiled): the torch path's numbers to
    float32's summation order; "torch" keeps them off the kernels; a bad value is refused by name, and so is
    "triton" for CPU tensors outside the interpreter (compiled kernels cannot read them)."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(N, H, generator=gen).to(DEV)
    weight = (torch.randn(V, H, generator=gen) / H ** 0.5 * 3).to(DEV)
    labels = torch.randint(0, V, (N,), generator=gen).to(DEV)
    results = {}
    for path in ("triton", "torch"):
        monkeypatch.setenv("LOGITLESS_PAIRS_PATH", path)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_logprobs(h, w, labels, temperature=0.8, backend="chunked", precision="ieee",
                             truncation=Truncation(top_k=20, top_p=0.9))
        (out.logprobs.sum() + out.entropy.sum()).backward()
        results[path] = [out.logprobs.detach(), out.entropy.detach(), h.grad, w.grad]
    for got, ref in zip(results["triton"], results["torch"], strict=True):
        assert ref.abs().max() > 0
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    monkeypatch.setenv("LOGITLESS_PAIRS_PATH", "torch")
    assert kept_pairs._kernels(hidden, weight) is None
    if not INTERPRETING:
        monkeypatch.setenv("LOGITLESS_PAIRS_PATH", "triton")
        with pytest.raises(ValueError, match="LOGITLESS_PAIRS_PATH"):
            kept_pairs._kernels(hidden.cpu(), weight.cpu())
    monkeypatch.setenv("LOGITLESS_PAIRS_PATH", "cuda")
    with pytest.raises(ValueError, match="LOGITLESS_PAIRS_PATH"):
        fused_logprobs(hidden, weight, labels, truncation=Truncation(top_k=20))
