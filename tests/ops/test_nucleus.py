"""The wide round's nucleus kernel (``ops/triton/nucleus.py``): a kept set decided from emitted logits in any slot
order, against the sorting path's decision (``truncation_select.decide`` on the same float32 log-probs, sorted) and
float64 sums: the kept count, mass, entropy, boundary values and the label's membership; the same bits whatever the
slots' order; ties at the boundary (kept whole, or left undecided where the nucleus would split them); min-p with
and without top-p; too little emitted mass. Compiled on a GPU, else through triton's interpreter."""
from __future__ import annotations

import math

import pytest
import torch

from logitless.ops.triton.nucleus import nucleus
from logitless.ops.truncation_select import RowSettings, decide
from reference64 import device_for

DEV = torch.device(device_for("triton"))
V = 3001


def emitted(z: torch.Tensor, bound: torch.Tensor, width: int, seed: int):
    """Slots as ``above_select.above`` leaves them: every z >= bound of a row, in a random order, padded to width
    with garbage past the row's count."""
    g = torch.Generator().manual_seed(seed)
    r = z.shape[0]
    values = torch.randn(r, width, generator=g) * 100          # what lies past a row's count is never read
    ids = torch.randint(0, V, (r, width), generator=g, dtype=torch.int32)
    count = torch.zeros(r, dtype=torch.int32)
    for i in range(r):
        sel = (z[i] >= bound[i]).nonzero().squeeze(1)
        sel = sel[torch.randperm(sel.numel(), generator=g)]
        values[i, :sel.numel()] = z[i, sel]
        ids[i, :sel.numel()] = sel.int()
        count[i] = sel.numel()
    return values, ids, count


def run(values, ids, count, lse, top_p, min_p, labels, complete=None):
    log_min_p = torch.where(min_p > 0, torch.log(min_p.clamp(min=1e-300)), torch.tensor(float("-inf"),
                                                                                      dtype=torch.float64))
    if complete is None:
        complete = torch.zeros(values.shape[0], dtype=torch.bool)
    out = nucleus(*(t.to(DEV) for t in (values, ids, count, lse, top_p, log_min_p, complete, labels)))
    return type(out)(*(t.cpu() for t in out))


def sorted_decision(z, lse, top_p, min_p):
    """The sorting path's decision over the whole row: keep [r, V] in sorted order, lp [r, V] float32, order."""
    values, order = torch.sort(z, dim=1, descending=True, stable=True)
    lp = values - lse.unsqueeze(1)
    r = z.shape[0]
    d = decide(lp, torch.full((r,), float("-inf")), V, RowSettings(torch.full((r,), -1), top_p, min_p))
    assert d.decided.all()
    return d.keep, lp, values, order


def heads(seed, r, std=2.0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(r, V, generator=g) * std
    return z, torch.logsumexp(z.double(), dim=1).float()


SETTINGS = [(0.9, 0.0), (0.5, 0.0), (0.95, 0.01), (1.0, 0.02), (0.7, 0.0), (0.99, 0.001), (0.3, 0.05)]


def test_against_the_sorted_decision():
    z, lse = heads(0, len(SETTINGS))
    top_p = torch.tensor([p for p, _ in SETTINGS], dtype=torch.float64)
    min_p = torch.tensor([m for _, m in SETTINGS], dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, V, (len(SETTINGS),), generator=g)
    labels[0] = z[0].argmax()
    values, ids, count = emitted(z, lse - 14.0, 4100, seed=2)
    out = run(values, ids, count, lse, top_p, min_p, labels)
    keep, lp, sorted_z, order = sorted_decision(z, lse, top_p, min_p)
    assert out.decided.all()
    kept = keep.sum(dim=1)
    assert torch.equal(out.kept, kept)
    lp_kept = lp.double().masked_fill(~keep, float("-inf"))
    log_mass = torch.logsumexp(lp_kept, dim=1)
    assert (out.log_mass - log_mass).abs().max() < 1e-13
    q = torch.exp(lp_kept - log_mass.unsqueeze(1))
    entropy = -(q * torch.log(q.clamp(min=1e-300))).sum(dim=1)
    assert (out.entropy - entropy).abs().max() < 1e-12
    rows = torch.arange(len(SETTINGS))
    assert torch.equal(out.last, sorted_z[rows, kept - 1])
    assert torch.equal(out.out, sorted_z[rows, kept])
    inside = keep.gather(1, (order == labels.unsqueeze(1)).int().argmax(dim=1, keepdim=True)).squeeze(1)
    assert torch.equal(out.inside, inside) and bool(inside[0]) and not bool(inside.all())


def test_the_slots_order_changes_no_bit():
    z, lse = heads(3, 4, std=3.0)
    top_p = torch.tensor([0.95, 0.8, 0.6, 0.99], dtype=torch.float64)
    min_p = torch.zeros(4, dtype=torch.float64)
    labels = z.argmax(dim=1)
    first = run(*emitted(z, lse - 13.0, 3100, seed=4), lse, top_p, min_p, labels)
    for seed in (5, 6):
        again = run(*emitted(z, lse - 13.0, 3100, seed=seed), lse, top_p, min_p, labels)
        for a, b in zip(first, again, strict=True):
            assert torch.equal(a, b)


def test_ties_at_the_boundary():
    """A group of equal logits at the nucleus's boundary: kept whole where the cut falls after its last id, left
    undecided where the nucleus would keep only its first ids (the sorting path then cuts it by ascending id)."""
    z, _ = heads(7, 2)
    z[:, :6] = torch.tensor([6.0, 5.0, 4.0, 4.0, 4.0, 4.0])      # one id at 6, one at 5, four tied at 4
    z[:, 6:] = z[:, 6:].clamp(max=3.0)
    lse = torch.logsumexp(z.double(), dim=1).float()
    p = torch.softmax(z.double(), dim=1)
    lead, tie = p[:, 0] + p[:, 1], p[:, 2]
    # row 0: the cut inside the tie (after two of its four ids); row 1: right after the whole tie
    top_p = lead + torch.tensor([1.5, 3.5], dtype=torch.float64) * tie
    values, ids, count = emitted(z, lse - 12.0, 3100, seed=8)
    out = run(values, ids, count, lse, top_p, torch.zeros(2, dtype=torch.float64), torch.tensor([3, 5]))
    assert not bool(out.decided[0])
    keep, _, sorted_z, _ = sorted_decision(z, lse, top_p, torch.zeros(2, dtype=torch.float64))
    assert int(keep[0].sum()) == 4                      # the sorting path keeps two of the tie, by ascending id
    assert bool(out.decided[1]) and int(out.kept[1]) == int(keep[1].sum()) == 6
    assert float(out.last[1]) == 4.0 and bool(out.inside[1])


def test_too_little_mass_emitted_is_undecided():
    """top_p alone over slots holding less than top_p of the mass (a bound set too high): undecided, never a
    nucleus of what was emitted."""
    z, lse = heads(9, 2)
    values, ids, count = emitted(z, lse - 3.0, 3100, seed=10)     # only the largest few ids
    held = torch.exp((values - lse.unsqueeze(1)).double()).masked_fill(
        torch.arange(3100).unsqueeze(0) >= count.unsqueeze(1), 0).sum(dim=1)
    top_p = (held + 0.01).clamp(max=0.999).double()
    out = run(values, ids, count, lse, top_p, torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
    assert not out.decided.any()


def test_every_id_emitted():
    """complete: the nucleus is of what every id sums to (not of 1); min_p 0 and top_p 1 would keep all."""
    z, lse = heads(11, 2, std=1.0)
    values, ids, count = emitted(z, torch.full((2,), -math.inf), V + 5, seed=12)
    assert (count == V).all()
    top_p = torch.tensor([0.9, 0.999], dtype=torch.float64)
    out = run(values, ids, count, lse, top_p, torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.long),
              complete=torch.ones(2, dtype=torch.bool))
    keep, _, _, _ = sorted_decision(z, lse, top_p, torch.zeros(2, dtype=torch.float64))
    assert out.decided.all() and torch.equal(out.kept, keep.sum(dim=1))


@pytest.mark.parametrize("width", [1, 300])
def test_rows_without_slots_read(width):
    """A row whose count is 0 is undecided (nothing emitted); a narrow width reads a row's first slots only."""
    z, lse = heads(13, 3)
    values, ids, count = emitted(z, lse - 5.0, 1200, seed=14)
    count[0] = 0
    out = run(values[:, :width], ids[:, :width], count, lse, torch.full((3,), 0.9, dtype=torch.float64),
              torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.long))
    assert not bool(out.decided[0])


def test_signed_zeros_are_one_tie():
    """-0.0 and +0.0 are one value (the sorting path's keys): a nucleus cut inside a group of both is a tie split,
    left undecided; a cut after the whole group keeps all four."""
    z = torch.full((2, V), -30.0)
    z[:, :4] = torch.tensor([3.0, 2.0, 1.0, 1.0])
    z[:, 4:8] = torch.tensor([-0.0, 0.0, -0.0, 0.0])
    lse = torch.logsumexp(z.double(), dim=1).float()
    p = torch.softmax(z.double(), dim=1)
    top_p = p[:, :4].sum(dim=1) + torch.tensor([1.5, 3.5], dtype=torch.float64) * p[:, 4]
    values, ids, count = emitted(z, torch.full((2,), -40.0), V + 3, seed=15)
    out = run(values, ids, count, lse, top_p, torch.zeros(2, dtype=torch.float64), torch.tensor([4, 4]))
    keep, _, _, order = sorted_decision(z, lse, top_p, torch.zeros(2, dtype=torch.float64))
    assert int(keep[0].sum()) == 6 and order[0, :6].sort().values.tolist() == [0, 1, 2, 3, 4, 5]
    assert not bool(out.decided[0])
    assert bool(out.decided[1]) and int(out.kept[1]) == int(keep[1].sum()) == 8 and bool(out.inside[1])


def test_survivors_below_the_fixed_point_are_kept():
    """min_p far below 2^-60 with top_p 1 keeps every survivor, also those whose mass is below the fixed point's
    unit (each emitted id weighs at least one unit)."""
    z = torch.full((1, V), -100.0)
    z[0, 0] = 0.0
    z[0, 1:11] = -torch.linspace(5, 20, 10)
    z[0, 11:401] = -torch.linspace(45, 60, 390)           # p ~ e^-45 .. e^-60: below 2^-60 ~ e^-41.6
    lse = torch.logsumexp(z.double(), dim=1).float()
    min_p = torch.tensor([1e-30], dtype=torch.float64)
    values, ids, count = emitted(z, torch.full((1,), -80.0), 450, seed=16)
    out = run(values, ids, count, lse, torch.ones(1, dtype=torch.float64), min_p, torch.tensor([100]))
    keep, _, _, _ = sorted_decision(z, lse, torch.ones(1, dtype=torch.float64), min_p)
    assert int(keep.sum()) == 401
    assert bool(out.decided[0]) and int(out.kept[0]) == 401 and bool(out.inside[0])


def test_a_bad_route_is_refused_by_name(monkeypatch):
    """LOGITLESS_TRUNCATION_NUCLEUS takes kernel or sort; anything else is a ValueError naming it, before any
    selection pass."""
    from logitless import Truncation, fused_logprobs
    monkeypatch.setenv("LOGITLESS_TRUNCATION_NUCLEUS", "sorted")
    monkeypatch.setenv("LOGITLESS_TRUNCATION_CANDIDATES", "8")
    g = torch.Generator().manual_seed(17)
    hidden = torch.randn(5, 48, generator=g).bfloat16().to(DEV)
    weight = (torch.randn(1031, 48, generator=g) * 0.3).bfloat16().to(DEV)
    labels = torch.randint(0, 1031, (5,), generator=g).to(DEV)
    with pytest.raises(ValueError, match="LOGITLESS_TRUNCATION_NUCLEUS"):
        fused_logprobs(hidden, weight, labels, backend="triton", truncation=Truncation(top_p=0.95))
