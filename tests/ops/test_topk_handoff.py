"""fused_topk's masked rows (ids -1) handed to the student's side: fused_logprobs with ignore_index=-1 and the
top-k distillation loss with the same tokens ignored, against float64; and fused_topk's check of the hidden
states at the rows the mask keeps (a NaN row used to come back as ids 0, 1, 2 with NaN log-probs)."""
from __future__ import annotations

import math

import pytest
import torch

from logitless import fused_logprobs, fused_topk
from logitless.losses import fused_distillation_loss

V, H, HT, N, K = 4099, 96, 80, 7, 5


def batch(seed=41):
    g = torch.Generator().manual_seed(seed)
    th, tw = torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) * 0.2
    sh, sw = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.2
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[1, 4]] = -100
    return th, tw, sh, sw, labels


@pytest.mark.parametrize("backend", ["reference", "chunked", "triton"])
def test_teacher_topk_with_mask_to_student(backend):
    th, tw, sh, sw, labels = batch()
    scored = labels != -100
    teacher = fused_topk(th, tw, K, mask=scored, backend=backend)
    assert (teacher.ids[~scored] == -1).all() and (teacher.ids[scored] >= 0).all()
    h, w = sh.clone().requires_grad_(), sw.clone().requires_grad_()
    student = fused_logprobs(h, w, teacher.ids, ignore_index=-1, backend=backend)
    g = torch.randn(N, K, generator=torch.Generator().manual_seed(2))
    (student.logprobs * g).sum().backward()
    h64, w64 = sh.double().requires_grad_(), sw.double().requires_grad_()
    ls = torch.log_softmax(h64 @ w64.T, -1).gather(-1, teacher.ids.clamp(min=0))
    want = torch.where(scored.unsqueeze(1), ls, 0.0)
    (want * g.double()).sum().backward()
    assert (student.logprobs.double() - want.detach()).abs().max() < 2e-5
    assert (student.logprobs[~scored] == 0).all() and (h.grad[~scored] == 0).all()
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (got.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    # the loss takes the teacher's output as it is: unscored tokens' ids are never read
    h.grad = None
    out = fused_distillation_loss(h, w, labels, divergence="forward_kl_topk", teacher_topk_ids=teacher.ids,
                                  teacher_topk_logprobs=teacher.logprobs, backend=backend)
    q = teacher.logprobs.double()
    d = (q.exp() * (q - torch.log_softmax(sh.double() @ sw.double().T, -1).gather(-1, teacher.ids.clamp(min=0))))
    d = d.sum(-1).clamp_min(0.0)
    assert math.isclose(out.loss.item(), d[scored].mean().item(), rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk_refuses_non_finite_hidden_in_kept_rows(bad):
    th, tw, _, _, labels = batch()
    hn = th.clone()
    hn[3, 5] = bad
    with pytest.raises(ValueError, match="hidden must be finite at every row where mask is True"):
        fused_topk(hn, tw, 3)
    # a masked row may hold anything (padding); unchecked, nothing is read on the host
    mask = torch.ones(N, dtype=torch.bool)
    mask[3] = False
    out = fused_topk(hn, tw, 3, mask=mask)
    assert (out.ids[3] == -1).all() and torch.isfinite(out.logprobs).all()
    fused_topk(hn, tw, 3, check_inputs=False)
