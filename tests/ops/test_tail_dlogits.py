"""The triton backend's backward of an op with a tail output (``ops/triton/tail_dlogits.py``: the closed form of
``ops/tail_backward.py`` formed in its dlogits kernel, then the plain backward's gradient products), against
float64 on fresh random inputs: the kernel's dlogits of one vocabulary chunk, and the ops' gradients with
softcap and temperature, ignored and masked rows, an id repeated within a row (unchecked), d_hidden or d_weight
alone, token and vocabulary chunks, and a tail of e^-40 left by ids that cover all but a few columns (where the
dense form, -G' p over every column corrected at the ids, is shown wrong on the same inputs)."""
from __future__ import annotations

import math

import pytest
import torch

import logitless
from logitless import last_backend, last_precision
from logitless.ops import label_set_function, tail_backward
from logitless.ops.function import OpOptions
from logitless.ops.triton.common import INTERPRETING
from reference64 import device_for, logits64, on_cpu, rel_err

pytestmark = pytest.mark.skipif(not (INTERPRETING or torch.cuda.is_available()),
                                reason="the triton backend needs a GPU or TRITON_INTERPRET=1")
DEV = device_for("triton")


def _ids(n, v, k, gen):
    return torch.stack([torch.randperm(v, generator=gen)[:k] for _ in range(n)])


def _head(n, h, v, gen, std=3.0):
    return torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen) * (std / h ** 0.5)


def _set64(z, ids, valid, with_lse=False):
    """float64 (lp [n, k], tail [n]) of the forward's function of the logits z [n, V]: lse over the ids (each
    occurrence) and the columns outside them; 0 on rows not valid (with_lse: and lse [n])."""
    safe = ids.clamp(min=0)
    outside = torch.ones_like(z, dtype=torch.bool).scatter(-1, safe, False)
    lse_tail = torch.logsumexp(z.masked_fill(~outside, float("-inf")), -1)
    zk = z.gather(-1, safe)
    lse = torch.logsumexp(torch.cat([zk, lse_tail.unsqueeze(-1)], -1), -1)
    lp, tail = zk - lse.unsqueeze(-1), lse_tail - lse
    out = lp * valid.unsqueeze(-1), tail * valid
    return out + (lse,) if with_lse else out


def _k_call(h, w, ids, temperature=None, softcap=None, check_inputs=True, backend="triton"):
    """label_set_function.fused_logprobs_k with the tail (the distillation's tail bucket's op) -> (lp, tail)."""
    n = ids.shape[0]
    inv_temp = torch.ones(n, device=h.device) if temperature is None else (1.0 / temperature).to(h.device)
    opts = OpOptions(backend=backend, with_entropy=False, softcap=softcap, check_inputs=check_inputs,
                     precision="ieee", grad_precision="ieee")
    lp, _, tail, _ = label_set_function.fused_logprobs_k(h, w, ids.to(h.device), inv_temp, opts, with_tail=True)
    return lp, tail


# ------------------------------------------------------------------------------------------ the kernel alone

@pytest.mark.parametrize("k", [5, 20])
@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("tail_grad", [True, False])
def test_kernel_dlogits_of_a_chunk(k, softcap, tail_grad, seed):
    """dlogits of vocabulary rows 200..900 of V 1031 (the ids global rows: some in the chunk, some not), rows with
    no id here (-1), an id repeated, per-token temperature: the closed form in float64 of the exact logits."""
    from logitless.ops.triton import tail_dlogits
    gen = torch.Generator().manual_seed(seed)
    n, h, v, col0, cols = 23, 40, 1031, 200, 700
    hidden, weight = _head(n, h, v, gen)
    ids = _ids(n, v, k, gen)
    ids[3] = -1                      # an ignored row (or every id on another rank)
    ids[5, 1:3] = -1                 # ids another rank holds
    ids[7, 1] = ids[7, 0]            # a repeated id (only unchecked calls can pass one)
    inv_t = 0.5 + torch.rand(n, generator=gen)
    raw64 = hidden.double() @ weight.double().t()
    z64 = (softcap * torch.tanh(raw64 / softcap) if softcap else raw64) * inv_t.double().unsqueeze(1)
    valid = torch.ones(n, dtype=torch.bool)
    lp64, tail64, lse64 = _set64(z64, ids, valid, with_lse=True)
    g_lp = torch.randn(n, k, generator=gen)
    g_tail = torch.randn(n, generator=gen) if tail_grad else None
    terms, G = tail_backward.terms(ids, lse64.float(), tail64.float(), lp64.float(), g_lp, g_tail)
    out = torch.full((n, cols), float("nan"))
    on = (lambda t: t.to(DEV)) if DEV != "cpu" else (lambda t: t)
    # the kernel takes each row's ids distinct (``unique_ids``: the repeat's c summed into one entry)
    t_dev = tail_backward.TailTerms(*(None if t is None else on(t) for t in tail_backward.unique_ids(terms)))
    dl = tail_dlogits.dlogits_chunk(on(hidden), on(weight[col0:col0 + cols]), col0, t_dev, on(inv_t),
                                    on(lse64.float()), on(G), on(out), softcap).cpu()
    # float64 of the float32 coefficients the kernel is given
    zc = z64[:, col0:col0 + cols]
    lse_tail = terms.lse_tail.double().unsqueeze(1)
    gt = (g_tail.double() if tail_grad else torch.zeros(n, dtype=torch.float64)).unsqueeze(1)
    want = gt * (zc - lse_tail).clamp(max=0).exp() - G.double().unsqueeze(1) * (zc - lse64.unsqueeze(1)).exp()
    rel = ids - col0
    inside = (ids >= 0) & (rel >= 0) & (rel < cols)
    member = torch.zeros(n, cols, dtype=torch.bool)
    at = torch.zeros(n, cols, dtype=torch.float64)
    for i, j in inside.nonzero().tolist():
        member[i, rel[i, j]] = True
        at[i, rel[i, j]] += terms.at_ids[i, j].double()
    assert member[7].sum() <= k - 1 and inside.any()
    want = torch.where(member, at, want) * inv_t.double().unsqueeze(1)
    if softcap:
        want = want * (1 - torch.tanh(raw64[:, col0:col0 + cols] / softcap) ** 2)
    assert torch.isfinite(dl).all()
    # float32 of terms up to G / T (the -G p term's size at p ~ 1) and of the entries themselves
    scale = max(1.0, want.abs().max().item(), (G * inv_t).abs().max().item())
    err = (dl.double() - want).abs().max().item()
    assert err <= 2e-6 * scale, (err, scale)


def test_unique_ids_sums_repeats():
    """``tail_backward.unique_ids``: per row, one entry per distinct id with the sum of its occurrences' c,
    ascending, then holes (ID_HOLE) with 0 for the other occurrences and for -1 ids (their c is never read)."""
    from logitless.ops.label_sets import ID_HOLE
    ids = torch.tensor([[5, 2, 5, 5, -1], [-1, -1, 3, 1, 3], [0, 1, 2, 3, 4]])
    c = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0], [1.0, 2.0, 4.0, 8.0, 16.0], [1.0, 2.0, 4.0, 8.0, 16.0]])
    t = tail_backward.unique_ids(tail_backward.TailTerms(ids, c, None, torch.zeros(3)))
    for row in range(3):
        real = t.ids[row] < ID_HOLE
        assert torch.equal(t.ids[row][real], t.ids[row][real].sort().values) and not real[int(real.sum()):].any()
        got = {int(i): float(v) for i, v in zip(t.ids[row], t.at_ids[row], strict=True) if i < ID_HOLE}
        want: dict = {}
        for i, v in zip(ids[row].tolist(), c[row].tolist(), strict=True):
            if i >= 0:
                want[i] = want.get(i, 0.0) + v
        assert got == want, (row, got, want)
        assert (t.at_ids[row][~real] == 0).all()
        assert int(real.sum()) == len(want)


# ------------------------------------------------------------------------------------------ the ops

def _check_grads(h, w, h64, w64, bound=1e-4):
    assert rel_err(h.grad, h64.grad) <= bound, rel_err(h.grad, h64.grad)
    assert rel_err(w.grad, w64.grad) <= bound, rel_err(w.grad, w64.grad)


def test_tail_of_e_minus_40_ids_cover_all_but_a_few(seed):
    """k = V - 4: each token's 4 columns outside its ids lie ~40 nats under the rest, P_tail ~ e^-40. The
    gradients match float64 to 1e-4; the dense form on the same float32 logits is off by orders of magnitude.
    V 331: the interpreter runs the kernel's loop over the 327 ids per tile."""
    gen = torch.Generator().manual_seed(seed)
    n, h, v, out_n = 7, 40, 331, 4
    hidden, weight = _head(n, h, v, gen, std=1.0)
    hidden[:, :n] = torch.eye(n)
    rest = _ids(n, v, v, gen)
    outside, ids = rest[:, :out_n], rest[:, out_n:]
    for i in range(n):
        weight[outside[i], i] -= 40.0 - math.log(v / out_n)       # out_n e^(-shift) / (V e^0) ~ e^-40
    g_lp, g_tail = torch.randn(n, v - out_n, generator=gen) / v, torch.randn(n, generator=gen)
    hd, wd = hidden.clone().to(DEV).requires_grad_(), weight.clone().to(DEV).requires_grad_()
    lp, tail = (t.cpu() for t in _k_call(hd, wd, ids))
    assert last_backend() == "triton" and last_precision() == ("ieee", "ieee")    # the kernels' forward too
    ((lp * g_lp).sum() + (tail * g_tail).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z64 = h64 @ w64.t()
    lp64, tail64 = _set64(z64, ids, torch.ones(n, dtype=torch.bool))
    assert -48 < tail64.mean().item() < -32                       # the regime the test is about
    ((lp64 * g_lp.double()).sum() + (tail64 * g_tail.double()).sum()).backward()
    _check_grads(hd, wd, h64, w64)
    # the dense form, in float32 on float32 logits: dz = (g_tail / P_tail - G) p over every column, then
    # - g_tail p / P_tail + g_k at the ids: terms of size p / P_tail ~ e^40 cancel there
    z = hidden @ weight.t()
    lse, p_tail = torch.logsumexp(z, -1, keepdim=True), tail.detach().exp().unsqueeze(1)
    p = (z - lse).exp()
    G = (g_lp.sum(1) + g_tail).unsqueeze(1)
    dz = (g_tail.unsqueeze(1) / p_tail - G) * p
    dz.scatter_add_(1, ids, g_lp - g_tail.unsqueeze(1) * p.gather(1, ids) / p_tail)
    assert rel_err(dz @ weight, h64.grad) > 1e3 * max(rel_err(hd.grad, h64.grad), 1e-7)


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_topk_gradients_softcap_temperature_masked_rows(softcap, seed):
    """fused_topk (k 20, V 4099, H 96, 19 tokens, 3 masked) with per-token temperatures: the gradients of its
    log-probs and tail against float64, and the triton backend against the torch pass (chunked)."""
    gen = torch.Generator().manual_seed(seed)
    n, h, v, k = 19, 96, 4099, 20
    hidden, weight = _head(n, h, v, gen, std=6.0)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[0, 8, 17]] = False
    temp = 0.6 + torch.rand(n, generator=gen)
    a, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    grads = {}
    for backend in ("triton", "chunked"):
        dev = DEV if backend == "triton" else "cpu"
        hd, wd = hidden.clone().to(dev).requires_grad_(), weight.clone().to(dev).requires_grad_()
        out = on_cpu(logitless.fused_topk(hd, wd, k, mask=mask.to(dev), temperature=temp.to(dev),
                                          softcap=softcap, backend=backend, precision="ieee"))
        ((out.logprobs * a).sum() + (out.tail_logprob * b).sum()).backward()
        grads[backend] = (hd.grad.cpu(), wd.grad.cpu(), out.ids)
    assert last_precision()[1] == "ieee"
    for backend, (dh, dw, ids) in grads.items():
        # each against float64 at its own ids: near a saturated cap two logits can tie within float32 rounding,
        # and the two backends' selections may then take different ids
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        lp64, tail64 = _set64(logits64(h64, w64, (n,), temp, softcap), ids.clamp(min=0), mask)
        ((lp64 * a.double()).sum() + (tail64 * b.double()).sum()).backward()
        assert rel_err(dh, h64.grad) <= 1e-4 and rel_err(dw, w64.grad) <= 1e-4, (backend, rel_err(dh, h64.grad),
                                                                                rel_err(dw, w64.grad))
        assert dh[~mask].abs().max() == 0
    (dh, dw, ids), (dh_c, dw_c, ids_c) = grads["triton"], grads["chunked"]
    if torch.equal(ids, ids_c):
        assert rel_err(dh, dh_c) <= 2e-5 and rel_err(dw, dw_c) <= 2e-5


@pytest.mark.parametrize("k", [5, 20])
def test_k_labels_with_tail_ignored_rows_softcap(k, seed, monkeypatch):
    """The tail bucket's op (ids given, ignore_index rows) with softcap and temperature, in token chunks of 16 and
    vocabulary chunks of 128 columns: float64."""
    monkeypatch.setenv("LOGITLESS_TRITON_BWD_TOKENS", "16")
    monkeypatch.setenv("LOGITLESS_TRITON_DLOGITS_ELEMENTS", str(16 * 128))
    gen = torch.Generator().manual_seed(seed)
    n, h, v = 40, 96, 1031
    hidden, weight = _head(n, h, v, gen, std=5.0)
    ids = _ids(n, v, k, gen)
    ignored = torch.zeros(n, dtype=torch.bool)
    ignored[[2, 3, 31]] = True
    ids[ignored] = -100
    temp = 0.7 + torch.rand(n, generator=gen)
    a, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    hd, wd = hidden.clone().to(DEV).requires_grad_(), weight.clone().to(DEV).requires_grad_()
    lp, tail = (t.cpu() for t in _k_call(hd, wd, ids, temp, softcap=8.0))
    ((lp * a).sum() + (tail * b).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, tail64 = _set64(logits64(h64, w64, (n,), temp, 8.0), ids, ~ignored)
    ((lp64 * a.double()).sum() + (tail64 * b.double()).sum()).backward()
    _check_grads(hd, wd, h64, w64)
    assert hd.grad[ignored].abs().max() == 0


def test_repeated_id_unchecked_is_the_forwards_gradient(seed):
    """check_inputs=False lets an id repeat within a row: the forward's lse then counts it per occurrence, and
    the gradient is that function's (float64), the same on the triton kernel and the torch pass."""
    gen = torch.Generator().manual_seed(seed)
    n, h, v, k = 9, 40, 1031, 5
    hidden, weight = _head(n, h, v, gen)
    ids = _ids(n, v, k, gen)
    ids[1, 3] = ids[1, 0]
    ids[4, 1] = ids[4, 2] = ids[4, 4]
    a, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp64, tail64 = _set64(h64 @ w64.t(), ids, torch.ones(n, dtype=torch.bool))
    ((lp64 * a.double()).sum() + (tail64 * b.double()).sum()).backward()
    for backend in ("triton", "chunked"):
        dev = DEV if backend == "triton" else "cpu"
        hd, wd = hidden.clone().to(dev).requires_grad_(), weight.clone().to(dev).requires_grad_()
        lp, tail = (t.cpu() for t in _k_call(hd, wd, ids, check_inputs=False, backend=backend))
        assert (lp.detach().double() - lp64.detach()).abs().max() < 1e-5
        ((lp * a).sum() + (tail * b).sum()).backward()
        _check_grads(hd, wd, h64, w64)


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_one_gradient_alone(which, seed):
    """Only hidden (or only weight) requires a gradient: the same numbers as when both do, the other not made."""
    gen = torch.Generator().manual_seed(seed)
    n, h, v, k = 13, 96, 1031, 5
    hidden, weight = _head(n, h, v, gen)
    ids = _ids(n, v, k, gen)
    a, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)

    def run(need_h, need_w):
        hd = hidden.clone().to(DEV).requires_grad_(need_h)
        wd = weight.clone().to(DEV).requires_grad_(need_w)
        lp, tail = (t.cpu() for t in _k_call(hd, wd, ids))
        ((lp * a).sum() + (tail * b).sum()).backward()
        return hd.grad, wd.grad

    both = run(True, True)
    alone = run(which == "hidden", which == "weight")
    i = 0 if which == "hidden" else 1
    assert alone[1 - i] is None
    assert torch.equal(alone[i], both[i])


def test_record_names_the_products_run(seed, monkeypatch):
    """On the triton backend an op with a tail runs the gradient products asked for (here bf16x3's default,
    "bf16"), and its record says so; the torch pass (chunked) runs and records "ieee"."""
    from logitless.ops import function
    asked = []

    def spy(mod, hidden, weight, precision, grad_precision, with_grad=True):
        asked.append((mod.name, grad_precision))
        return function._operands(mod, hidden, weight, precision, grad_precision, with_grad)
    monkeypatch.setattr(label_set_function, "_operands", spy)
    gen = torch.Generator().manual_seed(seed)
    hidden, weight = _head(11, 40, 1031, gen)
    for backend, want in (("triton", "bf16"), ("chunked", "ieee")):
        dev = DEV if backend == "triton" else "cpu"
        hd = hidden.clone().to(dev).requires_grad_()
        out = logitless.fused_topk(hd, weight.to(dev), 5, backend=backend, precision="bf16x3")
        assert last_precision() == ("bf16x3", want)
        (out.logprobs.sum() + out.tail_logprob.sum()).backward()
        assert hd.grad.abs().max() > 0
    assert asked == [("triton", "bf16")]
