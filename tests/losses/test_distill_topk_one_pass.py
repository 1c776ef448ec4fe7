"""fused_distillation_loss's one-pass route for "forward_kl_topk" (``losses/distill_topk_function.py``: gradients
formed in the forward by the policy pass's skeleton) against float64 written from verl's definition, and against
the route through ``fused_logprobs_k`` it replaces (loss, gradients, per-token divergence, every metric and token
stat); that the route is the one taken, and which settings keep the other route."""
from __future__ import annotations

import pytest
import torch

import logitless.losses.distillation as distillation
from distill64 import weights64
from logitless.losses import fused_distillation_loss
from logitless.record import last_path
from reference64 import device_for, on_cpu, rel_err

V, H = 4099, 96
# (tokens [B, T], teacher's k): N 14 to 37
SHAPES = {1: (2, 7), 5: (3, 9), 32: (1, 37)}
# gradient tolerance (relative norm) against float64: float32's where few tokens carry the gradient and a student
# log-prob near 0 makes c_i = g_i (1 - p_i) a small difference (1e-4 was missed by 1 draw in 1000, at k 1);
# bfloat16 operands: bfloat16 dlogits and gradient products
GRAD_TOL = {torch.float32: 3e-4, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # several token chunks per pass on the torch backends (the triton pass's chunk is its workspace's)
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(6 * V))


def between(values: torch.Tensor, q: float) -> float:
    """A value between two neighbouring ones of ``values`` near quantile q: a threshold no value sits on."""
    v = values.flatten().sort().values
    i = min(max(int(q * (v.numel() - 1)), 0), v.numel() - 2)
    return float((v[i] + v[i + 1]) / 2)


def batch(seed, k, dtype):
    gen = torch.Generator().manual_seed(seed)
    b, t = SHAPES[k]
    hidden = torch.randn(b, t, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(dtype)
    z = hidden.double() @ weight.double().t()
    teacher = torch.log_softmax(1.5 * z + 1.5 * torch.randn(z.shape, generator=gen, dtype=torch.float64), -1)
    t_lp, t_ids = teacher.topk(k, dim=-1)
    labels = torch.randint(0, V, (b, t), generator=gen)
    labels[0, 1:3] = -100
    labels[-1, -1] = -100
    temperature = torch.rand(b, t, generator=gen) + 0.5
    return hidden, weight, labels, t_ids, t_lp.float(), temperature


def reference64(hidden, weight, labels, t_ids, t_lp, temperature, clamp, loss_max_clamp, loss_agg):
    """(loss, per-token term before loss_max_clamp, d_hidden, d_weight) in float64, from verl's forward_kl_topk:
    D = max(0, sum_i exp(t_i) (t_i - u_i)), t_i / u_i the teacher's / student's log-probs clamped at ``clamp``,
    then clamped to [-c, c] and aggregated."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    s = torch.log_softmax((h @ w.t()) / temperature.double().unsqueeze(-1), -1).gather(-1, t_ids)
    q = t_lp.double()
    s, q = s.clamp_min(clamp), q.clamp_min(clamp)
    valid = labels != -100
    d = ((q.exp() * (q - s)).sum(-1)).clamp_min(0.0) * valid
    loss = (d.clamp(-loss_max_clamp, loss_max_clamp) * weights64(valid, loss_agg)).sum()
    loss.backward()
    return loss.detach(), d.detach(), h.grad, w.grad


def run(backend, hidden, weight, labels, t_ids, t_lp, temperature, *, one_pass=True, monkeypatch=None, **kw):
    """fused_distillation_loss on the backend's device, the outputs and gradients back on the CPU; one_pass=False:
    the route through fused_logprobs_k (today's, which the other settings keep)."""
    dev = device_for(backend)
    h = hidden.to(dev).requires_grad_()
    w = weight.to(dev).requires_grad_()
    if not one_pass:
        monkeypatch.setattr(distillation, "one_pass_applies", lambda *a: False)
    if hidden.dtype == torch.float32:
        # IEEE products: the one-pass route's (CUDA's default for float32, the bf16x3 split, keeps the other route)
        kw.setdefault("precision", "ieee")
    out = fused_distillation_loss(h, w, labels.to(dev), divergence="forward_kl_topk", teacher_topk_ids=t_ids.to(dev),
                                  teacher_topk_logprobs=t_lp.to(dev), temperature=temperature.to(dev),
                                  backend=backend, **kw)
    entry = last_path().entry
    if not one_pass:
        monkeypatch.undo()
    out.loss.backward()
    return on_cpu(out), h.grad.cpu(), w.grad.cpu(), entry


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the whole grid on the torch backends; the triton backend (its interpreter on the CPU: seconds a call) on a part
CASES = [(b, k, d, agg) for b in ("reference", "chunked") for k in SHAPES for d in DTYPES
         for agg in ("token-mean", "seq-mean-token-mean")]
CASES += [("triton", 1, "fp32", "seq-mean-token-mean"), ("triton", 5, "fp32", "token-mean"),
          ("triton", 5, "bf16", "seq-mean-token-mean"), ("triton", 32, "fp32", "token-mean"),
          ("triton", 32, "bf16", "token-mean")]


@pytest.mark.parametrize("backend, k, dtype, loss_agg", CASES)
def test_one_pass_against_float64_and_the_logprobs_k_route(backend, k, dtype, loss_agg, seed, monkeypatch):
    dtype = DTYPES[dtype]
    hidden, weight, labels, t_ids, t_lp, temperature = batch(seed, k, dtype)
    valid = labels != -100
    # log_prob_min_clamp where it bites on about a third of the student's log-probs at the ids (and on some of the
    # teacher's), loss_max_clamp where it bites on about half the tokens: thresholds between two values
    s64 = torch.log_softmax((hidden.double() @ weight.double().t()) / temperature.double().unsqueeze(-1), -1)
    s_ids = s64.gather(-1, t_ids)[valid]
    clamp = min(between(s_ids, 0.33), -1e-3)
    _, d_free, _, _ = reference64(hidden, weight, labels, t_ids, t_lp, temperature, clamp, float("inf"), loss_agg)
    loss_max = between(d_free[valid].unique(), 0.5)     # (terms clamped at 0 repeat 0)
    want_loss, want_d, want_dh, want_dw = reference64(hidden, weight, labels, t_ids, t_lp, temperature, clamp,
                                                      loss_max, loss_agg)
    assert (s_ids < clamp).any() and (s_ids > clamp).any()
    assert (d_free[valid] > loss_max).any() and (d_free[valid] < loss_max).any()

    kw = dict(log_prob_min_clamp=clamp, loss_max_clamp=loss_max, loss_agg=loss_agg)
    got, dh, dw, entry = run(backend, hidden, weight, labels, t_ids, t_lp, temperature, **kw)
    assert entry == "fused_distillation_loss"           # the one-pass op ran (the other route's is fused_logprobs_k)
    assert got.loss.dtype == torch.float32 and got.divergence.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    assert abs(got.loss.double() - want_loss) <= tol * max(1.0, float(want_loss))
    assert (got.divergence.double() - want_d.clamp(-loss_max, loss_max)).abs().max() <= tol * 10
    assert rel_err(dh, want_dh) < GRAD_TOL[dtype] and rel_err(dw, want_dw) < GRAD_TOL[dtype]

    old, o_dh, o_dw, old_entry = run(backend, hidden, weight, labels, t_ids, t_lp, temperature, one_pass=False,
                                     monkeypatch=monkeypatch, **kw)
    assert old_entry == "fused_logprobs_k"
    torch.testing.assert_close(got.loss, old.loss, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got.divergence, old.divergence, atol=tol, rtol=1e-5)
    assert set(got.metrics) == set(old.metrics)
    for name, value in old.metrics.items():
        torch.testing.assert_close(got.metrics[name], value, atol=tol, rtol=1e-5, msg=name)
    for name in ("student_mass", "teacher_mass", "overlap_token_advantage"):
        torch.testing.assert_close(getattr(got, name), getattr(old, name), atol=tol, rtol=1e-5, msg=name)
    assert torch.equal(got.overlap_count, old.overlap_count)
    assert got.overlap_count[valid].max() <= k
    if k > 1:     # (one id of a few tokens may miss the student's top 1 on every token)
        assert got.overlap_count[valid].sum() > 0
    # the two routes' gradients: both near float64, each within its own rounding
    assert rel_err(dh, o_dh) < GRAD_TOL[dtype] and rel_err(dw, o_dw) < GRAD_TOL[dtype]


@pytest.mark.parametrize("backend", ["chunked", "triton"])
def test_without_overlap_and_gradients_only_where_wanted(backend, seed):
    hidden, weight, labels, t_ids, t_lp, temperature = batch(seed, 5, torch.float32)
    dev = device_for(backend)
    kw = dict(divergence="forward_kl_topk", teacher_topk_ids=t_ids.to(dev), teacher_topk_logprobs=t_lp.to(dev),
              temperature=temperature.to(dev), backend=backend, log_prob_min_clamp=-8.0, precision="ieee")
    h = hidden.to(dev).requires_grad_()
    w = weight.to(dev)
    out = fused_distillation_loss(h, w, labels.to(dev), with_overlap=False, **kw)
    assert last_path().entry == "fused_distillation_loss"
    assert out.overlap_count is None and "distillation/overlap_ratio" not in out.metrics
    out.loss.backward()
    assert h.grad is not None and w.grad is None
    want_loss, _, want_dh, _ = reference64(hidden, weight, labels, t_ids, t_lp, temperature, -8.0, float("inf"),
                                           "token-mean")
    assert abs(out.loss.item() - float(want_loss)) <= 2e-5 * max(1.0, float(want_loss))
    assert rel_err(h.grad.cpu(), want_dh) < GRAD_TOL[torch.float32]
    with torch.no_grad():
        again = fused_distillation_loss(hidden.to(dev).requires_grad_(), weight.to(dev), labels.to(dev), **kw)
    assert not again.loss.requires_grad
    torch.testing.assert_close(again.loss, out.loss.detach(), atol=1e-6, rtol=1e-6)


def test_no_scored_token(seed):
    hidden, weight, labels, t_ids, t_lp, temperature = batch(seed, 5, torch.float32)
    labels.fill_(-100)
    h, w = hidden.requires_grad_(), weight.requires_grad_()
    out = fused_distillation_loss(h, w, labels, divergence="forward_kl_topk", teacher_topk_ids=t_ids,
                                  teacher_topk_logprobs=t_lp, backend="chunked", loss_agg="token-sum")
    assert last_path().entry == "fused_distillation_loss"
    out.loss.backward()
    assert out.loss.item() == 0.0 and (out.divergence == 0).all()
    assert (h.grad == 0).all() and (w.grad == 0).all()


@pytest.mark.parametrize("setting", [dict(student_softcap=30.0), dict(check_inputs=False),
                                     dict(divergence="forward_kl_topk_tail")])
def test_settings_outside_the_route_keep_the_logprobs_k_route(setting, seed):
    """A softcap (the policy pass has no softcap stage), an unchecked call (ids not read on the host, a repeated
    id possible) and the tail divergence take the route through fused_logprobs_k."""
    hidden, weight, labels, t_ids, t_lp, temperature = batch(seed, 5, torch.float32)
    kw = dict(divergence="forward_kl_topk", teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp,
              temperature=temperature, backend="chunked", log_prob_min_clamp=-8.0)
    kw.update(setting)
    fused_distillation_loss(hidden.requires_grad_(), weight, labels, **kw)
    assert last_path().entry == "fused_logprobs_k"


def test_triton_selection_shares_the_statistics_gemm(seed, monkeypatch):
    """On the triton backend the selection kernel also writes the pass's statistics (one GEMM for both,
    LOGITLESS_TOPK_DISTILL_SELECTION=shared, the default): the same bits as the selection's own GEMM first
    ("separate"), the rows whose first candidates miss their top k redone by the selection alone (one candidate a
    tile, the student's top 8 in the first vocabulary tile), and the overlap of float64's own top k."""
    from logitless.ops.triton import topk_select
    gen = torch.Generator().manual_seed(seed)
    k, n = 5, 11
    base = torch.randn(H, generator=gen)
    hidden = base + 0.5 * torch.randn(n, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    weight[:8] = 3.0 * base / base.norm() + 0.3 * torch.randn(8, H, generator=gen)
    z = hidden.double() @ weight.double().t()
    t_lp, t_ids = torch.log_softmax(z + torch.randn(z.shape, generator=gen, dtype=torch.float64), -1).topk(k, dim=-1)
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[3] = -100
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    shared, redone = [], []
    select_with_stats, redo = topk_select.select_with_stats, topk_select._redo

    def counted_select(*a, **kw):
        shared.append(a[0].shape[0])
        return select_with_stats(*a, **kw)

    def counted_redo(*a, **kw):
        out = redo(*a, **kw)
        redone.append(out)
        return out
    monkeypatch.setattr(topk_select, "select_with_stats", counted_select)
    monkeypatch.setattr(topk_select, "_redo", counted_redo)
    monkeypatch.setenv("LOGITLESS_TOPK_CANDIDATES", "1")
    runs = {}
    for mode in ("shared", "separate"):
        monkeypatch.setenv("LOGITLESS_TOPK_DISTILL_SELECTION", mode)
        shared.clear()
        redone.clear()
        runs[mode] = run("triton", hidden, weight, labels, t_ids, t_lp.float(), torch.ones(n),
                         log_prob_min_clamp=-10.0)
        assert runs[mode][3] == "fused_distillation_loss"
        assert (sum(shared) == n - 1) == (mode == "shared")       # the scored rows, through the shared GEMM
        assert sum(redone) > 0                                    # some rows' selection redone
    (a, a_dh, a_dw, _), (b, b_dh, b_dw, _) = runs["shared"], runs["separate"]
    assert torch.equal(a.loss, b.loss) and torch.equal(a_dh, b_dh) and torch.equal(a_dw, b_dw)
    assert torch.equal(a.overlap_count, b.overlap_count)
    for name, value in b.metrics.items():
        assert torch.equal(a.metrics[name], value), name
    own = (hidden.double() @ weight.double().t()).topk(k, dim=-1).indices
    want = (t_ids.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).sum(-1) * (labels != -100)
    assert torch.equal(a.overlap_count, want)
