"""Values outside an argument's range that used to give a silent wrong number (a flipped or zero loss, NaN):
num_items_in_batch as a tensor, log_prob_min_clamp >= 0, a -inf teacher log-prob without a clamp, teacher top-k
masses above 1 for the tail divergence. Each is a ValueError naming the argument; the values just inside the
range still give the float64 number."""
from __future__ import annotations

import math

import pytest
import torch

from logitless.losses import fused_distillation_loss

V, H, HT, N, K = 4099, 96, 80, 7, 5


def inputs(seed=70):
    g = torch.Generator().manual_seed(seed)
    sh, sw = torch.randn(1, N, H, generator=g), torch.randn(V, H, generator=g) * 0.1
    th, tw = torch.randn(1, N, HT, generator=g), torch.randn(V, HT, generator=g) * 0.1
    labels = torch.randint(0, V, (1, N), generator=g)
    labels[0, 2] = -100
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N)])[None]
    tlp = torch.log_softmax(torch.randn(1, N, K, generator=g), -1) + math.log(0.9)
    return sh, sw, th, tw, labels, ids, tlp


def full(count, **kw):
    sh, sw, th, tw, labels, _, _ = inputs()
    return fused_distillation_loss(sh, sw, labels, divergence="forward_kl", teacher_hidden=th, teacher_weight=tw,
                                   num_items_in_batch=count, **kw)


@pytest.mark.parametrize("bad", [-3.0, float("inf"), 0, float("nan"), -1])
def test_num_items_in_batch_tensor_is_range_checked(bad):
    with pytest.raises(ValueError, match="num_items_in_batch"):
        full(torch.tensor(bad))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        full(bad)


def test_num_items_in_batch_tensor_equals_the_number():
    a, b = full(torch.tensor(13)).loss, full(13).loss
    assert torch.equal(a, b) and a.item() > 0
    # unchecked (no host read): the tensor is taken as it is
    assert torch.equal(full(torch.tensor(13.0), check_inputs=False).loss, b)


def topk(divergence, tlp=None, **kw):
    sh, sw, _, _, labels, ids, t = inputs()
    return fused_distillation_loss(sh, sw, labels, divergence=divergence, teacher_topk_ids=ids,
                                   teacher_topk_logprobs=t if tlp is None else tlp, **kw)


@pytest.mark.parametrize("divergence", ["forward_kl_topk", "forward_kl_topk_tail"])
@pytest.mark.parametrize("clamp", [0.0, 1.0, 1e-9])
def test_log_prob_min_clamp_at_or_above_zero_refused(divergence, clamp):
    with pytest.raises(ValueError, match="log_prob_min_clamp must be < 0"):
        topk(divergence, log_prob_min_clamp=clamp)
    assert topk(divergence, log_prob_min_clamp=-1e-3).loss.item() != 0.0 or divergence == "forward_kl_topk"


@pytest.mark.parametrize("divergence", ["forward_kl_topk", "forward_kl_topk_tail"])
def test_teacher_minus_inf_refused_without_clamp(divergence):
    *_, tlp = inputs()
    tlp[0, 4, 3] = float("-inf")
    with pytest.raises(ValueError, match="teacher_topk_logprobs holds -inf"):
        topk(divergence, tlp)
    # with a clamp (verl's -10) the term is finite: the same as any log-prob below the clamp
    low = tlp.clone()
    low[0, 4, 3] = -50.0
    a, b = topk(divergence, tlp, log_prob_min_clamp=-10.0), topk(divergence, low, log_prob_min_clamp=-10.0)
    assert torch.isfinite(a.loss) and abs(a.loss.item() - b.loss.item()) < 1e-6
    # an unscored token's -inf is never read
    *_, labels, _, _ = inputs()
    assert labels[0, 2] == -100
    tlp2 = inputs()[-1].clone()
    tlp2[0, 2, 0] = float("-inf")
    assert torch.isfinite(topk(divergence, tlp2).loss)


def test_teacher_mass_above_one_is_refused():
    big = torch.full((1, N, K), -0.01)              # 5 ids at 0.99 each: a mass of 4.95
    with pytest.raises(ValueError, match="teacher_topk_logprobs: a scored token's k probabilities sum to 4.95"):
        topk("forward_kl_topk_tail", big)
    # a distribution's log-probs (mass exactly 1 up to float32 rounding) are accepted; bfloat16 ones too
    *_, tlp = inputs()
    whole = torch.log_softmax(tlp, -1)
    assert torch.isfinite(topk("forward_kl_topk_tail", whole).loss)
    assert torch.isfinite(topk("forward_kl_topk_tail", whole.bfloat16()).loss)
    # without the tail too: such log-probs are no distribution's (a number that cannot be what its name says),
    # though verl's forward_kl_topk would compute on them
    with pytest.raises(ValueError, match="teacher_topk_logprobs: a scored token's k probabilities sum to 4.95"):
        topk("forward_kl_topk", big)


@pytest.mark.parametrize("divergence", ["forward_kl_topk", "forward_kl_topk_tail"])
@pytest.mark.parametrize("backend", ["reference", "chunked", "triton"])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_topk_student_logit_scale_before_softcap(divergence, backend, softcap):
    """A Cohere / Granite / MuP student head: z = softcap(scale * raw) / T, the scale before the cap (as the
    full-vocabulary divergences take it), against float64; folding the scale into the temperature is wrong
    with a cap."""
    sh, sw, _, _, labels, ids, tlp = inputs(seed=71)
    scale, temp = 2.5, 0.8
    h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
    out = fused_distillation_loss(h, w, labels, divergence=divergence, teacher_topk_ids=ids,
                                  teacher_topk_logprobs=tlp, student_logit_scale=scale, student_softcap=softcap,
                                  temperature=temp, backend=backend)
    out.loss.backward()
    h64, w64 = sh.double().requires_grad_(), sw.double().requires_grad_()
    raw = scale * (h64 @ w64.T)
    z = raw if softcap is None else softcap * torch.tanh(raw / softcap)
    ls = torch.log_softmax(z / temp, -1)
    s = ls.gather(-1, ids)
    q = tlp.double()
    d = (q.exp() * (q - s)).sum(-1)
    if divergence == "forward_kl_topk_tail":
        outside = torch.ones_like(ls, dtype=torch.bool).scatter_(-1, ids, False)
        lpt = torch.logsumexp(ls.masked_fill(~outside, float("-inf")), -1)
        qt = 1 - q.exp().sum(-1)
        d = d + qt * (qt.log() - lpt)
    else:
        d = d.clamp_min(0.0)
    scored = labels != -100
    want = d[scored].mean()
    want.backward()
    assert abs(out.loss.item() - want.item()) < 1e-5 * max(1.0, abs(want.item()))
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (got.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    if softcap is not None:
        # the scale folded into the temperature instead is a different loss
        folded = fused_distillation_loss(sh, sw, labels, divergence=divergence, teacher_topk_ids=ids,
                                         teacher_topk_logprobs=tlp, student_softcap=softcap, temperature=temp / scale,
                                         backend=backend)
        assert abs(folded.loss.item() - want.item()) > 1e-3


def test_num_items_in_batch_tensor_check_compiles_without_a_graph_break():
    torch._dynamo.reset()
    sh, sw, th, tw, labels, _, _ = inputs()
    count = torch.tensor(13)

    def step(h):
        return fused_distillation_loss(h, sw, labels, divergence="forward_kl", teacher_hidden=th, teacher_weight=tw,
                                       num_items_in_batch=count).loss

    explained = torch._dynamo.explain(step)(sh)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert torch.equal(torch.compile(step, fullgraph=True)(sh), step(sh))
