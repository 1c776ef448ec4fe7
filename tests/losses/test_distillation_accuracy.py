"""The full-vocabulary divergences at least as accurate as TRL 1.16's float32 ``ChunkedDivergenceFunction`` on the
same inputs, both against float64, over many random batches (V = 4099, H 96 and 80, divergences up to ~20 nats).

Two kinds of batch:
- logits exact in float32 (hidden states and weights on a coarse grid, temperature 0.8 whose inverse is exact):
  both implementations get the same exact logits, so the error is the divergence's formation alone. Ours ~7e-7,
  TRL's ~5e-6 (its float32 sums of the cross terms); before, ours was ~2e-5 (log-probs z - lse: lse's rounding
  shifts every log-prob alike, and sum p = 1 + that error multiplies the log-ratios).
- random float32 inputs at temperature 0.7: the float32 products' rounding (the same products, bit for bit, in
  both: ~1e-5 at these sizes) dominates both. Ours must add nothing to it: its median worst-token error within
  5% of an exact (float64) formation from the same float32 logits (before: 2x). Against TRL the medians are a
  draw decided by the products (TRL's ~5e-6 formation error happens to offset some of theirs on these seeds:
  the exact formation itself measures 1.13e-5 against TRL's 1.00e-5), so that comparison allows 25%.
"""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from logitless.losses import fused_distillation_loss
from logitless.ops.triton.common import INTERPRETING

trl_kernels = pytest.importorskip("trl.kernels.chunked_divergence", reason="TRL 1.16's chunked divergence")

V, HS, HT, N = 4099, 96, 80, 64
KINDS = (("forward_kl", None, 0.0), ("reverse_kl", None, 1.0), ("jsd", 0.5, 0.5))


def float64_divergence(hs, ws, ht, wt, kind, beta, temperature):
    zs = hs.double() @ ws.double().T / temperature
    zt = ht.double() @ wt.double().T / temperature
    ls, lt = zs.log_softmax(-1), zt.log_softmax(-1)
    if kind == "forward_kl":
        return (lt.exp() * (lt - ls)).sum(-1)
    if kind == "reverse_kl":
        return (ls.exp() * (ls - lt)).sum(-1)
    lm = torch.logaddexp(ls + math.log1p(-beta), lt + math.log(beta))
    return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)


def batch(seed, exact):
    g = torch.Generator().manual_seed(seed)
    if exact:   # products of k/4 and j/16 (|k|, |j| <= 8) sum exactly in float32
        def grid(shape, den):
            return torch.randint(-8, 9, shape, generator=g).float() / den
        return grid((N, HS), 4), grid((V, HS), 16), grid((N, HT), 4), grid((V, HT), 16)
    return (torch.randn(N, HS, generator=g), torch.randn(V, HS, generator=g) / HS ** 0.5 * 3,
            torch.randn(N, HT, generator=g), torch.randn(V, HT, generator=g) / HT ** 0.5 * 3)


def worst_errors(backend, exact, batches, temperature):
    """{kind: ([ours], [TRL's])}: each batch's worst token error against float64."""
    out = {kind: ([], []) for kind, _, _ in KINDS}
    for b in range(batches):
        hs, ws, ht, wt = batch(4100 + b, exact)
        for kind, beta, trl_beta in KINDS:
            want = float64_divergence(hs, ws, ht, wt, kind, beta if beta is not None else 0.5, temperature)
            ours = fused_distillation_loss(hs, ws, torch.zeros(N, dtype=torch.long), teacher_hidden=ht,
                                           teacher_weight=wt, divergence=kind, beta=beta, temperature=temperature,
                                           backend=backend).divergence
            theirs, _ = trl_kernels.ChunkedDivergenceFunction.apply(hs, ws, None, ht, wt, None, trl_beta,
                                                                     temperature)
            out[kind][0].append((ours.double() - want).abs().max().item())
            out[kind][1].append((theirs.double() - want).abs().max().item())
        if b == 0:
            assert want.max() > 0.5      # jsd's (bounded by log 2); the KL kinds' reach ~20 nats
    return out


BACKENDS = ["chunked"] + (["triton"] if INTERPRETING or torch.cuda.is_available() else [])


@pytest.mark.parametrize("backend", BACKENDS)
def test_formation_error_below_trl(backend):
    batches = 12 if backend == "chunked" else 3       # the interpreter is slow
    errs = worst_errors(backend, exact=True, batches=batches, temperature=0.8)
    for kind, (ours, theirs) in errs.items():
        # every batch at most TRL's error, and the median at most half of it
        assert all(o <= t for o, t in zip(ours, theirs, strict=True)), (kind, ours, theirs)
        assert statistics.median(ours) <= 0.5 * statistics.median(theirs), (kind, ours, theirs)


def test_random_batches_add_nothing_to_the_products_rounding():
    errs = worst_errors("chunked", exact=False, batches=12, temperature=0.7)
    exact = {kind: [] for kind, _, _ in KINDS}
    for b in range(12):
        hs, ws, ht, wt = batch(4100 + b, exact=False)
        inv_t = torch.tensor(1 / 0.7, dtype=torch.float32)          # the float32 logits both use, then float64
        zs, zt = ((hs @ ws.T) * inv_t).double(), ((ht @ wt.T) * inv_t).double()
        for kind, beta, _ in KINDS:
            got = float64_divergence(zs, torch.eye(V, dtype=torch.float64), zt, torch.eye(V, dtype=torch.float64),
                                     kind, beta if beta is not None else 0.5, 1.0)
            want = float64_divergence(hs, ws, ht, wt, kind, beta if beta is not None else 0.5, 0.7)
            exact[kind].append((got - want).abs().max().item())
    for kind, (ours, theirs) in errs.items():
        assert statistics.median(ours) <= 1.05 * statistics.median(exact[kind]) + 1e-7, (kind, ours, exact[kind])
        assert statistics.median(ours) <= 1.25 * statistics.median(theirs), (kind, ours, theirs)
