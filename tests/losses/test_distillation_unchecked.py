"""fused_distillation_loss with check_inputs=False: no host read of any tensor value in the forward or the
backward (what CUDA-graph capture needs; caught on the CPU by ``host_reads``, which sees the checked call's reads,
so it can fail), the same numbers as the checked call on valid input, against float64, with NaN padding in the
per-token inputs of the rows not scored reaching nothing. The same detector holds fused_logprobs and
fused_policy_loss to their own check_inputs=False."""
from __future__ import annotations

import pytest
import torch

from cuda_graph import capture, replay_poisoned
from distill64 import FLOAT32_UNITS, distill64, weights64
from host_reads import host_reads
from logitless import fused_logprobs
from logitless.losses import fused_distillation_loss, fused_policy_loss

V, HS, HT, K = 4099, 96, 80, 5
LEAD = (3, 7)
FULL = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.4)]
TOPK = ["forward_kl_topk", "forward_kl_topk_tail"]


def batch():
    """Two heads, labels with a prompt and a hole, a per-token temperature and weight that hold NaN on the tokens
    not scored (padding), the teacher's top-k from its own head (NaN log-probs and out-of-range ids there too)."""
    hs, ws = torch.randn(*LEAD, HS), torch.randn(V, HS) / HS ** 0.5 * 3
    ht, wt = torch.randn(*LEAD, HT), torch.randn(V, HT) / HT ** 0.5 * 3
    labels = torch.randint(0, V, LEAD)
    labels[0, :3] = -100
    labels[2, 4] = -100
    ignored = labels == -100
    temperature = (torch.rand(LEAD) + 0.5).masked_fill(ignored, float("nan"))
    token_weight = (torch.rand(LEAD) + 0.5).masked_fill(ignored, float("nan"))
    t_lp, t_ids = torch.log_softmax(ht.double() @ wt.double().t(), -1).topk(K, dim=-1)
    t_lp = t_lp.float().masked_fill(ignored.unsqueeze(-1), float("nan"))
    t_ids = t_ids.masked_fill(ignored.unsqueeze(-1), V + 7)
    return hs, ws, ht, wt, labels, temperature, token_weight, t_ids, t_lp


def teacher_of(divergence, ht, wt, t_ids, t_lp, beta):
    if divergence in TOPK:
        return dict(teacher_topk_ids=t_ids, teacher_topk_logprobs=t_lp)
    return dict(teacher_hidden=ht, teacher_weight=wt, beta=beta)


def step(hs, ws, labels, divergence, beta, ht, wt, t_ids, t_lp, **kw):
    h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = fused_distillation_loss(h, w, labels, divergence=divergence, **teacher_of(divergence, ht, wt, t_ids,
                                                                                   t_lp, beta), **kw)
    out.loss.backward()
    return out, h.grad, w.grad


CASES = [(d, b) for d, b in FULL] + [(d, None) for d in TOPK]


@pytest.mark.parametrize("divergence,beta", CASES)
@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_no_host_read(divergence, beta, backend):
    hs, ws, ht, wt, labels, temperature, token_weight, t_ids, t_lp = batch()
    kw = dict(temperature=temperature, token_weight=token_weight, backend=backend, loss_agg="seq-mean-token-mean")
    with host_reads() as seen:
        unchecked, dh, dw = step(hs, ws, labels, divergence, beta, ht, wt, t_ids, t_lp, check_inputs=False, **kw)
    assert seen == [], seen
    # the detector sees the checked call's host reads (its checks and scored-row count); the checked call
    # refuses a temperature out of range on any token, padding included
    kw["temperature"] = temperature.nan_to_num(1.0)
    with host_reads() as seen:
        checked, dh_c, dw_c = step(hs, ws, labels, divergence, beta, ht, wt, t_ids, t_lp, **kw)
    assert seen, "the checked call reads on the host: the detector should have seen it"
    ignored = labels == -100
    assert (unchecked.divergence[ignored] == 0).all() and (dh[ignored] == 0).all()
    assert torch.isfinite(unchecked.loss) and torch.isfinite(dw).all()
    # the same numbers: the same pass on the same scored rows, the unscored ones adding exact zeros
    assert (unchecked.loss - checked.loss).abs() <= 1e-6 * max(1.0, checked.loss.abs().item())
    # per token: a few float32 ulps of the term's size (1.1e-5 at a term of 20 on one CI draw)
    assert ((unchecked.divergence - checked.divergence).abs() <= 1e-5 + 2e-6 * checked.divergence.abs()).all()
    assert (dh - dh_c).abs().max() <= 1e-5 * dh_c.abs().max() and (dw - dw_c).abs().max() <= 1e-5 * dw_c.abs().max()
    for name in ("entropy", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage"):
        a, b = getattr(unchecked, name), getattr(checked, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.allclose(a[~ignored].double(), b[~ignored].double(), atol=1e-5), name
    for key, value in (checked.metrics or {}).items():
        assert torch.allclose(unchecked.metrics[key], value, atol=1e-5, equal_nan=True), key


def test_topk_without_overlap_no_host_read():
    # forward_kl_topk without the overlap: the backend's statistics pass and the ids' gathered products
    hs, ws, ht, wt, labels, temperature, token_weight, t_ids, t_lp = batch()
    kw = dict(token_weight=token_weight, with_overlap=False)
    with host_reads() as seen:
        out, dh, dw = step(hs, ws, labels, "forward_kl_topk", None, ht, wt, t_ids, t_lp, temperature=temperature,
                           check_inputs=False, **kw)
    assert seen == [], seen
    checked, dh_c, dw_c = step(hs, ws, labels, "forward_kl_topk", None, ht, wt, t_ids, t_lp,
                               temperature=temperature.nan_to_num(1.0), **kw)
    assert (out.loss - checked.loss).abs() <= 1e-6 * max(1.0, checked.loss.abs().item())
    assert (dw - dw_c).abs().max() <= 1e-5 * dw_c.abs().max() and (dh[labels == -100] == 0).all()


@pytest.mark.parametrize("divergence,beta", FULL)
def test_unchecked_against_float64(divergence, beta):
    hs, ws, ht, wt, labels, temperature, token_weight, t_ids, t_lp = batch()
    out, dh, dw = step(hs, ws, labels, divergence, beta, ht, wt, t_ids, t_lp, temperature=temperature,
                       token_weight=token_weight, check_inputs=False)
    valid = labels != -100
    w = weights64(valid, "token-mean") * torch.where(valid, token_weight.double(), 0.0)
    truth = distill64(hs, ws, ht, wt, labels, divergence, beta, temperature=torch.where(valid, temperature, 1.0),
                      token_w=w)
    loss, d, ent, dh64, dw64 = truth
    assert abs(out.loss.item() - loss.item()) <= 2e-5 * max(1.0, abs(loss.item()))
    assert (out.divergence.double() - d).abs().max() <= 2e-5 * max(1.0, d.abs().max().item())
    assert (out.entropy.double() - ent).abs().max() <= 2e-4
    # as test_distillation.close: 1e-4 of the largest entry, or float32's resolution of the terms' magnitudes
    for got, want, scale in ((dh, dh64, truth.grad_scale[0]), (dw, dw64, truth.grad_scale[1])):
        assert (got.double() - want).abs().max() <= max(1e-4 * want.abs().max(), FLOAT32_UNITS * 2.0 ** -24 * scale)


def test_unchecked_packed_sequences_no_host_read():
    # cu_seqlens' values are checked on the host with check_inputs=True, not read at all without
    hs, ws, ht, wt, labels, _, _, t_ids, t_lp = batch()
    flat = labels.reshape(-1)
    cu = torch.tensor([0, 5, 6, 13, flat.numel()])
    with host_reads() as seen:
        out, _, _ = step(hs.reshape(-1, HS), ws, flat, "reverse_kl", None, ht.reshape(-1, HT), wt, t_ids, t_lp,
                         loss_agg="seq-mean-token-sum", cu_seqlens=cu, check_inputs=False)
    assert seen == [], seen
    checked, _, _ = step(hs.reshape(-1, HS), ws, flat, "reverse_kl", None, ht.reshape(-1, HT), wt, t_ids, t_lp,
                         loss_agg="seq-mean-token-sum", cu_seqlens=cu)
    assert (out.loss - checked.loss).abs() <= 1e-6 * max(1.0, checked.loss.abs().item())


def test_unchecked_does_not_validate_and_check_inputs_is_a_bool():
    hs, ws, ht, wt, labels, _, _, t_ids, t_lp = batch()
    for divergence in ("jsd", "forward_kl_topk"):
        with pytest.raises(TypeError, match="check_inputs must be a bool"):
            step(hs, ws, labels, divergence, 0.5 if divergence == "jsd" else None, ht, wt, t_ids, t_lp,
                 check_inputs=1)
    # a teacher log-prob above 0 at a scored token: refused when checked, not caught without
    bad = t_lp.clone()
    bad[1, 2, 0] = 0.5
    with pytest.raises(ValueError, match="teacher_topk_logprobs must be <= 0"):
        step(hs, ws, labels, "forward_kl_topk", None, ht, wt, t_ids, bad)
    out, _, _ = step(hs, ws, labels, "forward_kl_topk", None, ht, wt, t_ids, bad, check_inputs=False)
    assert torch.isfinite(out.loss)


def test_the_other_ops_unchecked_read_nothing_on_the_host():
    # the detector on fused_logprobs and the fused policy loss, whose check_inputs=False makes the same promise
    hs, ws, _, _, labels, temperature, _, _, _ = batch()
    adv, old = torch.randn(LEAD), -torch.rand(LEAD) * 3
    for check in (False, True):
        with host_reads() as seen:
            h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
            out = fused_logprobs(h, w, labels, temperature=temperature.nan_to_num(1.0), backend="chunked",
                                 check_inputs=check)
            (out.logprobs.sum() + out.entropy.sum()).backward()
            loss = fused_policy_loss(h, w, labels, adv, old, backend="chunked", check_inputs=check).loss
            loss.backward()
        assert (seen == []) == (not check), seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA GPU")
@pytest.mark.parametrize("divergence,beta", [("jsd", 0.5), ("forward_kl_topk", None), ("forward_kl_topk_tail", None)])
def test_cuda_graph_capture_and_replay(divergence, beta):
    """A whole step (loss, backward) captured once with check_inputs=False on the default backend, replayed on
    new inputs copied into the captured buffers; each replay's loss and gradients against an eager checked call."""
    dev = torch.device("cuda")
    first = [t.to(dev) if torch.is_tensor(t) else t for t in batch()]
    hs, ws, ht, wt, labels, temperature, token_weight, t_ids, t_lp = first
    h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    static = dict(ht=ht.clone(), labels=labels.clone(), temperature=temperature.clone(),
                  token_weight=token_weight.clone(), t_ids=t_ids.clone(), t_lp=t_lp.clone())

    def captured_step():
        teacher = teacher_of(divergence, static["ht"], wt, static["t_ids"], static["t_lp"], beta)
        out = fused_distillation_loss(h, w, static["labels"], divergence=divergence, temperature=static["temperature"],
                                      token_weight=static["token_weight"], check_inputs=False, **teacher)
        out.loss.backward()
        return out.loss, out.divergence

    graph, (loss, div) = capture(captured_step, (h, w))
    for _ in range(2):
        new = [t.to(dev) if torch.is_tensor(t) else t for t in batch()]
        with torch.no_grad():
            h.copy_(new[0])
        for key, value in zip(("ht", "labels", "temperature", "token_weight", "t_ids", "t_lp"),
                              (new[2], new[4], new[5], new[6], new[7], new[8]), strict=True):
            static[key].copy_(value)
        replay_poisoned(graph, (loss, div, h.grad, w.grad))
        want, dh, dw = step(new[0], ws, new[4], divergence, beta, new[2], wt, new[7], new[8],
                            temperature=new[5].nan_to_num(1.0), token_weight=new[6])
        assert (loss - want.loss).abs() <= 1e-5 * max(1.0, want.loss.abs().item())
        assert (div - want.divergence).abs().max() <= 1e-4
        assert (h.grad - dh).abs().max() <= 1e-4 * dh.abs().max() and (w.grad - dw).abs().max() <= 1e-4 * dw.abs().max()
