"""fused_distillation_loss takes ``precision`` / ``grad_precision`` for float32 operands as fused_logprobs does
(ops/precision.py): the split products for every float32 head's logits, the student's gradient products, named by
last_precision(), for the full-vocabulary and the top-k divergences; a setting with no effect is an error. Against
float64 (V = 4099, H 96 and 80, N 7)."""
from __future__ import annotations

import math

import pytest
import torch

from logitless import last_precision
from logitless.losses import fused_distillation_loss
from logitless.ops.triton.common import INTERPRETING
from logitless.record import last_path

V, N = 4099, 7
BACKENDS = ["chunked"] + (["triton"] if INTERPRETING or torch.cuda.is_available() else [])
# (precision, grad_precision) -> (recorded, divergence bound, gradient bound relative to the largest element)
CASES = {("bf16x6", "bf16x6"): (("bf16x6", "bf16x6"), 2e-5, 1e-4),
         ("bf16x3", None): (("bf16x3", "bf16"), 5e-4, 3e-2),
         ("bf16x3", "bf16x3"): (("bf16x3", "bf16x3"), 5e-4, 5e-4),
         ("tf32", None): (("tf32", "bf16"), 2e-2, 3e-2)}


def heads(s_dtype=torch.float32, t_dtype=torch.float32):
    g = torch.Generator().manual_seed(41)
    return (torch.randn(N, 96, generator=g).to(s_dtype), (torch.randn(V, 96, generator=g) / 4).to(s_dtype),
            torch.randn(N, 80, generator=g).to(t_dtype), (torch.randn(V, 80, generator=g) / 3).to(t_dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", list(CASES))
@pytest.mark.parametrize("divergence,beta", [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3)])
def test_precisions_against_float64(backend, setting, divergence, beta):
    recorded, div_tol, grad_tol = CASES[setting]
    hs, ws, ht, wt = heads()
    h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    out = fused_distillation_loss(h, w, torch.zeros(N, dtype=torch.long), teacher_hidden=ht, teacher_weight=wt,
                                  divergence=divergence, beta=beta, temperature=0.7, backend=backend,
                                  precision=setting[0], grad_precision=setting[1])
    out.loss.backward()
    assert last_precision() == recorded
    h64, w64 = hs.double().requires_grad_(), ws.double().requires_grad_()
    ls = (h64 @ w64.T / 0.7).log_softmax(-1)
    lt = (ht.double() @ wt.double().T / 0.7).log_softmax(-1)
    if divergence == "forward_kl":
        want = (lt.exp() * (lt - ls)).sum(-1)
    elif divergence == "reverse_kl":
        want = (ls.exp() * (ls - lt)).sum(-1)
    else:
        lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
        want = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    want.mean().backward()
    assert (out.divergence.double() - want).abs().max() <= div_tol
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (got.double() - ref).abs().max() <= grad_tol * ref.abs().max()


def test_teacher_alone_float32():
    """A bfloat16 student and a float32 teacher: precision is the teacher's; grad_precision has no effect."""
    hs, ws, ht, wt = heads(s_dtype=torch.bfloat16)
    fused_distillation_loss(hs, ws, torch.zeros(N, dtype=torch.long), teacher_hidden=ht, teacher_weight=wt,
                            divergence="forward_kl", precision="bf16x6")
    assert last_precision() == ("bf16x6", "native")
    with pytest.raises(ValueError, match="grad_precision"):
        fused_distillation_loss(hs, ws, torch.zeros(N, dtype=torch.long), teacher_hidden=ht, teacher_weight=wt,
                                divergence="forward_kl", grad_precision="bf16x3")


def test_settings_without_effect_refused():
    hs, ws, ht, wt = heads(torch.bfloat16, torch.bfloat16)
    labels = torch.zeros(N, dtype=torch.long)
    with pytest.raises(ValueError, match="precision"):
        fused_distillation_loss(hs, ws, labels, teacher_hidden=ht, teacher_weight=wt, divergence="jsd", beta=0.5,
                                precision="bf16x3")
    with pytest.raises(ValueError, match="precision"):
        fused_distillation_loss(hs.float(), ws.float(), labels, teacher_hidden=ht, teacher_weight=wt,
                                divergence="jsd", beta=0.5, precision="fp64")
    with pytest.raises(TypeError, match="precision"):
        fused_distillation_loss(hs.float(), ws.float(), labels, teacher_hidden=ht, teacher_weight=wt,
                                divergence="jsd", beta=0.5, precision=3)
    ids = torch.stack([torch.randperm(V, generator=torch.Generator().manual_seed(i))[:2] for i in range(N)])
    for name in ("precision", "grad_precision"):      # a half-precision student: no float32 products to choose
        with pytest.raises(ValueError, match=name):
            fused_distillation_loss(hs, ws, labels, teacher_topk_ids=ids,
                                    teacher_topk_logprobs=torch.full((N, 2), -1.0), divergence="forward_kl_topk",
                                    **{name: "bf16x3"})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", list(CASES))
@pytest.mark.parametrize("divergence", ["forward_kl_topk", "forward_kl_topk_tail"])
def test_topk_precisions_against_float64(backend, setting, divergence, monkeypatch):
    """The top-k divergences take the same settings for a float32 student (its logits and gradient products; the
    route through the k-label op, whose passes take the split), named by last_precision(). The tail's gradient off
    the triton backend is the torch pass's IEEE float32 products (float32-exact: named so); a gradient setting there
    is refused."""
    recorded, div_tol, grad_tol = CASES[setting]
    tail_torch_pass = divergence == "forward_kl_topk_tail" and backend != "triton"
    if tail_torch_pass:
        recorded = (recorded[0], "ieee")
    hs, ws, ht, wt = heads()
    g = torch.Generator().manual_seed(7)
    lt = (ht.double() @ wt.double().T / 0.7).log_softmax(-1)
    t_lp, ids = lt.topk(6, dim=-1)
    ids = ids[:, torch.randperm(6, generator=g)]            # not in the teacher's order
    t_lp = lt.gather(1, ids)
    import logitless.ops.precision as precision_module
    made = []     # the operands the setting asks for are made (a setting ignored would make none)
    for name in ("split_concat", "round_tf32"):
        real = getattr(precision_module, name)
        monkeypatch.setattr(precision_module, name, lambda *a, _real=real, _name=name, **kw: made.append(_name)
                            or _real(*a, **kw))
    h, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    if tail_torch_pass and setting[1] is not None:
        # a gradient setting the torch pass's IEEE products would not follow: refused, naming it
        with pytest.raises(ValueError, match="grad_precision"):
            fused_distillation_loss(h, w, torch.zeros(N, dtype=torch.long), teacher_topk_ids=ids,
                                    teacher_topk_logprobs=t_lp.float(), divergence=divergence, backend=backend,
                                    precision=setting[0], grad_precision=setting[1])
        setting = (setting[0], None)
        recorded = (recorded[0], "ieee")
    out = fused_distillation_loss(h, w, torch.zeros(N, dtype=torch.long), teacher_topk_ids=ids,
                                  teacher_topk_logprobs=t_lp.float(), divergence=divergence, temperature=0.7,
                                  backend=backend, precision=setting[0], grad_precision=setting[1])
    assert last_path().entry == "fused_logprobs_k"
    out.loss.backward()
    assert last_precision() == recorded
    assert ("round_tf32" if setting[0] == "tf32" else "split_concat") in made
    h64, w64 = hs.double().requires_grad_(), ws.double().requires_grad_()
    ls = (h64 @ w64.T / 0.7).log_softmax(-1)
    s = ls.gather(1, ids)
    q = t_lp.exp()
    want = (q * (t_lp - s)).sum(-1)
    if divergence == "forward_kl_topk":
        want = want.clamp(min=0)
    else:
        q_tail = 1 - q.sum(-1)
        p_tail = torch.logsumexp(ls.scatter(1, ids, float("-inf")), -1)
        want = want + q_tail * (q_tail.log() - p_tail)
    want.mean().backward()
    assert (out.divergence.double() - want).abs().max() <= div_tol
    for got, ref in ((h.grad, h64.grad), (w.grad, w64.grad)):
        assert (got.double() - ref).abs().max() <= grad_tol * ref.abs().max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("check_inputs", [True, False])
def test_adaptive_split_decides_per_call(backend, check_inputs):
    """precision="split" (CUDA's default for float32 heads) runs as few products as the operands allow: three for
    general float32 operands, one where every operand holds bfloat16 values (with check_inputs: without, no host
    read decides, and the general three run); last_precision() names what ran, and the divergence is float64's
    to the bound of what ran."""
    hs, ws, ht, wt = heads()
    labels = torch.zeros(N, dtype=torch.long)
    for exact in (False, True):
        ops = [x.bfloat16().float() if exact else x for x in (hs, ws, ht, wt)]
        h, w = ops[0].clone().requires_grad_(), ops[1].clone().requires_grad_()
        out = fused_distillation_loss(h, w, labels, teacher_hidden=ops[2], teacher_weight=ops[3],
                                      divergence="forward_kl", temperature=0.7, backend=backend, precision="split",
                                      check_inputs=check_inputs)
        out.loss.backward()
        ran = "bf16x1" if exact and check_inputs else "bf16x3"
        assert last_precision() == (ran, "bf16")
        ls = (ops[0].double() @ ops[1].double().T / 0.7).log_softmax(-1)
        lt = (ops[2].double() @ ops[3].double().T / 0.7).log_softmax(-1)
        want = (lt.exp() * (lt - ls)).sum(-1)
        assert (out.divergence.double() - want).abs().max() <= (1e-5 if ran == "bf16x1" else 5e-4)
        assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all() and h.grad.abs().sum() > 0
