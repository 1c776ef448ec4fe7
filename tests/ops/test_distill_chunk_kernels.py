"""The triton backend's three distillation kernels (ops/triton/distill_chunk.py) against the one definition of
the divergences (ops/divergence_terms.py) on the same float32 products: several column spans, every divergence,
softcap and scale on both heads, per-row temperatures and weights. Through the interpreter on CPU."""
from __future__ import annotations

import pytest
import torch

from logitless.ops.divergence_terms import Divergence, HeadTransform
from logitless.ops.triton.common import INTERPRETING

pytestmark = pytest.mark.skipif(not INTERPRETING and not torch.cuda.is_available(),
                                reason="the kernels need a GPU or triton's interpreter")
DEV = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"


@pytest.mark.parametrize("div", [Divergence("forward_kl"), Divergence("reverse_kl"), Divergence("jsd", 0.3)])
@pytest.mark.parametrize("heads", [(HeadTransform(), HeadTransform()),
                                   (HeadTransform(1.3, 5.0), HeadTransform(0.7, 11.0))])
def test_kernels_follow_the_definitions(div, heads):
    from logitless.ops.triton import distill_chunk as k
    student, teacher = heads
    c, v = 5, 2 * k.SPAN + 37                      # three spans, the last ragged
    raw_s = torch.randn(c, v, device=DEV) * 4
    raw_t = raw_s * 0.7 + torch.randn(c, v, device=DEV) * 3
    it = torch.rand(c, device=DEV) + 0.5
    w = torch.rand(c, device=DEV)

    zs, tanh_s = student.logits(raw_s.clone(), it, keep_tanh=True)
    zt, _ = teacher.logits(raw_t.clone(), it)
    # the definitions in float64 from the same float32 logits
    ls, lt = zs.double().log_softmax(dim=1), zt.double().log_softmax(dim=1)
    ent = -(ls.exp() * ls).sum(dim=1)
    d, a, lm = div.partial_sums(ls, lt)
    dz = student.chain(div.student_dlogits(ls, lt, d, a, lm).mul_(w.double().unsqueeze(1)), it.double(),
                       None if tanh_s is None else tanh_s.double())

    rows = div.finish(k.statistics(raw_s, raw_t, it, div, student, teacher))
    # the row maxima (the kernel's tanh is one exp2 away from torch's: an ulp)
    assert torch.allclose(rows.m_s, zs.amax(dim=1), rtol=1e-6) and torch.allclose(rows.m_t, zt.amax(dim=1), rtol=1e-6)
    for got, want in ((rows.m_s + rows.g_s, torch.logsumexp(zs.double(), 1)), (rows.entropy, ent),
                      (rows.m_t + rows.g_t, torch.logsumexp(zt.double(), 1))):
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5), (got - want).abs().max()
    if div.one_pass:
        got_d, got_a = rows.d, None
    else:
        got_d, got_a = k.sums(raw_s, raw_t, it, rows, div, student, teacher)
        assert torch.allclose(got_a, a, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_d, d, rtol=1e-5, atol=1e-6), (got_d - d).abs().max()
    out = torch.empty(c, v, device=DEV)
    k.dlogits(raw_s, raw_t, it, rows, got_d, got_a, w, div, student, teacher, out)
    assert (out - dz).abs().max() <= 1e-5 * dz.abs().max(), (out - dz).abs().max()
    half = torch.empty(c, v, device=DEV, dtype=torch.bfloat16)
    k.dlogits(raw_s, raw_t, it, rows, got_d, got_a, w, div, student, teacher, half)
    assert torch.equal(half, out.bfloat16()) or (half.float() - dz).abs().max() <= 1e-2 * dz.abs().max()
