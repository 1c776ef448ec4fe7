"""The triton backend's given-set kernels (``ops/triton/given_set.py``: k given ids per token, their logits and the
mass outside them from one GEMM), against float64 from the definitions, V not a power of two: ids at the tiles'
edges, ids another rank holds (-1), k = V (no column outside: -inf), a tail of e^-60, per-token temperatures,
softcap, half-precision operands, gathered rows, and bitwise batch invariance (one token a call, token chunks).
Then through the ops: ``fused_logprobs_k(with_tail=True)`` and ``forward_kl_topk_tail`` record the kernels, not the
torch pass, with the student's own top k beside them. The kernels run on the GPU where there is one, else in
triton's interpreter; the float64 truth stays on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

from logitless import last_backend
from logitless.ops import label_set_function
from logitless.ops.function import OpOptions
from logitless.ops.triton import given_set as gs
from logitless.ops.triton.common import INTERPRETING, choose_tiles
from reference64 import device_for

pytestmark = pytest.mark.skipif(not (INTERPRETING or torch.cuda.is_available()),
                                reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
DEV = torch.device(device_for("triton"))
# the given-set kernel's tiles here (64 columns in the interpreter, 128 or 256 on a GPU): ids placed at their edges;
# N past two token tiles, so that the byte knobs at 1 (one token tile a chunk) split the batch on a GPU too
TILES = choose_tiles("FWD", torch.float32, DEV)
BLOCK_N = TILES.block_n
V, H, N = 1031, 40, max(37, 2 * TILES.block_m + 5)


def head(seed, n=N, v=V, h=H, std=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g).to(dtype), (torch.randn(v, h, generator=g) * (std / h ** 0.5)).to(dtype),
            g)


def random_ids(n, v, k, g):
    return torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])


def z64(hidden, weight, inv_temp, softcap=None):
    z = hidden.double() @ weight.double().t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z * inv_temp.double().unsqueeze(1)


def want(z, local):
    """float64 (vals [n, k]: -inf at -1, m [n], rest [n]) of the definitions: the ids' logits, the max of the
    columns outside them and their sum relative to it."""
    vals = torch.where(local >= 0, z.gather(1, local.clamp(min=0)), torch.tensor(float("-inf"), dtype=z.dtype))
    inside = torch.zeros_like(z, dtype=torch.bool)
    for i in range(local.shape[1]):                  # a -1 id marks no column
        col = local[:, i]
        inside[torch.arange(z.shape[0])[col >= 0], col[col >= 0]] = True
    rest_z = z.masked_fill(inside, float("-inf"))
    m = rest_z.amax(1)
    ref = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    rest = torch.where(torch.isfinite(m), (rest_z - ref.unsqueeze(1)).exp().sum(1), torch.zeros_like(m))
    return vals, m, rest


def run(hidden, weight, inv_temp, local, softcap=None, rows=None):
    part = gs.given_set(hidden.to(DEV), weight.to(DEV), inv_temp.to(DEV), local.to(DEV), local.to(DEV), softcap,
                        None if rows is None else rows.to(DEV))
    return tuple(t.cpu() for t in part)


def check(part, vals, m, rest, tol=2e-6):
    got_m, got_rest, got_vals, _ = part
    fin = torch.isfinite(vals)
    assert torch.equal(torch.isfinite(got_vals), fin)
    assert (got_vals.double()[fin] - vals[fin]).abs().max() <= tol * (1 + vals[fin].abs().max())
    assert torch.equal(torch.isfinite(got_m), torch.isfinite(m))
    fm = torch.isfinite(m)
    assert torch.equal(got_rest[~fm], torch.zeros_like(got_rest[~fm]))
    if fm.any():
        assert (got_m.double()[fm] - m[fm]).abs().max() <= tol * (1 + m[fm].abs().max())
        # the rest relative to its own max: >= 1 once a column is there, compared in log space, to the logits'
        # rounding at their size (1.2e-5 at logits of -58 on an H100, whose dot sums in another order)
        assert (got_rest.double()[fm].log() - rest[fm].log()).abs().max() <= max(1e-5, tol * m[fm].abs().max())


@pytest.mark.parametrize("k", [1, 5, 33])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_matches_float64(k, softcap, seed):
    hidden, weight, g = head(seed)
    inv_temp = 1.0 / (torch.rand(N, generator=g) + 0.5)
    local = random_ids(N, V, k, g)
    # ids at the tiles' edges, the first and the last column, and ids of another rank
    local[0, 0], local[1, 0], local[2, 0], local[3, 0] = 0, BLOCK_N - 1, BLOCK_N, V - 1
    if k > 1:
        local[4, 1] = -1
        local[5] = -1          # a token none of whose ids lie here: every column is rest
    vals, m, rest = want(z64(hidden, weight, inv_temp, softcap), local)
    check(run(hidden, weight, inv_temp, local, softcap), vals, m, rest)


def test_rows_with_many_ids_in_one_tile(seed):
    """Each tile finds its rows' ids by a binary search over their sorted ids, then takes as many steps as the most
    any row has there: rows with 0 to 48 ids crowded into the first tiles beside rows with a few spread out, a
    repeat and ids of another rank among them."""
    hidden, weight, g = head(seed)
    k = 50
    local = random_ids(N, V, k, g)
    for r in range(N):
        crowd = (r % 5) * 12                        # 0, 12, 24, 36 or 48 ids among the first 1.5 tiles' columns
        local[r, :crowd] = torch.randperm(BLOCK_N + BLOCK_N // 2, generator=g)[:crowd]
        keep = torch.isin(local[r, crowd:], local[r, :crowd], invert=True)
        local[r, crowd:] = torch.where(keep, local[r, crowd:], -1)   # distinct apart from the repeat below
    local[7, 9] = local[7, 3]
    local[8, 40:] = -1
    inv_temp = 1.0 / (torch.rand(N, generator=g) + 0.5)
    vals, m, rest = want(z64(hidden, weight, inv_temp), local)
    check(run(hidden, weight, inv_temp, local), vals, m, rest)


def test_every_column_given_leaves_no_rest(seed):
    """k = V: no column outside the ids: m -inf, rest 0 (the tail -inf, never NaN)."""
    v = 70
    hidden, weight, g = head(seed, n=5, v=v)
    local = random_ids(5, v, v, g)
    inv_temp = torch.ones(5)
    vals, m, rest = want(z64(hidden, weight, inv_temp), local)
    part = run(hidden, weight, inv_temp, local)
    check(part, vals, m, rest)
    assert torch.isneginf(part[0]).all() and (part[1] == 0).all()


def test_a_tail_of_e_minus_60_is_summed_not_subtracted(seed):
    """The ids hold all but 1 - e^-60 of the mass: the rest is the sum of its own columns (no 1 - sum), exact."""
    n, v = 6, 300
    hidden, weight, g = head(seed, n=n, v=v, std=1.0)
    hidden[:, :n] = torch.eye(n)
    local = random_ids(n, v, v - 3, g)
    outside = torch.stack([torch.tensor(sorted(set(range(v)) - set(r.tolist()))) for r in local])
    for i in range(n):
        weight[outside[i], i] -= 60.0
    inv_temp = torch.ones(n)
    z = z64(hidden, weight, inv_temp)
    vals, m, rest = want(z, local)
    part = run(hidden, weight, inv_temp, local)
    check(part, vals, m, rest)
    tail64 = (m + rest.log()) - torch.logsumexp(z, 1)
    tail = part[0].double() + part[1].double().log() - torch.logsumexp(torch.cat(
        [part[2].double(), (part[0] + part[1].log()).double().unsqueeze(1)], 1), 1)
    assert (tail64 < -55).all() and (tail - tail64).abs().max() < 1e-4


def test_half_operands(seed):
    hidden, weight, g = head(seed, dtype=torch.bfloat16)
    inv_temp = torch.ones(N)
    local = random_ids(N, V, 8, g)
    vals, m, rest = want(z64(hidden, weight, inv_temp), local)
    check(run(hidden, weight, inv_temp, local), vals, m, rest, tol=1e-5)


def test_gathered_rows_and_batch_invariance(seed, monkeypatch):
    """The partial of a token is the same bits alone, in the batch, gathered by ``rows`` and in token chunks of
    one token tile (LOGITLESS_GIVEN_SET_BYTES=1)."""
    hidden, weight, g = head(seed)
    inv_temp = 1.0 / (torch.rand(N, generator=g) + 0.5)
    local = random_ids(N, V, 7, g)
    whole = run(hidden, weight, inv_temp, local)
    rows = torch.tensor([30, 2, 17, 5])
    gathered = run(hidden, weight, inv_temp[rows], local[rows], rows=rows)
    for a, b in zip(gathered[:3], whole[:3], strict=True):
        assert torch.equal(a, b[rows])
    alone = [run(hidden[i:i + 1], weight, inv_temp[i:i + 1], local[i:i + 1]) for i in (0, 11, N - 1)]
    for j, i in enumerate((0, 11, N - 1)):
        for a, b in zip(alone[j][:3], whole[:3], strict=True):
            assert torch.equal(a, b[i:i + 1])
    monkeypatch.setenv("LOGITLESS_GIVEN_SET_BYTES", "1")
    assert gs.chunk_rows(V, hidden.dtype, DEV) < N
    chunked = run(hidden, weight, inv_temp, local)
    for a, b in zip(chunked[:3], whole[:3], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("select, candidates", [(0, None), (4, None), (4, 32)])
def test_the_tail_op_runs_the_kernels(select, candidates, seed, monkeypatch):
    """fused_logprobs_k with the tail (and the student's own top k, from the same GEMM while the selection's tile
    holds at most 16 candidates, ``topk_select.shares_given``; with 32 a tile, from its own GEMM): the kernels'
    record, the float64 numbers."""
    if candidates is not None:
        monkeypatch.setenv("LOGITLESS_TOPK_CANDIDATES", str(candidates))
    hidden, weight, g = head(seed)
    ids = random_ids(N, V, 6, g)
    ids[3] = -100                                   # an ignored token: zeros
    opts = OpOptions(backend="triton", with_entropy=False, softcap=None, check_inputs=True, precision="ieee",
                     grad_precision="ieee")
    from logitless.ops.triton import topk_select
    fused = []
    real = topk_select.select_with_given
    monkeypatch.setattr(topk_select, "select_with_given", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    lp, _, tail, top = label_set_function.fused_logprobs_k(hidden.to(DEV), weight.to(DEV), ids.to(DEV),
                                                           torch.ones(N, device=DEV), opts, with_tail=True,
                                                           select=select)
    assert last_backend() == "triton" and len(fused) == (1 if select and candidates is None else 0)
    logp = torch.log_softmax(z64(hidden, weight, torch.ones(N)), 1)
    keep = ids[:, 0] >= 0
    lp64 = logp.gather(1, ids.clamp(min=0))
    tail64 = torch.logsumexp(logp.scatter(1, ids.clamp(min=0), float("-inf")), 1)
    assert (lp.cpu().double()[keep] - lp64[keep]).abs().max() < 2e-5
    assert (tail.cpu().double()[keep] - tail64[keep]).abs().max() < 2e-5
    assert (lp.cpu()[~keep] == 0).all() and (tail.cpu()[~keep] == 0).all()
    if select:
        top64 = logp.sort(dim=1, descending=True, stable=True).indices[:, :select]
        assert torch.equal(top.cpu()[keep], top64[keep])
        assert (top.cpu()[~keep] == -1).all()
    assert math.isfinite(float(tail.cpu()[keep].sum()))


def test_one_gemm_with_the_selection_is_both_passes(seed, monkeypatch):
    """``topk_select.select_with_given``: the selection kernel running the given set's epilogue gives the selection
    and the given partial of the two passes alone, bit for bit (the same tiles), in token chunks too."""
    from logitless.ops.triton import topk_select
    hidden, weight, g = head(seed)
    inv_temp = (1.0 / (torch.rand(N, generator=g) + 0.5)).to(DEV)
    local = random_ids(N, V, 6, g).to(DEV)
    local[2, 3] = -1
    h, w = hidden.to(DEV), weight.to(DEV)
    alone_sel = topk_select.select(h, w, inv_temp, 5)
    alone = gs.given_set(h, w, inv_temp, local, local)
    sel, part = topk_select.select_with_given(h, w, inv_temp, 5, local, local + 100)
    assert torch.equal(sel.ids, alone_sel.ids) and torch.equal(sel.vals, alone_sel.vals)
    for a, b in zip(part[:3], alone[:3], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(part.ids, local + 100)
    rows = torch.tensor([4, 0, 33, 9], device=DEV)
    sel_r, part_r = topk_select.select_with_given(h, w, inv_temp[rows], 5, local[rows], local[rows], rows=rows)
    assert torch.equal(sel_r.ids, alone_sel.ids[rows])
    for a, b in zip(part_r[:3], alone[:3], strict=True):
        assert torch.equal(a, b[rows])
    monkeypatch.setenv("LOGITLESS_TOPK_BYTES", "1")           # one token tile a chunk
    assert topk_select.chunk_rows(V, 5, hidden.dtype, DEV, given_k=6) < N
    sel_c, part_c = topk_select.select_with_given(h, w, inv_temp, 5, local, local)
    assert torch.equal(sel_c.ids, alone_sel.ids)
    for a, b in zip(part_c[:3], alone[:3], strict=True):
        assert torch.equal(a, b)


def test_nan_reaches_the_outputs(seed):
    """A NaN logit (a NaN weight row) at a given id, or among the rest, gives NaN, never a finite number: the id's
    logit NaN, and the rest's max and sum NaN, as the torch pass gives."""
    hidden, weight, g = head(seed, n=5)
    local = random_ids(5, V, 4, g)
    weight[local[0, 1]] = float("nan")                       # token 0's id 1 (and every token's column there)
    nan_col = int(torch.tensor([c for c in range(V) if c not in local.view(-1).tolist()][-1]))
    weight[nan_col] = float("nan")                           # a column in every token's rest
    part = run(hidden, weight, torch.ones(5), local)
    assert torch.isnan(part[2][0, 1])
    assert torch.isnan(part[1]).all()        # every token's rest


def test_an_id_repeated_within_a_token(seed):
    """Unchecked calls may repeat an id within a token: each occurrence gets its logit, its column is out of the
    rest once (as the torch pass)."""
    hidden, weight, g = head(seed, n=6)
    local = random_ids(6, V, 5, g)
    local[1, 3] = local[1, 0]
    local[4, 4] = local[4, 2]
    inv_temp = torch.ones(6)
    vals, m, rest = want(z64(hidden, weight, inv_temp), local)
    check(run(hidden, weight, inv_temp, local), vals, m, rest)


def test_sorted_distinct_sorts_each_row_and_maps_repeats_back():
    """``label_sets.sorted_distinct``: the kernels see each id of a row once, ascending, holes (ID_HOLE: -1 entries and
    repeats) last, as their binary search needs; every entry maps back to its id's position, so that the logits
    gathered back give each repeat its id's logit; -1 entries map to a hole (whose logit stays -inf)."""
    from logitless.ops.label_sets import ID_HOLE, sorted_distinct
    local = torch.tensor([[5, 2, 5, -1, 5, -1], [0, 1, 2, 3, 4, 5], [7, 7, 7, 7, 7, 7], [9, -1, 3, 8, 3, 0]])
    ids, back, _ = sorted_distinct(local)
    x = ID_HOLE
    assert ids.tolist() == [[2, 5, x, x, x, x], [0, 1, 2, 3, 4, 5], [7, x, x, x, x, x], [0, 3, 8, 9, x, x]]
    assert back.tolist() == [[1, 0, 1, 4, 1, 5], [0, 1, 2, 3, 4, 5], [0, 0, 0, 0, 0, 0], [3, 5, 1, 2, 1, 0]]
    got = ids.gather(1, back)
    assert torch.equal(torch.where(local >= 0, got, -1), local) and (got[local < 0] == ID_HOLE).all()
