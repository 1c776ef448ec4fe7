"""The schedule-plan path on CPU: megatron-core's build_schedule_plan with logitless' processor, run
through TransformerModelChunkSchedulePlan.run without overlap (one micro-batch forward, then its
backward; CUDA streams and events are no-ops here, see mcore_env.cpu_streams), against the model's
own forward through the hook and against its unfused logits. The overlapped run is a GPU test."""
import pytest
import torch

from logitless.losses import PolicyLoss
from logitless.megatron import FusedPathUnavailable, last_path
from logitless.megatron.schedule import build_fused_schedule_plan, supports_schedule_plan_hook
from mcore_env import ENT_TOL, GRAD_TOL, LP_TOL


def plan_forward_backward(env, model, grads_of, **kw):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    model.zero_grad(set_to_none=True)
    with env.cpu_streams():
        plan = build_fused_schedule_plan(model, **kw)
        out = Plan.run(plan, None)
        record = last_path()
        Plan.run(None, plan, b_grad=grads_of(out))
    return out, record, env.param_grads(model)


def logits_processor(*, hidden_states, output_layer, output_weight, scale_logits=None, **_):
    """Megatron's own output layer at the post-process node (the unfused reference)."""
    z, _ = output_layer(hidden_states, weight=output_weight)
    return (scale_logits(z) if scale_logits is not None else z).transpose(0, 1)


@pytest.mark.parametrize("tied,mtp", [(False, False), (True, False)], ids=["untied", "tied"])
def test_schedule_plan_equals_the_plans_own_logits(megatron_tp1, seed, tied, mtp):
    """logitless' processor in the plan against the same plan whose post-process node builds the
    model's own logits: values, and every parameter gradient through the plan's backward. (For dense
    layers megatron-core's plan skips the decoder's final layernorm, unlike the model's forward: the
    reference is the plan itself, not the forward. MTP in the plan needs MoE layers, whose dispatch does
    not run on CPU: that case is a GPU test.)"""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(tied=tied, mtp=mtp, seed=seed)
    assert supports_schedule_plan_hook(model)
    b, s = 2, 9
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    temps = 0.5 + torch.rand(b, s, generator=gen)
    a, c = torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen)
    (lp, ent), rec, got = plan_forward_backward(
        env, model, lambda o: (a, c), input_ids=ids, position_ids=pos, attention_mask=mask, labels=labels,
        temperature=temps)
    assert rec.path == "schedule-plan" and rec.model == "GPTModel" and rec.backend is not None
    assert lp.shape == (b, s) and lp.dtype == torch.float32 and ent.shape == (b, s)

    from logitless.megatron.mtp import disable_fused_mtp
    disable_fused_mtp(model)                       # the reference: megatron-core's own MTP losses too
    model.zero_grad(set_to_none=True)
    with env.cpu_streams():
        plan = model.build_schedule_plan(ids, pos, mask, labels=labels, output_processor=logits_processor)
        logits = Plan.run(plan, None)
        leaf = logits.detach().double().requires_grad_()
        lp64, ent64 = env.reference_from_logits(leaf, labels, temps)
        ((a * lp64).sum() + (c * ent64).sum()).backward()
        Plan.run(None, plan, b_grad=leaf.grad.float())
    assert (lp.double() - lp64).abs().max() <= LP_TOL and (ent.double() - ent64).abs().max() <= ENT_TOL
    for name, g in env.param_grads(model).items():
        assert (g is None) == (got[name] is None), name
        if g is not None and g.norm() > 0:
            assert env.rel_err(got[name], g) <= GRAD_TOL, name
    if mtp:
        assert all(got[n].norm() > 0 for n in got if n.startswith("mtp."))


def test_schedule_plan_policy_loss_and_refusal(megatron_tp1, seed):
    from logitless.megatron import FusedOutputProcessorContext, fused_output_processor
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(seed=seed)
    # megatron-core's plan skips the decoder's final layernorm of dense layers; without one, the plan
    # and the forward compute the same hidden states, so the forward through the hook is the reference
    model.decoder.final_layernorm = None
    b, s = 2, 8
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    labels[:, :2] = -100
    mask = env.causal_mask(s)
    with torch.no_grad():
        now = env.run_fused(model, ids, pos, mask, labels.clamp(min=0), 1.0).logprobs
    policy = PolicyLoss(advantages=torch.randn(b, 1, generator=gen), old_logprobs=now + 0.3 * torch.randn(
        b, s, generator=gen), clip_low=0.2, clip_high=0.28, loss_agg="seq-mean-token-mean")
    loss, rec, got = plan_forward_backward(env, model, lambda o: torch.ones_like(o), input_ids=ids,
                                           position_ids=pos, attention_mask=mask, labels=labels, loss=policy)
    assert loss.dim() == 0 and rec.path == "schedule-plan" and loss.policy_output.loss is loss
    model.zero_grad(set_to_none=True)
    want = model(ids, pos, mask, labels=labels, output_processor=fused_output_processor,
                 output_processor_context=FusedOutputProcessorContext(loss=policy))
    want.loss.backward()
    assert torch.allclose(loss, want.loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(loss.policy_output.clip_fraction, want.clip_fraction)
    for name, g in env.param_grads(model).items():
        if g is not None and g.norm() > 0:
            assert env.rel_err(got[name], g) <= GRAD_TOL, name

    legacy = env.build_with_class(env.no_postprocess_gpt_class(), seed=seed)
    type(legacy).build_schedule_plan = lambda self, *a, **k: None      # a builder without the hook
    try:
        with pytest.raises(FusedPathUnavailable, match="build_schedule_plan"):
            build_fused_schedule_plan(legacy, ids, pos, mask, labels=labels)
    finally:
        del type(legacy).build_schedule_plan
    with pytest.raises(TypeError, match="output_processor"):
        build_fused_schedule_plan(model, ids, pos, mask, labels=labels, output_processor=print)


def check_two_micro_batches(model, gen, device="cpu", b=2, s=24):
    """megatron-core's combined 1F1B chunk schedule on two micro-batches: 1 forward, then 2's forward
    together with 1's backward (``Plan.run(p2, p1)``; overlapped on two CUDA streams on a GPU), then 2's
    backward, logitless' processor in the post-process nodes. Against the model's forward with its own
    logits (float64 log-softmax) and megatron-core's own MTP losses: both micro-batches' log-probs and
    entropy, and every parameter gradient. Returns (max value error, max gradient relative error)."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan

    from logitless.megatron import last_path
    from logitless.megatron.mtp import disable_fused_mtp
    v = model.vocab_size
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)
    pos = torch.arange(s, device=device).expand(b, s)
    mbs = []
    for _ in range(2):
        ids = torch.randint(0, v, (b, s), generator=gen).to(device)
        labels = torch.randint(0, v, (b, s), generator=gen).to(device)
        temps = (0.5 + torch.rand(b, s, generator=gen)).to(device)
        w = (torch.randn(b, s, generator=gen).to(device), torch.randn(b, s, generator=gen).to(device))
        mbs.append((ids, labels, temps, w))

    def plan(i):
        ids, labels, temps, _ = mbs[i]
        return build_fused_schedule_plan(model, ids, pos, mask, labels=labels, temperature=temps)

    model.zero_grad(set_to_none=True)
    p1 = plan(0)
    out1 = Plan.run(p1, None)
    p2 = plan(1)
    out2 = Plan.run(p2, p1, b_grad=mbs[0][3])
    rec = last_path()
    Plan.run(None, p2, b_grad=mbs[1][3])
    got = {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
    assert rec.path == "schedule-plan" and rec.model == "GPTModel" and rec.backend is not None, rec

    disable_fused_mtp(model)
    model.zero_grad(set_to_none=True)
    total, worst = 0, 0.0
    for (ids, labels, temps, (a, c)), out in zip(mbs, (out1, out2), strict=True):
        z = model(ids, pos, mask, labels=labels, output_processor=logits_processor).double() / temps.double()[..., None]
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, labels[..., None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        worst = max(worst, float((out[0].double() - lp).abs().max()), float((out[1].double() - ent).abs().max()))
        total = total + (a * lp).sum() + (c * ent).sum()
    total.backward()
    gworst = 0.0
    for name, p in model.named_parameters():
        g = p.grad
        assert (g is None) == (got[name] is None), name
        if g is not None and g.norm() > 0:
            err = float((got[name].double() - g.double()).norm() / g.double().norm())
            assert err <= GRAD_TOL, (name, err)
            gworst = max(gworst, err)
    if model.config.mtp_num_layers:
        assert all(got[n] is not None and got[n].norm() > 0 for n in got if n.startswith("mtp."))
    assert worst <= LP_TOL, worst
    return worst, gworst


@pytest.mark.parametrize("mtp", [False, True], ids=["moe", "moe-mtp"])
def test_combined_1f1b_two_micro_batches_moe(megatron_tp1, seed, mtp):
    """MoE layers (all-gather dispatcher: the all-to-all one needs CUDA) with and without an MTP layer
    (megatron-core's plan runs MTP only with MoE layers), streams as no-ops: the same schedule code as the
    overlapped GPU run (test_megatron_schedule_gpu.py), one stream."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(moe_experts=4, moe_dispatcher="allgather", mtp=mtp, seed=seed, vocab=1031).train()
    with env.cpu_streams():
        check_two_micro_batches(model, gen, b=2, s=10)


@pytest.mark.parametrize("kind", ["untied", "tied-mup"])
def test_schedule_plan_without_labels_returns_the_plans_own_output(megatron_tp1, seed, kind):
    """labels=None (a rollout / inference forward) through build_fused_schedule_plan: the post-process node
    returns exactly what megatron-core's own plan returns without a processor (logits [b, s, V], MuP scaling
    included), with the same parameter gradients through the plan's backward; or, configured, the hidden
    states the node was given. No fused op runs, and the record says so."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    kw = dict(use_mup=True, mup_base_hidden_size=24) if kind == "tied-mup" else {}
    model = env.build_gpt(tied=kind != "untied", seed=seed, **kw)
    b, s = 2, 7
    ids, pos, _ = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    w = torch.randn(b, s, model.vocab_size, generator=gen)

    out, rec, got = plan_forward_backward(env, model, lambda o: w, input_ids=ids, position_ids=pos,
                                          attention_mask=mask, labels=None)
    assert rec.path == "schedule-plan" and rec.backend is None and "labels is None" in rec.reason, rec
    model.zero_grad(set_to_none=True)
    with env.cpu_streams():
        plan = model.build_schedule_plan(ids, pos, mask, labels=None)     # megatron-core's own plan
        want = Plan.run(plan, None)
        Plan.run(None, plan, b_grad=w)
    assert out.shape == (b, s, model.vocab_size) and torch.equal(out, want)
    for name, g in env.param_grads(model).items():
        assert (g is None) == (got[name] is None) and (g is None or torch.equal(g, got[name])), name

    with env.cpu_streams(), torch.no_grad():
        hidden = Plan.run(build_fused_schedule_plan(model, ids, pos, mask, labels=None,
                                                    without_labels="hidden_states"), None)
        at_node = Plan.run(model.build_schedule_plan(ids, pos, mask, labels=None,
                                                     output_processor=lambda **k: k["hidden_states"]), None)
    assert hidden.shape == (s, b, 48) and torch.equal(hidden, at_node)


def test_schedule_plan_refuses_a_hybrid_model(megatron_tp1, seed):
    """megatron-core 0.19's HybridModel has no build_schedule_plan: the schedule-plan path refuses it by name
    (its forward runs through the legacy patch instead)."""
    env = megatron_tp1
    model = env.build_hybrid(seed=seed)
    ids, pos, labels = env.random_batch(2, 5, model.vocab_size, torch.Generator().manual_seed(seed))
    assert not supports_schedule_plan_hook(model)
    with pytest.raises(FusedPathUnavailable, match="HybridModel.build_schedule_plan"):
        build_fused_schedule_plan(model, ids, pos, env.causal_mask(5), labels=labels)
