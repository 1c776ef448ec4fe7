"""A HybridModel with real Mamba layers (megatron-core's MambaMixer; see mamba_env.py for how mamba-ssm's Triton
ops are reached without its CUDA extension) through logitless' legacy patch, against the same model's own
logits: log-probs, entropy and every parameter gradient, Mamba layers' included, and the fused policy loss.
On CPU the mixer's SSD scan is its recurrence and the gated RMSNorm mamba-ssm's pure-torch reference; on a GPU
(test_megatron_mamba_gpu.py) they are mamba-ssm's Triton kernels."""
import pytest
import torch

from logitless.losses import PolicyLoss
from logitless.megatron import FusedOutputProcessorContext, fused_output_processor, last_path, patch_fused_forward
from mcore_env import ENT_TOL, GRAD_TOL, LP_TOL, param_grads, reference_from_logits, rel_err


def check_against_own_logits(model, device, gen, b=2, s=16, temperature=0.8):
    """The fused log-probs / entropy and their gradients against float64 from the model's own logits; then the
    fused policy loss against the same loss on those logits. Returns (max value error, max gradient error)."""
    v = model.vocab_size
    ids = torch.randint(0, v, (b, s), generator=gen).to(device)
    labels = torch.randint(0, v, (b, s), generator=gen).to(device)
    pos = torch.arange(s, device=device).expand(b, s)
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)
    a, c = (torch.randn(b, s, generator=gen).to(device) for _ in range(2))
    assert patch_fused_forward(model) == "legacy"

    model.zero_grad(set_to_none=True)
    out = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor,
                output_processor_context=FusedOutputProcessorContext(temperature=temperature))
    rec = last_path()
    ((a * out.logprobs).sum() + (c * out.entropy).sum()).backward()
    got = param_grads(model)
    assert (rec.path, rec.model) == ("legacy", "HybridModel") and rec.backend is not None, rec
    model.zero_grad(set_to_none=True)
    logits = model(ids, pos, mask)
    assert logits.shape == (b, s, v)
    lp, ent = reference_from_logits(logits, labels, temperature)
    ((a * lp).sum() + (c * ent).sum()).backward()
    worst = max(float((out.logprobs.double() - lp).abs().max()), float((out.entropy.double() - ent).abs().max()))
    assert worst <= max(LP_TOL, ENT_TOL), worst
    gworst = 0.0
    for name, g in param_grads(model).items():
        assert (g is None) == (got[name] is None), name
        if g is not None and g.norm() > 0:
            gworst = max(gworst, rel_err(got[name], g))
            assert rel_err(got[name], g) <= GRAD_TOL, (name, rel_err(got[name], g))
    mamba = [n for n in got if ".mixer." in n]
    assert mamba and all(got[n] is not None and got[n].norm() > 0 for n in mamba), mamba

    old = (lp.detach() + 0.3 * torch.randn(b, s, generator=gen, dtype=torch.float64).to(device)).clamp(max=0.0).float()
    adv = torch.randn(b, 1, generator=gen).to(device)
    policy = PolicyLoss(advantages=adv, old_logprobs=old, clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
    model.zero_grad(set_to_none=True)
    fused = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor,
                  output_processor_context=FusedOutputProcessorContext(temperature=temperature, loss=policy))
    fused.loss.backward()
    got = param_grads(model)
    model.zero_grad(set_to_none=True)
    lp, _ = reference_from_logits(model(ids, pos, mask), labels, temperature)
    ratio = torch.exp(lp - old.double())
    loss64 = torch.maximum(-adv.double() * ratio, -adv.double() * ratio.clamp(0.8, 1.28)).mean()
    loss64.backward()
    assert abs(float(fused.loss) - float(loss64)) <= 1e-5
    for name, g in param_grads(model).items():
        if g is not None and g.norm() > 0:
            assert rel_err(got[name], g) <= GRAD_TOL, (name, rel_err(got[name], g))
    return worst, gworst


@pytest.fixture(scope="module")
def mixer():
    import mamba_env
    with mamba_env.mamba_mixer() as module:
        yield module


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mamba_hybrid_matches_its_own_logits(megatron_tp1, mixer, seed, tied):
    import mamba_env
    gen = torch.Generator().manual_seed(seed)
    model = mamba_env.build_mamba_hybrid(mixer, tied=tied, seed=seed)
    assert isinstance(model.decoder.layers[0].mixer, mixer.MambaMixer)
    with mamba_env.reference_kernels(mixer):
        check_against_own_logits(model, "cpu", gen, b=2, s=13)


def test_ssd_recurrence_equals_mamba_ssms_chunked_reference(mixer, seed):
    """The CPU stand-in for the SSD scan against mamba-ssm's own chunked pure-torch reference (two chunks of 8,
    two groups of heads; decays small enough for that reference's exponentials), forward values."""
    from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref

    import mamba_env
    gen = torch.Generator().manual_seed(seed)
    b, s, h, p, g, n, chunk = 2, 16, 4, 6, 2, 5, 8
    x, z = torch.randn(b, s, h, p, generator=gen), torch.randn(b, s, h, p, generator=gen)
    dt = 0.3 * torch.randn(b, s, h, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.2
    B, C = torch.randn(b, s, g, n, generator=gen), torch.randn(b, s, g, n, generator=gen)
    D, dt_bias = torch.randn(h, generator=gen), 0.1 * torch.randn(h, generator=gen)
    got = mamba_env.ssd_recurrence(x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    want = ssd_chunk_scan_combined_ref(x, dt, A, B, C, chunk, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-4 * want.abs().max()
