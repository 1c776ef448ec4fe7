"""The triton backend's top-k selection kernels (``ops/triton/topk_select.py``) through ``fused_topk``, against
float64 from the definitions, V not a power of two: k 1 to the fast path's limit, k = V and k above the limit (the
torch pass), exact ties, rows a tile's candidates cannot hold (the exact second pass), tails of 1e-10 to 1e-50,
huge and tiny logits, masked rows, per-token temperatures, softcap, float32 operands with a precision, and bitwise
batch invariance of the ids, log-probs and tails (one token a call, permutations, token chunks, redone rows).
The kernels run on the GPU where there is one (compiled: they refuse CPU tensors), else in triton's interpreter;
the float64 truth stays on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

from logitless import fused_topk, last_backend, last_precision
from logitless.ops.triton import topk_select
from reference64 import device_for, on_cpu, rel_err

V, H, N = 1031, 48, 13
DEV = torch.device(device_for("triton"))


def topk(hidden, weight, k, **kw):
    """fused_topk with its tensors on DEV, the outputs back on the CPU (differentiable moves: CPU leaves get the
    gradients)."""
    to = lambda t: t.to(DEV) if torch.is_tensor(t) else t  # noqa: E731
    return on_cpu(fused_topk(to(hidden), to(weight), k, **{name: to(v) for name, v in kw.items()}))


def head(seed, scale=1.0, dtype=torch.float32, v=V):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(v, H, generator=g) * (scale * 3.0 / H ** 0.5)).to(dtype)
    return hidden, weight, g


def logp64(hidden, weight, temperature=1.0, softcap=None):
    """float64 log-softmax of the (softcapped) logits at ``temperature`` (a number, or one per token)."""
    z = hidden.double() @ weight.double().t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t = temperature.double().unsqueeze(-1) if torch.is_tensor(temperature) else temperature
    return torch.log_softmax(z / t, -1)


def same_selection(got, want, hidden, weight, temperature=1.0, softcap=None, rows=slice(None)):
    """got's ids are want's (float64's order) but where two ids' float64 log-probs lie within float32 rounding of
    each other (a softcapped head saturates many logits near the cap): there the order is the float32 logits'."""
    logp = logp64(hidden.detach(), weight.detach(), temperature, softcap)[rows]
    got, want = got[rows], want[rows]
    swapped = got != want
    assert swapped.float().mean() < 0.05
    assert ((logp.gather(-1, got) - logp.gather(-1, want)).abs() * swapped).max() < 2e-5


def at_ids(hidden, weight, ids, temperature=1.0, softcap=None):
    """float64 log-probs of ``ids`` and the log of the mass outside them."""
    logp = logp64(hidden, weight, temperature, softcap)
    return logp.gather(-1, ids), torch.logsumexp(logp.scatter(-1, ids, float("-inf")), -1)


def want64(hidden, weight, k, temperature=1.0, softcap=None):
    """float64's top k (ties to the lower id), their log-probs and the log of the mass outside them."""
    logp = logp64(hidden, weight, temperature, softcap)
    ids = torch.sort(logp.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    return (ids, *at_ids(hidden, weight, ids, temperature, softcap))


@pytest.mark.parametrize("k", [1, 5, 37, 128])
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_selection_matches_float64(k, softcap, seed):
    hidden, weight, g = head(seed)
    temperature = torch.rand(N, generator=g) + 0.5
    mask = torch.ones(N, dtype=torch.bool)
    mask[[2, 9]] = False
    h_in, w_in = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = topk(h_in, w_in, k, temperature=temperature, mask=mask, backend="triton", softcap=softcap,
                     precision="ieee")
    assert last_backend() == "triton" and last_precision().statistics == "ieee"
    a, b = torch.randn(N, k, generator=g), torch.randn(N, generator=g)
    ((out.logprobs * a).sum() + (out.tail_logprob * b).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ids, _, _ = want64(h64, w64, k, temperature, softcap)
    same_selection(out.ids, ids, hidden, weight, temperature, softcap, mask)
    # values and gradients of the op's own selection (equal to float64's but for near-equal pairs), in float64
    lp, tail = at_ids(h64, w64, torch.where(mask.unsqueeze(-1), out.ids, ids), temperature, softcap)
    m = mask.unsqueeze(-1)
    ((lp * a.double() * m).sum() + (tail * b.double() * mask).sum()).backward()
    assert (out.ids[~mask] == -1).all() and (out.logprobs[~mask] == 0).all() and (out.tail_logprob[~mask] == 0).all()
    assert (out.logprobs.double() - lp * m).abs().max() < 2e-5
    assert (out.tail_logprob.double() - tail * mask).abs().max() < 2e-5
    assert rel_err(h_in.grad, h64.grad) < 1e-4 and rel_err(w_in.grad, w64.grad) < 1e-4


@pytest.mark.parametrize("k", [300, 701])
def test_large_k_raises_the_candidates(k, seed):
    """k past 128 (a top-p nucleus of hundreds to thousands of ids) stays on the kernels: the first pass keeps
    at least SHARE x k candidates over the full tiles (C raised from 4), and the ids, log-probs, tail and
    gradients are float64's."""
    v = 4099
    hidden, weight, g = head(seed, v=v)
    tiles = topk_select.tiles_for(hidden.dtype, DEV)
    c = topk_select.first_candidates(k, v, tiles)
    assert c > topk_select.CANDIDATES or c == tiles.block_n
    assert topk_select.fast_path_ok(k, v, hidden.dtype, DEV)
    h_in, w_in = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = topk(h_in, w_in, k, backend="triton", precision="ieee")
    assert last_backend() == "triton"
    a, b = torch.randn(N, k, generator=g), torch.randn(N, generator=g)
    ((out.logprobs * a).sum() + (out.tail_logprob * b).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ids, _, _ = want64(h64, w64, k)
    same_selection(out.ids, ids, hidden, weight)
    lp, tail = at_ids(h64, w64, out.ids)
    ((lp * a.double()).sum() + (tail * b.double()).sum()).backward()
    assert (out.logprobs.double() - lp).abs().max() < 2e-5
    assert (out.tail_logprob.double() - tail).abs().max() < 2e-5
    assert rel_err(h_in.grad, h64.grad) < 1e-4 and rel_err(w_in.grad, w64.grad) < 1e-4


@pytest.mark.parametrize("k, v", [(topk_select.MAX_K + 1, 4099), (V, V)])
def test_k_beyond_the_fast_path(k, v, seed):
    """k above the kernels' limit, and k = V (no tail: -inf), take the torch pass: still exact."""
    hidden, weight, _ = head(seed, v=v)
    assert not topk_select.fast_path_ok(k, v, hidden.dtype, DEV)
    out = topk(hidden, weight, k, backend="triton", precision="ieee")
    assert last_backend() == "chunked"
    ids, lp, tail = want64(hidden, weight, k)
    same_selection(out.ids, ids, hidden, weight)      # k = V sorts all 1031 ids: near-equal pairs may swap
    assert (out.logprobs.double() - lp).abs().max() < 2e-5
    if k == v:
        assert torch.isneginf(out.tail_logprob).all()
    else:
        assert (out.tail_logprob.double() - tail).abs().max() < 2e-5


def test_exact_ties_go_to_the_lower_id():
    """Small integers: exact, equal logits across the tiles' borders; a softcap so small that tanh saturates."""
    g = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (V, H), generator=g).float()
    hidden = torch.randint(-2, 3, (6, H), generator=g).float()
    z = hidden @ weight.t()
    for k in (1, 5, 40):
        want = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :k]
        assert (z.gather(1, want[:, -1:]) == z).sum(-1).max() > 1      # the cut falls in a run of ties
        out = topk(hidden, weight, k, backend="triton", precision="ieee")
        assert last_backend() == "triton"
        assert torch.equal(out.ids, want), k
        capped = topk(hidden, weight, k, backend="triton", softcap=1e-3, precision="ieee")
        zc = (torch.tanh(z / 1e-3) * 1e-3).float()
        assert torch.equal(capped.ids, torch.sort(zc, dim=-1, descending=True, stable=True).indices[:, :k])


def clustered(seed):
    """A head whose top ids crowd into one vocabulary tile (rows 3..60 near one direction): the first pass's
    candidates cannot hold them, the exact second pass must take those rows."""
    hidden, weight, g = head(seed)
    weight[3:60] = 2.0 * hidden[:1].mean(0) / hidden[:1].norm() + 0.05 * torch.randn(57, H, generator=g)
    hidden[: N // 2] = hidden[0] + 0.3 * torch.randn(N // 2, H, generator=g)
    return hidden, weight


def test_rows_the_candidates_cannot_hold_are_redone_exactly(seed):
    hidden, weight = clustered(seed)
    k = 20
    sel = topk_select.select(hidden.to(DEV), weight.to(DEV), torch.ones(N, device=DEV), k)
    assert sel.fallback > 0
    out = topk(hidden, weight, k, backend="triton", precision="ieee")
    ids, lp, tail = want64(hidden, weight, k)
    # the crowded rows' logits lie close together: an order float32 cannot resolve may differ from float64's
    same_selection(out.ids, ids, hidden, weight)
    lp, tail = at_ids(hidden, weight, out.ids)
    assert (out.logprobs.double() - lp).abs().max() < 2e-5
    assert (out.tail_logprob.double() - tail).abs().max() < 2e-5


@pytest.mark.parametrize("power", [10, 20, 30, 40, 50])
def test_tiny_tails(power):
    """The k hold 1 - 10^-p of the mass: the tail is summed over the other ids (1 - sum p would be 0)."""
    k = 7
    gen = torch.Generator().manual_seed(power)
    z = torch.empty(V, dtype=torch.float64)
    top = torch.randperm(V, generator=gen)[:k]
    rest_ids = torch.ones(V, dtype=torch.bool)
    rest_ids[top] = False
    z[top] = torch.rand(k, generator=gen, dtype=torch.float64)
    rest = -30.0 + torch.rand(V - k, generator=gen, dtype=torch.float64)
    share = torch.logsumexp(rest, 0) - torch.logsumexp(torch.cat([z[top], rest]), 0)
    z[rest_ids] = rest - share + power * math.log(0.1)
    weight = torch.zeros(V, H)
    weight[:, 0] = z.float()
    hidden = torch.zeros(2, H)
    hidden[:, 0] = 1.0
    z32 = weight[:, 0].double()
    want = torch.logsumexp(z32[rest_ids], 0) - torch.logsumexp(z32, 0)
    assert abs(float(want) - power * math.log(0.1)) < 1e-3
    out = topk(hidden, weight, k, backend="triton", precision="ieee")
    assert last_backend() == "triton"
    assert torch.equal(out.ids[0].sort().values, top.sort().values)
    assert (out.tail_logprob.double() - want).abs().max() < 2e-5 * abs(float(want))


@pytest.mark.parametrize("scale", [1e4, 1e-6])
def test_huge_and_tiny_logits(scale, seed):
    hidden, weight, _ = head(seed, scale=scale)
    k = 9
    out = topk(hidden, weight, k, backend="triton", precision="ieee")
    ids, lp, tail = want64(hidden, weight, k)
    assert torch.equal(out.ids, ids)
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.tail_logprob).all()
    # the float32 products' own rounding: a dot of H terms is ~sqrt(H) half-ulps of sum |h_i w_i| off (the GPU's
    # tiled IEEE dot sums in another order than the CPU's: 0.032 at logits of 1.4e5, 2.3e-7 of them, one H100);
    # at scale 1 the log-probs' own bound
    terms = float((hidden.double().abs() @ weight.double().abs().t()).max())
    tol = max(2e-5, 2 * H ** 0.5 * 2.0 ** -24 * terms)
    assert (out.logprobs.double() - lp).abs().max() < tol
    assert (out.tail_logprob.double() - tail).abs().max() < tol


@pytest.mark.parametrize("precision", ["bf16x3", "tf32"])
def test_float32_operands_with_a_precision(precision, seed):
    """float32 operands: the selection and sums are those of the precision's logits (within its error of
    float64), and the record says what ran."""
    hidden, weight, _ = head(seed)
    k = 6
    out = topk(hidden, weight, k, backend="triton", precision=precision)
    assert last_backend() == "triton" and last_precision().statistics == precision
    ids, lp, tail = want64(hidden, weight, k)
    tol = 1e-2 if precision == "tf32" else 1e-4      # TF32-rounded operands: ~1e-3 relative per logit
    assert (out.logprobs.double() - lp).abs().max() < tol
    assert (out.tail_logprob.double() - tail).abs().max() < tol
    ref = fused_topk(hidden, weight, k, backend="chunked", precision=precision)
    assert (out.ids == ref.ids).float().mean() > 0.9


def test_bfloat16_operands(seed):
    hidden, weight, _ = head(seed, dtype=torch.bfloat16)
    k = 11
    out = topk(hidden, weight, k, backend="triton")
    ids, lp, tail = want64(hidden, weight, k)
    close = (out.logprobs.double() - lp).abs().max()
    assert close < 1e-4 and (out.tail_logprob.double() - tail).abs().max() < 1e-4
    assert (out.ids == ids).float().mean() > 0.9


def test_batch_invariance(seed, monkeypatch):
    """ids, log-probs and tails: the same bits for a token alone, in the batch, permuted, with masked rows, and in
    token chunks of a small workspace; rows the second pass redoes included."""
    hidden, weight = clustered(seed)
    k = 20
    temperature = torch.full((N,), 0.75)
    whole = topk(hidden, weight, k, temperature=temperature, backend="triton", softcap=6.0, precision="ieee")
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
    shuffled = topk(hidden[perm], weight, k, temperature=temperature[perm], backend="triton", softcap=6.0,
                          precision="ieee")
    mask = torch.ones(N, dtype=torch.bool)
    mask[1::3] = False
    masked = topk(hidden, weight, k, temperature=0.75, mask=mask, backend="triton", softcap=6.0,
                        precision="ieee")
    for f in range(3):
        assert torch.equal(shuffled[f], whole[f][perm]), f
        assert torch.equal(masked[f][mask], whole[f][mask]), f
    for i in (0, 5, N - 1):
        one = topk(hidden[i:i + 1], weight, k, temperature=0.75, backend="triton", softcap=6.0,
                         precision="ieee")
        for f in range(3):
            assert torch.equal(one[f][0], whole[f][i]), (i, f)
    monkeypatch.setenv("LOGITLESS_TOPK_BYTES", "1")          # one token tile a chunk
    chunked = topk(hidden, weight, k, temperature=0.75, backend="triton", softcap=6.0, precision="ieee")
    for f in range(3):
        assert torch.equal(chunked[f], whole[f]), f
