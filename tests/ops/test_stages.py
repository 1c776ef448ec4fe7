"""ops/triton/stages.py, the benchmarks' surface over the kernel stages: each call computes what it says
(against float64 on odd shapes), and launch settings are restored. On CPU through triton's interpreter."""
from __future__ import annotations

import pytest
import torch

from logitless.ops.triton import stages

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def chunk(seed, c=37, h=96, v=1031, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(c, h, generator=g).to(dtype).to(DEV)
    weight = (torch.randn(v, h, generator=g) * (3 / h ** 0.5)).to(dtype).to(DEV)
    labels = torch.randint(0, v, (c,), generator=g).to(DEV)
    labels[::5] = -1                                    # rows without a label
    inv_t = (torch.rand(c, generator=g) + 0.5).to(DEV)
    return hidden, weight, labels, inv_t


def test_policy_stages_match_float64(seed):
    hidden, weight, labels, inv_t = chunk(seed)
    c, v = hidden.shape[0], weight.shape[0]
    plan = stages.policy_plan(c, v, hidden.dtype, DEV)
    assert plan.rows >= c and plan.chunks == 1 and plan.n_tiles * plan.tile_cols >= v
    bufs = stages.policy_buffers(c, v, hidden.dtype, DEV, fill=float("nan"))
    stages.policy_stats(hidden, weight, labels, inv_t, bufs)
    lse, ent = stages.combine(bufs)
    z = (hidden.double() @ weight.double().T) * inv_t.double()[:, None]
    logp = torch.log_softmax(z, -1)
    p = logp.exp()
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(ent.double(), -(p * logp).sum(-1), atol=5e-5, rtol=1e-5)
    has = labels >= 0
    zy = z.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    torch.testing.assert_close(bufs.label_logit[has].double(), zy[has], atol=5e-5, rtol=1e-5)
    g_lp, g_ent = torch.randn(c, device=DEV) * 0.1, torch.randn(c, device=DEV) * 0.1
    dl = stages.policy_dlogits(bufs, lse, ent, g_lp, g_ent, inv_t, labels)
    assert dl.shape == (c, v) and dl.dtype == hidden.dtype
    # d/dz of g_lp * logp[label] + g_ent * entropy, times 1/T
    h_row = -(p * logp).sum(-1, keepdim=True)
    want = -g_lp.double()[:, None] * p - g_ent.double()[:, None] * p * (logp + h_row)
    want[has, labels[has]] += g_lp.double()[has]
    want = want * inv_t.double()[:, None]
    torch.testing.assert_close(dl.double(), want, atol=2e-3 * want.abs().max().item(), rtol=2e-2)


def test_logprob_stages_match_float64(seed):
    hidden, weight, labels, inv_t = chunk(seed, dtype=torch.float32)
    lse, ent, zy = stages.logprob_stats(hidden, weight, labels, inv_t, True)
    z = (hidden.double() @ weight.double().T) * inv_t.double()[:, None]
    torch.testing.assert_close(lse.double(), torch.logsumexp(z, -1), atol=2e-5, rtol=2e-6)
    g = torch.randn_like(lse)
    dh, dw = stages.logprob_grads(hidden, weight, labels, inv_t, lse, ent, g, None, True, False)
    assert dw is None and dh.shape == hidden.shape
    p = torch.softmax(z, -1)
    has = labels >= 0
    dz = -g.double()[:, None] * p
    dz[has, labels[has]] += g.double()[has]
    want = (dz * inv_t.double()[:, None]) @ weight.double()
    torch.testing.assert_close(dh.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-3)
    cols = stages.logprob_chunk_columns(hidden.shape[0], weight.shape[0], 64)
    assert 0 < cols


def test_launch_settings_restored_and_checked():
    before = stages.launch_settings("dlogits")
    with stages.launch("dlogits", ROWS_PER_PROGRAM=before["ROWS_PER_PROGRAM"] * 2):
        assert stages.launch_settings("dlogits")["ROWS_PER_PROGRAM"] == before["ROWS_PER_PROGRAM"] * 2
    assert stages.launch_settings("dlogits") == before
    with pytest.raises(ValueError, match="ROWS"):
        with stages.launch("dlogits", ROWS=3):
            pass


def test_gluon_launch_settings_name_real_constants():
    # every name the surface offers for the Gluon kernel is a constant of that module (FWD_STAGES: the forward's
    # ring depth, which benchmarks/gpu_invariance.py varies); without Gluon (the interpreter) a change is refused
    from logitless.ops.triton import policy_stats_gluon
    _, names = stages._LAUNCH["gluon_stats"]
    if stages.policy_stats_gluon is None:
        with pytest.raises(RuntimeError, match="Gluon"):
            with stages.launch("gluon_stats", FWD_STAGES=5):
                pass
        assert stages.launch_settings("gluon_stats") == {}
        assert all(isinstance(getattr(policy_stats_gluon, name, None), int) for name in names), names
        return
    before = stages.launch_settings("gluon_stats")
    assert set(before) == set(names)
    with stages.launch("gluon_stats", FWD_STAGES=before["FWD_STAGES"] + 1):
        assert stages.launch_settings("gluon_stats")["FWD_STAGES"] == before["FWD_STAGES"] + 1
    assert stages.launch_settings("gluon_stats") == before


def test_instrument_policy_pass_sees_every_stage_and_restores(seed):
    from logitless.losses import fused_policy_loss
    from logitless.ops.triton import policy_backend
    hidden, weight, labels, _ = chunk(seed, c=23, v=517, dtype=torch.float32)
    labels = labels.masked_fill(labels < 0, -100)          # the public op's ignore_index
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    calls = []

    def counted(name, fn):
        def inner(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return inner

    before = {n: getattr(policy_backend, n) for n in stages.POLICY_STAGES + ("policy_pass",)}
    with stages.instrument_policy_pass(counted, counted, (("logitless.losses.function", "score_tokens"),)):
        out = fused_policy_loss(hidden, weight, labels, torch.randn(23, device=DEV), backend="triton")
        out.loss.backward()
    assert {n: getattr(policy_backend, n) for n in before} == before
    assert set(calls) >= {"score_tokens", "policy_pass", "chunk_stats", "combine_tiles", "dlogits_in_place",
                          "product_into", "accumulate_product"}, calls
