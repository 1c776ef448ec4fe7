"""FusedOutputProcessorContext(loss=PolicyLoss(...)) on a real GPTModel (TP=1, CPU): the hook returns
the fused policy loss and its metrics, equal to the same loss computed from the model's own logits in
float64 (verl's definitions, tests/policy64.py), with every parameter gradient."""
import pytest
import torch

from logitless.losses import PolicyLoss, PolicyLossOutput
from logitless.megatron import FusedOutputProcessorContext, fused_output_processor, last_path
from mcore_env import GRAD_TOL, LP_TOL
from policy64 import aggregate64, term64


def reference_loss(model, env, ids, pos, mask, labels, temperature, adv, old, ref, spec, loss_agg):
    """float64 loss (and log-probs) from the model's own logits [b, s, V]."""
    logits = env.unfused_logits(model, ids, pos, mask)
    t = temperature.double().unsqueeze(-1) if torch.is_tensor(temperature) else float(temperature)
    logp = torch.log_softmax(logits.double() / t, dim=-1)
    valid = labels != -100
    lp = logp.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    lp, ent = torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)
    f, _, _ = term64(lp, ent, torch.broadcast_to(adv.double(), lp.shape), old.double(), ref.double(), **spec)
    return aggregate64(f, valid, loss_agg), lp


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_hook_returns_the_policy_loss(megatron_tp1, seed, tied, loss_agg):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(tied=tied, seed=seed)
    b, s = 3, 11
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    labels[:, :3] = -100                                   # the prompt
    labels[2, 8:] = -100                                   # padding
    mask = env.causal_mask(s)
    temperature = torch.rand(b, s, generator=gen) + 0.5
    with torch.no_grad():
        _, lp_now = reference_loss(model, env, ids, pos, mask, labels, temperature, torch.zeros(b, 1),
                                   torch.zeros(b, s), torch.zeros(b, s), {}, loss_agg)
    adv = torch.randn(b, 1, generator=gen)                 # one per sequence
    old = (lp_now + 0.4 * torch.randn(b, s, generator=gen, dtype=torch.float64)).clamp(max=0.0).float()
    ref = (lp_now + 0.4 * torch.randn(b, s, generator=gen, dtype=torch.float64)).clamp(max=0.0).float()
    spec = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.02)
    policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_agg=loss_agg, **spec)

    model.zero_grad(set_to_none=True)
    ctx = FusedOutputProcessorContext(temperature=temperature, loss=policy)
    out = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor, output_processor_context=ctx)
    assert isinstance(out, PolicyLossOutput) and last_path().path == "hook"
    assert out.logprobs.shape == (b, s) and out.loss.shape == ()
    out.loss.backward()
    fused = env.param_grads(model)

    model.zero_grad(set_to_none=True)
    loss64, lp64 = reference_loss(model, env, ids, pos, mask, labels, temperature, adv, old, ref, spec, loss_agg)
    loss64.backward()
    want = env.param_grads(model)
    assert abs(out.loss.item() - loss64.item()) <= 1e-5, (out.loss.item(), loss64.item())
    assert (out.logprobs.double() - lp64.detach()).abs().max() <= LP_TOL
    for name, g in want.items():
        assert (g is None) == (fused[name] is None), name
        if g is not None and g.norm() > 0:
            assert env.rel_err(fused[name], g) <= GRAD_TOL, name
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert fused[head].norm() > 0 and fused["decoder.layers.0.self_attention.linear_qkv.weight"].norm() > 0


def test_without_loss_nothing_changes_and_bad_loss(megatron_tp1, seed):
    env = megatron_tp1
    model = env.build_gpt(seed=seed)
    ids, pos, labels = env.random_batch(2, 5, 262)
    out = env.run_fused(model, ids, pos, env.causal_mask(5), labels, 1.0)
    assert not isinstance(out, PolicyLossOutput) and out.logprobs.shape == (2, 5)
    with pytest.raises(TypeError, match="PolicyLoss"):
        FusedOutputProcessorContext(loss={"advantages": torch.ones(2, 1)})
    bad = PolicyLoss(advantages=torch.ones(3, 1))          # 3 sequences for a batch of 2
    with pytest.raises(ValueError, match="advantages"):
        model(ids, pos, env.causal_mask(5), labels=labels, output_processor=fused_output_processor,
              output_processor_context=FusedOutputProcessorContext(loss=bad))


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_packed_thd_policy_loss_with_cu_seqlens(seed, loss_agg):
    """Packed (THD) input, verl's Megatron engine layout: one row of labels [1, n] holding three sequences,
    each padded, and tail padding, delimited by the loss's cu_seqlens; against float64 on the flat tokens."""
    gen = torch.Generator().manual_seed(seed)
    h, vocab = 24, 97
    cu = torch.tensor([0, 6, 10, 16, 18])
    n = int(cu[-1])
    labels = torch.randint(0, vocab, (1, n), generator=gen)
    labels[0, [5, 9, 14, 15, 16, 17]] = -100                # sequence padding and the tail
    labels[0, :2] = -100                                    # a prompt
    hidden = torch.randn(n, 1, h, generator=gen).requires_grad_()
    head = torch.nn.Linear(h, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, h, generator=gen))
    adv, old, ref = (torch.randn(1, n, generator=gen) for _ in range(3))
    old, ref = -old.abs() - 1.0, -ref.abs() - 1.0
    spec = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, kl_type="k3", entropy_coef=0.02)
    policy = PolicyLoss(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_agg=loss_agg, cu_seqlens=cu, **spec)
    out = fused_output_processor(hidden_states=hidden, output_layer=head, output_weight=None, labels=labels,
                                 context=FusedOutputProcessorContext(temperature=0.8, loss=policy))
    assert isinstance(out, PolicyLossOutput) and out.logprobs.shape == (1, n) and out.entropy.shape == (1, n)
    g_hidden, g_weight = torch.autograd.grad(out.loss, (hidden, head.weight))

    h64, w64 = hidden.detach().double().requires_grad_(), head.weight.detach().double().requires_grad_()
    logp = torch.log_softmax(h64.reshape(n, h) @ w64.t() / 0.8, dim=-1)
    flat = labels.reshape(-1)
    valid = flat != -100
    lp = torch.where(valid, logp.gather(-1, flat.clamp_min(0)[:, None]).squeeze(-1), 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    f, _, _ = term64(lp, ent, adv.reshape(-1).double(), old.reshape(-1).double(), ref.reshape(-1).double(), **spec)
    loss64 = aggregate64(f, valid, loss_agg, cu)
    w_hidden, w_weight = torch.autograd.grad(loss64, (h64, w64))
    assert abs(out.loss.item() - loss64.item()) <= 1e-5 * max(1.0, abs(loss64.item()))
    assert (out.logprobs.reshape(-1).double() - lp.detach()).abs().max() <= LP_TOL
    assert float((g_hidden.double() - w_hidden).norm() / w_hidden.norm()) <= GRAD_TOL
    assert float((g_weight.double() - w_weight).norm() / w_weight.norm()) <= GRAD_TOL
    with pytest.raises(ValueError, match="packed"):       # cu_seqlens with more than one row
        fused_output_processor(hidden_states=hidden.detach().view(9, 2, h), output_layer=head, output_weight=None,
                               labels=labels.view(2, 9), context=FusedOutputProcessorContext(loss=policy))
