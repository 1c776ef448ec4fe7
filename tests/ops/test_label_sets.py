"""k ids per token: fused_logprobs with labels [..., k] and fused_topk, against float64 written from the
definitions (materialised logits, torch autograd), on every backend, odd shapes (V=4099, H=96, 7 tokens, k=5),
chunk boundaries inside the vocabulary and the tokens, temperatures of every layout, softcap, ignored / masked
rows, ties, a tail of 1e-9, bad input, torch.compile."""
from __future__ import annotations

import pytest
import torch

from logitless import fused_logprobs, fused_topk, last_backend, last_precision
from logitless.ops import label_set_function
from logitless.ops.function import OpOptions
from reference64 import device_for, moved, rel_err

V, H, K = 4099, 96, 5
LEAD = (1, 7)
BACKENDS = ("reference", "chunked", "triton")
TOL = {torch.float32: (2e-5, 2e-5, 1e-4), torch.bfloat16: (1e-3, 2e-3, 1e-2)}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # the chunked backend and the vocabulary pass cut 4099 columns into ragged tiles, and 7 tokens into 2 calls
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * 700))


def logits64(hidden, weight, temperature, softcap):
    z = hidden.double() @ weight.double().t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t = temperature.double() if torch.is_tensor(temperature) else float(temperature)
    if torch.is_tensor(t):
        t = torch.broadcast_to(t, hidden.shape[:-1]).unsqueeze(-1)
    return z / t


def distinct_ids(lead, k, vocab, gen):
    n = int(torch.tensor(lead).prod())
    return torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(n)]).view(*lead, k)


def inputs(dtype, seed, gen=None):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*LEAD, H, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(dtype).requires_grad_()
    return hidden, weight, gen


def temperature_of(kind, gen):
    if kind == "scalar":
        return 0.7
    if kind == "sequence":
        return torch.rand(LEAD[0], 1, generator=gen) + 0.5
    return torch.rand(*LEAD, generator=gen) + 0.5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("temp", ["scalar", "sequence", "token"])
def test_k_labels_match_float64(backend, softcap, temp, seed):
    hidden, weight, gen = inputs(torch.float32, seed)
    temperature = temperature_of(temp, gen)
    ids = distinct_ids(LEAD, K, V, gen)
    ids[0, 2] = -100                       # an ignored token: all k ids are ignore_index
    dev = device_for(backend)
    h_in, w_in, ids_in, t_in = moved(dev, hidden, weight, ids, temperature)
    # IEEE float32 products (the default on the CPU; on CUDA the default is the bf16x3 split, held to its own
    # bounds in tests/test_precision.py): the ids' gathers and gradients held to float32's error
    out = fused_logprobs(h_in, w_in, ids_in, temperature=t_in, backend=backend, softcap=softcap, precision="ieee")
    assert last_backend() == backend and last_precision() == ("ieee", "ieee")
    assert out.logprobs.shape == ids.shape and out.entropy.shape == LEAD
    assert out.logprobs.dtype == out.entropy.dtype == torch.float32
    g_lp, g_ent = torch.randn(ids.shape, generator=gen), torch.randn(LEAD, generator=gen)
    ((out.logprobs * g_lp.to(dev)).sum() + (out.entropy * g_ent.to(dev)).sum()).backward()
    out = type(out)(out.logprobs.cpu(), out.entropy.cpu())
    if dev != "cpu":
        hidden.grad, weight.grad = h_in.grad.cpu(), w_in.grad.cpu()

    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax(logits64(h64, w64, temperature, softcap), -1)
    valid = (ids != -100).all(-1)
    want = logp.gather(-1, ids.clamp(min=0)) * valid.unsqueeze(-1)
    ent = -(logp.exp() * logp).sum(-1) * valid
    ((want * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    tol_lp, tol_ent, tol_g = TOL[torch.float32]
    assert (out.logprobs.double() - want).abs().max() < tol_lp
    assert (out.entropy.double() - ent).abs().max() < tol_ent
    assert (out.logprobs[0, 2] == 0).all() and out.entropy[0, 2] == 0
    assert rel_err(hidden.grad, h64.grad) < tol_g and rel_err(weight.grad, w64.grad) < tol_g
    assert hidden.grad[0, 2].abs().max() == 0          # an ignored token gets no gradient


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_k_labels_bfloat16_and_no_checks(backend, seed):
    """bf16 operands (float32 statistics), and check_inputs=False (every row computed, ignored ones zeroed)
    giving the same numbers as the checked path."""
    hidden, weight, gen = inputs(torch.bfloat16, seed)
    ids = distinct_ids(LEAD, K, V, gen)
    ids[0, 4] = -100
    g = torch.randn(ids.shape, generator=gen)
    grads = []
    for check in (True, False):
        hidden.grad = weight.grad = None
        out = fused_logprobs(hidden, weight, ids, backend=backend, check_inputs=check, with_entropy=False)
        assert out.entropy is None and out.logprobs.dtype == torch.float32
        (out.logprobs * g).sum().backward()
        grads.append((out.logprobs.detach(), hidden.grad.clone(), weight.grad.clone()))
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax(logits64(h64, w64, 1.0, None), -1)
    want = logp.gather(-1, ids.clamp(min=0)) * (ids != -100).all(-1, keepdim=True)
    (want * g.double()).sum().backward()
    tol_lp, _, tol_g = TOL[torch.bfloat16]
    for lp, gh, gw in grads:
        assert (lp.double() - want).abs().max() < tol_lp
        assert rel_err(gh, h64.grad) < tol_g and rel_err(gw, w64.grad) < tol_g
    # the checked and unchecked calls sum the same float32 log-prob in two orders: a few ulps of its size apart
    # (1.9e-6 at -10 on one CI draw)
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-6, rtol=1e-6)


def test_k_labels_one_id_equals_the_single_label_op(seed):
    hidden, weight, gen = inputs(torch.float32, seed)
    labels = torch.randint(0, V, LEAD, generator=gen)
    one = fused_logprobs(hidden, weight, labels, backend="chunked", temperature=0.9)
    k1 = fused_logprobs(hidden, weight, labels.unsqueeze(-1), backend="chunked", temperature=0.9)
    # two summation orders of one float32 log-prob: a few ulps of |log-prob| apart (2.4e-6 at -6.4 on one CI draw)
    torch.testing.assert_close(k1.logprobs[..., 0], one.logprobs, atol=2e-6, rtol=1e-6)
    # the same pass over the same products: equal bits when MKL splits both products alike (300 of 300 seeds
    # alone), within float32's rounding when a loaded machine makes MKL pick other threads for one of them (seen once)
    torch.testing.assert_close(k1.entropy, one.entropy, atol=2e-6, rtol=0)


def test_k_labels_bad_input(seed):
    hidden, weight, gen = inputs(torch.float32, seed)
    ids = distinct_ids(LEAD, K, V, gen)
    bad = ids.clone()
    bad[0, 1, 2] = -100
    with pytest.raises(ValueError, match="some but not all"):
        fused_logprobs(hidden, weight, bad)
    bad = ids.clone()
    bad[0, 3, 1] = bad[0, 3, 4]
    with pytest.raises(ValueError, match="repeats an id"):
        fused_logprobs(hidden, weight, bad)
    bad = ids.clone()
    bad[0, 0, 0] = V
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4099\)"):
        fused_logprobs(hidden, weight, bad)
    with pytest.raises(ValueError, match="k == 0"):
        fused_logprobs(hidden, weight, ids[..., :0])
    with pytest.raises(ValueError, match="labels shape"):
        fused_logprobs(hidden, weight, ids[:, :3])


def topk64(hidden, weight, k, temperature, softcap):
    logp = torch.log_softmax(logits64(hidden, weight, temperature, softcap), -1)
    order = torch.sort(logp.detach(), dim=-1, descending=True, stable=True).indices[..., :k]
    lp = logp.gather(-1, order)
    tail = torch.logsumexp(logp.scatter(-1, order, float("-inf")), -1)
    return order, lp, tail


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 2.5])
def test_topk_matches_float64(backend, softcap, seed):
    hidden, weight, gen = inputs(torch.float32, seed)
    temperature = temperature_of("token", gen)
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[0, 5] = False
    dev = device_for(backend)
    h_in, w_in, t_in, m_in = moved(dev, hidden, weight, temperature, mask)
    # IEEE float32 products, as in test_k_labels_match_float64 (a split's ~1e-4 could swap near-tied ids here)
    out = fused_topk(h_in, w_in, K, temperature=t_in, mask=m_in, backend=backend, softcap=softcap, precision="ieee")
    # the torch pass ran, or the triton backend's selection kernels
    assert last_backend() == {"reference": "reference", "chunked": "chunked", "triton": "triton"}[backend]
    assert last_precision().statistics == "ieee"
    assert out.ids.dtype == torch.int64 and out.logprobs.dtype == out.tail_logprob.dtype == torch.float32
    g_lp, g_tail = torch.randn(*LEAD, K, generator=gen), torch.randn(LEAD, generator=gen)
    ((out.logprobs * g_lp.to(dev)).sum() + (out.tail_logprob * g_tail.to(dev)).sum()).backward()
    out = type(out)(out.ids.cpu(), out.logprobs.cpu(), out.tail_logprob.cpu())
    if dev != "cpu":
        hidden.grad, weight.grad = h_in.grad.cpu(), w_in.grad.cpu()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ids, lp, tail = topk64(h64, w64, K, temperature, softcap)
    m = mask.unsqueeze(-1)
    ((lp * g_lp.double() * m).sum() + (tail * g_tail.double() * mask).sum()).backward()
    assert torch.equal(out.ids[mask], ids[mask])
    assert (out.ids[~mask] == -1).all() and (out.logprobs[~mask] == 0).all() and (out.tail_logprob[~mask] == 0).all()
    assert (out.logprobs.double() - lp * m).abs().max() < 2e-5
    assert (out.tail_logprob.double() - tail * mask).abs().max() < 2e-5
    assert rel_err(hidden.grad, h64.grad) < 1e-4 and rel_err(weight.grad, w64.grad) < 1e-4
    assert hidden.grad[0, 5].abs().max() == 0


def test_topk_tail_of_one_in_a_billion():
    """The top-k hold 1 - 1e-9 of the mass: the tail is summed over the other ids, not 1 - sum p, which float32
    cannot hold (1 - 1e-9 rounds to 1). A one-hot hidden state makes the logits weight[:, 0] exactly."""
    gen = torch.Generator().manual_seed(7)
    z = torch.empty(V, dtype=torch.float64)
    z[:K] = torch.rand(K, generator=gen, dtype=torch.float64)               # the top 5, in [0, 1)
    rest = -30.0 + torch.rand(V - K, generator=gen, dtype=torch.float64)   # the other 4094 ids, around -29.5
    # shift the others so that their share of the mass is 1e-9 exactly (in float64)
    share = torch.logsumexp(rest, 0) - torch.logsumexp(torch.cat([z[:K], rest]), 0)
    z[K:] = rest - share + torch.log(torch.tensor(1e-9, dtype=torch.float64))
    weight = torch.zeros(V, H)
    weight[:, 0] = z.float()
    hidden = torch.zeros(1, H)
    hidden[0, 0] = 1.0
    z32 = weight[:, 0].double()                                             # what float32 logits hold
    want = torch.logsumexp(z32[K:], 0) - torch.logsumexp(z32, 0)
    assert abs(float(want) - torch.log(torch.tensor(1e-9)).item()) < 1e-5
    for backend in ("reference", "chunked"):
        out = fused_topk(hidden, weight, K, backend=backend)
        assert torch.equal(out.ids[0].sort().values, torch.arange(K))
        assert abs(out.tail_logprob[0].double() - want) < 1e-5, (backend, out.tail_logprob, want)
        # the cancelling way in float32 cannot see it
        naive = torch.log1p(-out.logprobs.exp().sum())
        assert not abs(float(naive) - float(want)) < 1.0
        # the tail outside given ids (the student's, at a teacher's ids) is summed the same way
        options = OpOptions(backend=backend, with_entropy=False)
        _, _, tail, _ = label_set_function.fused_logprobs_k(hidden, weight, torch.arange(K).flip(0).unsqueeze(0),
                                                            torch.ones(1), options, with_tail=True)
        assert abs(tail[0].double() - want) < 1e-5, (backend, tail, want)


def test_topk_ties_go_to_the_lower_id():
    """Equal logits: small integers in hidden and weight make every product exact, so among 4099 ids many logits
    are equal, across the chunks' borders; and a softcap so small that tanh saturates (every large logit is c)."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randint(-2, 3, (V, H), generator=gen).float()
    hidden = torch.randint(-2, 3, (6, H), generator=gen).float()
    z = hidden @ weight.t()
    want = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :K]
    assert (z.gather(1, want[:, -1:]) == z).sum(-1).max() > 1      # the cut at k falls inside a run of ties
    for backend in ("reference", "chunked"):
        assert torch.equal(fused_topk(hidden, weight, K, backend=backend).ids, want), backend
        capped = fused_topk(hidden, weight, K, backend=backend, softcap=1e-3)
        zc = (torch.tanh(z / 1e-3) * 1e-3).float()
        assert torch.equal(capped.ids, torch.sort(zc, dim=-1, descending=True, stable=True).indices[:, :K])


def test_topk_bad_input(seed):
    hidden, weight, gen = inputs(torch.float32, seed)
    for k in (0, -1, V + 1):
        with pytest.raises(ValueError, match=f"k={k}"):
            fused_topk(hidden, weight, k)
    with pytest.raises(TypeError, match="k must be an int"):
        fused_topk(hidden, weight, True)
    with pytest.raises(TypeError, match="mask must be a bool"):
        fused_topk(hidden, weight, 3, mask=torch.ones(LEAD))
    with pytest.raises(ValueError, match="mask shape"):
        fused_topk(hidden, weight, 3, mask=torch.ones(7, dtype=torch.bool))
    with pytest.raises(ValueError, match="reduce_grad_hidden=False has no effect without tp_group"):
        fused_topk(hidden, weight, 3, reduce_grad_hidden=False)
    out = fused_topk(hidden, weight, V, backend="reference")          # k == V: every id, no tail
    assert torch.isneginf(out.tail_logprob).all()
    torch.testing.assert_close(out.logprobs.exp().sum(-1), torch.ones(LEAD), atol=1e-5, rtol=0)


def test_compile_fullgraph(seed):
    hidden, weight, gen = inputs(torch.float32, seed)
    ids = distinct_ids(LEAD, K, V, gen)

    def f(h, w, i):
        a = fused_logprobs(h, w, i, backend="chunked")
        t = fused_topk(h, w, 3, backend="chunked")
        return a.logprobs.sum() + a.entropy.sum() + t.logprobs.sum() + t.tail_logprob.sum()

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(hidden, weight, ids)
    got.backward()
    gh, gw = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    want = f(hidden, weight, ids)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(gh, hidden.grad)
    torch.testing.assert_close(gw, weight.grad)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_no_token_and_every_token_masked(backend, seed):
    """Zero tokens, every token ignored / masked: zeros out, zero gradients, no kernel fed an empty batch."""
    _, weight, gen = inputs(torch.float32, seed)
    empty = torch.randn(0, H, requires_grad=True)
    out = fused_logprobs(empty, weight, torch.zeros(0, K, dtype=torch.long), backend=backend)
    assert out.logprobs.shape == (0, K) and out.entropy.shape == (0,)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert weight.grad.abs().max() == 0
    top = fused_topk(empty, weight, K, backend=backend)
    assert top.ids.shape == (0, K) and top.tail_logprob.shape == (0,)
    hidden = torch.randn(4, H, generator=gen, requires_grad=True)
    top = fused_topk(hidden, weight, K, mask=torch.zeros(4, dtype=torch.bool), backend=backend)
    assert (top.ids == -1).all() and (top.logprobs == 0).all() and (top.tail_logprob == 0).all()
    out = fused_logprobs(hidden, weight, torch.full((4, K), -100), backend=backend)
    (top.logprobs.sum() + top.tail_logprob.sum() + out.logprobs.sum() + out.entropy.sum()).backward()
    assert hidden.grad.abs().max() == 0 and (out.logprobs == 0).all()


def test_k_labels_triton_batch_invariant(seed):
    """The triton backend's k-id log-probs and entropy: the same bits for a token alone, in a batch and in a
    permuted batch (its statistics kernels and the ids' products sum in an order fixed per token)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(9, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    ids = distinct_ids((9,), K, V, gen)
    temperature = torch.rand(9, generator=gen) + 0.5
    hidden, weight, ids, temperature = moved(device_for("triton"), hidden, weight, ids, temperature)
    whole = fused_logprobs(hidden, weight, ids, temperature=temperature, backend="triton", softcap=3.0)
    perm = torch.randperm(9, generator=gen).to(hidden.device)
    shuffled = fused_logprobs(hidden[perm], weight, ids[perm], temperature=temperature[perm], backend="triton",
                              softcap=3.0)
    assert torch.equal(shuffled.logprobs, whole.logprobs[perm]) and torch.equal(shuffled.entropy, whole.entropy[perm])
    for i in (0, 4, 8):
        one = fused_logprobs(hidden[i:i + 1], weight, ids[i:i + 1], temperature=temperature[i:i + 1],
                             backend="triton", softcap=3.0)
        assert torch.equal(one.logprobs[0], whole.logprobs[i]) and torch.equal(one.entropy[0], whole.entropy[i])


def test_selection_without_host_read_is_the_same(seed):
    """check_inputs=False's selection (no host read of which rows hold a tie at the k-th value: every row
    re-taken by the rule) takes the columns the stable sort takes, ties to the lower column: on tiles of
    integer products (runs of equal logits across the cut) and of random ones."""
    from logitless.ops.label_sets import _chunk_topk
    gen = torch.Generator().manual_seed(seed)

    def crosses_the_cut(z):
        """Some row holds a run of equal values across the cut at k (the case the rule is for)."""
        kth = torch.sort(z, dim=-1, descending=True, stable=True).values[:, K - 1:K]
        return ((z == kth).sum(-1) > (torch.sort(z, dim=-1, descending=True).values[:, :K] == kth).sum(-1)).any()

    # 9 rows of integer products hold such a run on most draws, not all (seed 4013655215: none): draw again
    for _ in range(50):
        small_ints = torch.randint(-2, 3, (9 + 301, H), generator=gen).float()
        ties = small_ints[:9] @ small_ints[9:].t()
        if crosses_the_cut(ties):
            break
    assert crosses_the_cut(ties)
    plain = torch.randn(9, 301, generator=gen)
    for z in (ties, plain, ties[:, :3]):
        want = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :K]
        for host_read in (True, False):
            vals, cols = _chunk_topk(z.clone(), K, host_read)
            assert torch.equal(cols.sort(dim=1).values, want.sort(dim=1).values), host_read
            assert torch.equal(vals, z.gather(1, cols))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onehot_dw_without_host_read(dtype, seed, monkeypatch):
    """check_inputs=False's one-hot d_weight (every pair, sizes fixed by the shapes) against the compacted one and
    float64: ids repeated across tokens (a few ids shared by many), ids of another rank (-1), zero coefficients,
    blocks of 7 pairs (segments cut by the blocks)."""
    from logitless.ops import label_sets
    monkeypatch.setattr(label_sets, "GATHER_ELEMENTS", 7 * H)
    gen = torch.Generator().manual_seed(seed)
    n, vocab = 23, 41
    hidden = torch.randn(n, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:K] for _ in range(n)])
    ids[ids % 3 == 0] = ids[ids % 3 == 0] % 4            # a few ids appear in many tokens
    ids[3, 1] = ids[5, 0] = -1
    c = torch.randn(n, K, generator=gen)
    c[7, 2] = 0.0
    start = torch.randn(vocab, H, generator=gen).to(dtype)
    want = start.double().clone()
    keep = (ids >= 0) & (c != 0)
    for i, j in keep.nonzero().tolist():
        want[ids[i, j]] += c[i, j].double() * hidden[i].double()
    got = {}
    for host_read in (True, False):
        dw = start.clone()
        label_sets.add_onehot_dw(dw, hidden, ids, c, host_read=host_read)
        got[host_read] = dw
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for host_read, dw in got.items():
        assert rel_err(dw, want) <= tol, (host_read, rel_err(dw, want))
    if dtype == torch.float32:
        assert (got[True] - got[False]).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_topk_unchecked_reads_nothing_on_the_host(backend, seed):
    """fused_topk(check_inputs=False): no host read in the forward or the backward (``host_reads``, which sees
    the checked call's), the same ids, log-probs, tail and gradients as the checked call, the masked rows (NaN
    temperature padding there) zero and gradient-free."""
    from host_reads import host_reads
    hidden, weight, gen = inputs(torch.float32, seed)
    mask = torch.ones(LEAD, dtype=torch.bool)
    mask[0, 2] = mask[0, 5] = False
    temperature = (torch.rand(LEAD, generator=gen) + 0.5).masked_fill(~mask, float("nan"))
    a, b = torch.randn(*LEAD, K, generator=gen), torch.randn(LEAD, generator=gen)
    results = {}
    for check in (False, True):
        hidden.grad = weight.grad = None
        with host_reads() as seen:
            top = fused_topk(hidden, weight, K, mask=mask, backend=backend, check_inputs=check,
                             temperature=temperature if not check else temperature.nan_to_num(1.0))
            ((top.logprobs * a).sum() + (top.tail_logprob * b).sum()).backward()
        assert (seen == []) == (not check), seen
        results[check] = (top.ids, top.logprobs.detach(), top.tail_logprob.detach(), hidden.grad.clone(),
                          weight.grad.clone())
    assert torch.equal(results[False][0], results[True][0])
    assert (results[False][0][~mask] == -1).all() and (results[False][3][~mask] == 0).all()
    for got, want in zip(results[False][1:], results[True][1:], strict=True):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
    with pytest.raises(TypeError, match="check_inputs must be a bool"):
        fused_topk(hidden, weight, K, check_inputs=None)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_k_labels_unchecked_reads_nothing_on_the_host(with_entropy, seed):
    """fused_logprobs with labels [..., k] and check_inputs=False: no host read forward or backward (the one-hot
    d_weight in its fixed-size form), the same numbers as the checked call."""
    from host_reads import host_reads
    hidden, weight, gen = inputs(torch.float32, seed)
    ids = distinct_ids(LEAD, K, V, gen)
    ids[0, 4] = -100
    g = torch.randn(ids.shape, generator=gen)
    results = {}
    for check in (False, True):
        hidden.grad = weight.grad = None
        with host_reads() as seen:
            out = fused_logprobs(hidden, weight, ids, backend="chunked", check_inputs=check,
                                 with_entropy=with_entropy)
            loss = (out.logprobs * g).sum() + (out.entropy.sum() if with_entropy else 0.0)
            loss.backward()
        assert (seen == []) == (not check), seen
        results[check] = (out.logprobs.detach(), hidden.grad.clone(), weight.grad.clone())
    for got, want in zip(results[False], results[True], strict=True):
        assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
