"""fused_distillation_loss's full-vocabulary divergences against float64 ground truth written from the definitions
(distill64.py): loss, per-token divergence and entropy, both student gradients; odd shapes (V = 4099, student
H = 96, teacher H = 80), ignored tokens, chunk boundaries inside sequences, every dtype (the heads in different
ones), softcap and logit scale per head, temperature per sequence and per token, every loss_agg, TRL's
num_items_in_batch, a per-token weight, and the autograd contract."""
from __future__ import annotations

import pytest
import torch

from distill64 import FLOAT32_UNITS, distill64, weights64
from logitless import last_backend, last_precision
from logitless.losses import LOSS_AGGS, fused_distillation_loss

V, HS, HT = 4099, 96, 80
LEAD = (3, 7)
BACKENDS = ["chunked", "reference", "triton"]   # triton: through its interpreter on CPU (conftest)
CASES = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.5), ("jsd", 0.1), ("jsd", 0.0), ("jsd", 1.0)]


@pytest.fixture
def small_chunks(monkeypatch):
    """Two tokens per chunk on the chunked backend (the policy plan's 4 rows, halved for two heads): chunk
    boundaries fall inside every 7-token sequence."""
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(4 * V))


def heads(lead=LEAD, s_dtype=torch.float32, t_dtype=torch.float32, ignored=3):
    """Fresh random heads whose distributions differ but overlap (so every divergence is well away from 0),
    labels with ``ignored`` tokens at random places."""
    hs = torch.randn(*lead, HS).to(s_dtype)
    ws = (torch.randn(V, HS) / HS ** 0.5 * 3).to(s_dtype)
    ht = torch.randn(*lead, HT).to(t_dtype)
    wt = (torch.randn(V, HT) / HT ** 0.5 * 3).to(t_dtype)
    labels = torch.randint(0, V, lead)
    flat = labels.view(-1)
    flat[torch.randperm(flat.numel())[:ignored]] = -100
    return hs, ws, ht, wt, labels


def run(backend, hs, ws, ht, wt, labels, kind, beta=None, **kw):
    h = hs.detach().clone().requires_grad_()
    w = ws.detach().clone().requires_grad_()
    out = fused_distillation_loss(h, w, labels, teacher_hidden=ht, teacher_weight=wt, divergence=kind, beta=beta,
                                  backend=backend, **kw)
    assert last_backend() == backend
    out.loss.backward()
    return out, h.grad, w.grad


def close(got, want, atol, rtol_of_max=None, scale=None):
    """The largest error within atol, or rtol_of_max of the largest entry of want, or (``scale``: the largest sum
    of the gradient's term magnitudes) within float32's resolution of those terms, whichever is larger."""
    err = (got.double() - want).abs().max().item()
    bound = atol if rtol_of_max is None else rtol_of_max * want.abs().max().item()
    if scale is not None:
        bound = max(bound, FLOAT32_UNITS * 2.0 ** -24 * scale)
    assert err <= bound, (err, bound)


def check(out, dh, dw, truth, labels, tol=2e-5, grad_tol=1e-4):
    loss, d, ent, dh64, dw64 = truth
    assert out.loss.dtype == torch.float32 and out.loss.shape == ()
    for got in (out.divergence, out.entropy):
        assert got.dtype == torch.float32 and got.shape == labels.shape and not got.requires_grad
    assert (out.divergence[labels == -100] == 0).all() and (out.entropy[labels == -100] == 0).all()
    assert abs(out.loss.item() - loss.item()) <= tol * max(1.0, abs(loss.item())), (out.loss.item(), loss.item())
    close(out.divergence, d, tol * max(1.0, d.abs().max().item()))
    close(out.entropy, ent, tol * 10)
    scale = getattr(truth, "grad_scale", (None, None))
    close(dh, dh64, None, grad_tol, scale[0])
    close(dw, dw64, None, grad_tol, scale[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,beta", CASES)
def test_against_float64(backend, kind, beta, small_chunks):
    hs, ws, ht, wt, labels = heads()
    temperature = torch.rand(LEAD) + 0.5          # per token
    out, dh, dw = run(backend, hs, ws, ht, wt, labels, kind, beta, temperature=temperature)
    truth = distill64(hs, ws, ht, wt, labels, kind, beta, temperature=temperature)
    assert truth[1][labels != -100].min() > 1e-3     # the heads really differ
    check(out, dh, dw, truth, labels)


DTYPES = [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.float32, torch.float16),
          (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("backend,s_dtype,t_dtype,kind,beta",
                         [("chunked", *d, *c) for d in DTYPES for c in (("reverse_kl", None), ("jsd", 0.5))]
                         + [("triton", torch.bfloat16, torch.float32, "jsd", 0.5)])
def test_dtypes(backend, s_dtype, t_dtype, kind, beta, small_chunks):
    """Heads in different dtypes: float32 statistics of the rounded inputs; the gradients come back in the
    student's dtype (one rounding)."""
    hs, ws, ht, wt, labels = heads(s_dtype=s_dtype, t_dtype=t_dtype)
    out, dh, dw = run(backend, hs, ws, ht, wt, labels, kind, beta, temperature=0.8)
    assert dh.dtype == s_dtype and dw.dtype == s_dtype
    truth = distill64(hs, ws, ht, wt, labels, kind, beta, temperature=0.8)
    check(out, dh, dw, truth, labels, tol=3e-5, grad_tol=1e-2)


@pytest.mark.parametrize("backend,kind,beta", [("chunked", "forward_kl", None), ("chunked", "reverse_kl", None),
                                               ("chunked", "jsd", 0.7), ("triton", "jsd", 0.7),
                                               ("triton", "reverse_kl", None)])
def test_softcap_scale_and_temperature_per_sequence(backend, kind, beta, small_chunks):
    hs, ws, ht, wt, labels = heads()
    temperature = torch.rand(LEAD[0], 1) + 0.5
    kw = dict(student_logit_scale=1.7, teacher_logit_scale=0.6, student_softcap=4.0, teacher_softcap=9.0)
    out, dh, dw = run(backend, hs, ws, ht, wt, labels, kind, beta, temperature=temperature, **kw)
    truth = distill64(hs, ws, ht, wt, labels, kind, beta, temperature=temperature, s_scale=1.7, t_scale=0.6,
                      s_softcap=4.0, t_softcap=9.0)
    check(out, dh, dw, truth, labels)


@pytest.mark.parametrize("loss_agg", LOSS_AGGS)
def test_every_loss_agg(loss_agg, small_chunks):
    hs, ws, ht, wt, labels = heads(ignored=5)
    out, dh, dw = run("chunked", hs, ws, ht, wt, labels, "jsd", 0.4, loss_agg=loss_agg)
    w = weights64(labels != -100, loss_agg)
    check(out, dh, dw, distill64(hs, ws, ht, wt, labels, "jsd", 0.4, token_w=w), labels)


def test_packed_sequences():
    hs, ws, ht, wt, labels = heads(lead=(17,), ignored=4)
    cu = torch.tensor([0, 5, 6, 13, 17])
    out, dh, dw = run("chunked", hs, ws, ht, wt, labels, "reverse_kl", loss_agg="seq-mean-token-mean",
                      cu_seqlens=cu)
    w = weights64(labels != -100, "seq-mean-token-mean", cu)
    check(out, dh, dw, distill64(hs, ws, ht, wt, labels, "reverse_kl", token_w=w), labels)


def test_num_items_in_batch_and_token_weight():
    """TRL's normalisation (sum over num_items_in_batch) and a per-token weight multiplying each term."""
    hs, ws, ht, wt, labels = heads()
    tw = torch.rand(LEAD) * 2
    tw[labels == -100] = float("nan")          # not read at ignored tokens
    for count in (37, torch.tensor(37.0)):
        out, dh, dw = run("chunked", hs, ws, ht, wt, labels, "forward_kl", num_items_in_batch=count,
                          token_weight=tw)
        w = torch.where(labels != -100, tw.double(), 0.0) / 37
        check(out, dh, dw, distill64(hs, ws, ht, wt, labels, "forward_kl", token_w=w), labels)


def test_gradients_only_where_asked_and_teacher_gets_none():
    hs, ws, ht, wt, labels = heads()
    ht.requires_grad_()
    wt.requires_grad_()
    w = ws.clone().requires_grad_()
    out = fused_distillation_loss(hs, w, labels, teacher_hidden=ht, teacher_weight=wt, divergence="reverse_kl")
    out.loss.backward()
    truth = distill64(hs, ws, ht, wt, labels, "reverse_kl")
    close(w.grad, truth[4], None, 1e-4, truth.grad_scale[1])
    assert ht.grad is None and wt.grad is None
    with torch.no_grad():
        quiet = fused_distillation_loss(hs, ws, labels, teacher_hidden=ht, teacher_weight=wt, divergence="reverse_kl")
    assert not quiet.loss.requires_grad
    assert torch.equal(quiet.divergence, out.divergence) and quiet.loss.item() == out.loss.item()


def test_second_backward_refused_and_upstream_scaled():
    hs, ws, ht, wt, labels = heads()
    h = hs.clone().requires_grad_()
    out = fused_distillation_loss(h, ws, labels, teacher_hidden=ht, teacher_weight=wt, divergence="jsd", beta=0.5)
    (3.0 * out.loss).backward(retain_graph=True)
    truth = distill64(hs, ws, ht, wt, labels, "jsd", 0.5)
    close(h.grad, 3.0 * truth[3], None, 1e-4, 3.0 * truth.grad_scale[0])
    with pytest.raises(RuntimeError, match="second backward"):
        out.loss.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_token_ignored(backend):
    hs, ws, ht, wt, labels = heads()
    labels.fill_(-100)
    out, dh, dw = run(backend, hs, ws, ht, wt, labels, "forward_kl")
    assert out.loss.item() == 0.0 and (out.divergence == 0).all()
    assert (dh == 0).all() and (dw == 0).all()


def test_compiled_fullgraph_matches_eager():
    torch._dynamo.reset()
    hs, ws, ht, wt, labels = heads()
    temperature = torch.rand(LEAD[0], 1) + 0.5

    def step(h, w):
        out = fused_distillation_loss(h, w, labels, teacher_hidden=ht, teacher_weight=wt, divergence="jsd",
                                      beta=0.3, temperature=temperature, loss_agg="seq-mean-token-mean")
        return 2.0 * out.loss, out.divergence, out.entropy

    explained = torch._dynamo.explain(step)(hs, ws)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        loss, d, ent = fn(h, w)
        loss.backward()
        results.append((loss.detach(), d, ent, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
    truth = distill64(hs, ws, ht, wt, labels, "jsd", 0.3, temperature=temperature,
                      token_w=weights64(labels != -100, "seq-mean-token-mean"))
    close(results[1][3], 2.0 * truth[3], None, 1e-4, 2.0 * truth.grad_scale[0])
    assert abs(results[1][0].item() - 2.0 * truth[0].item()) <= 1e-5


@pytest.mark.parametrize("s_dtype,t_dtype,want", [
    (torch.float32, torch.float32, ("ieee", "ieee")), (torch.bfloat16, torch.bfloat16, ("native", "native")),
    (torch.bfloat16, torch.float32, ("ieee", "native")), (torch.float32, torch.float16, ("ieee", "ieee"))])
@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_record_says_how_the_products_ran(s_dtype, t_dtype, want, backend):
    """last_precision() after the loss with the default precision (CPU: "ieee"; precision settings:
    test_distillation_precision.py): a float32 head's products are IEEE float32 (the statistics whenever either
    head is float32, the gradient products when the student is) and half-precision ones exact ("native"), as
    fused_logprobs and fused_policy_loss record theirs. The numbers are IEEE float32's: within float32's
    resolution of float64 (test_against_float64's bounds), which a float32 head multiplied in bfloat16 or TF32
    would miss (a tenth of a nat, docs/precision.md)."""
    hs, ws, ht, wt, labels = heads(s_dtype=s_dtype, t_dtype=t_dtype)
    fused_logprobs_record = last_precision()
    out, dh, dw = run(backend, hs, ws, ht, wt, labels, "jsd", 0.5)
    assert last_precision() == want, (last_precision(), fused_logprobs_record)
    if want == ("ieee", "ieee"):
        check(out, dh, dw, distill64(hs, ws, ht, wt, labels, "jsd", 0.5), labels)


@pytest.mark.parametrize("dtype,want", [(torch.float32, ("ieee", "ieee")), (torch.bfloat16, ("native", "native"))])
@pytest.mark.parametrize("divergence", ["forward_kl_topk", "forward_kl_topk_tail"])
def test_topk_route_record(dtype, want, divergence):
    """The top-k route runs the k-label op with the student's IEEE float32 products (float32) or exact ones
    (half precision), named so (the tail's gradient needs no forced bf16x6 then: IEEE is float32-exact)."""
    hs, ws, _, _, labels = heads(s_dtype=dtype)
    z = hs.double() @ ws.double().t()
    t_lp, t_ids = torch.log_softmax(z + torch.randn(z.shape, dtype=torch.float64), -1).topk(5, dim=-1)
    h = hs.clone().requires_grad_()
    out = fused_distillation_loss(h, ws, labels, teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp.float(),
                                  divergence=divergence)
    assert last_precision() == want
    out.loss.backward()
    assert last_precision() == want and h.grad.abs().max() > 0
