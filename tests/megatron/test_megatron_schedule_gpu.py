"""The schedule-plan path overlapped, on a GPU: megatron-core's combined 1F1B chunk schedule runs
micro-batch 2's forward together with micro-batch 1's backward on two CUDA streams (compute and
communication), for a MoE GPTModel (all-to-all dispatcher) with an MTP layer, logitless' processor in
the post-process node. Checked against the model's own logits (float64 log-softmax) through its forward:
both micro-batches' log-probs / entropy and every parameter gradient, and the path record.

Needs CUDA (the overlap needs streams); on CPU, test_megatron_schedule.py runs the plan without overlap.
"""
import os
import tempfile

import pytest
import torch

from required import import_or_skip

import_or_skip("megatron.core", "make setup installs megatron-core")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the overlapped 1F1B schedule needs CUDA streams")

LP_TOL = ENT_TOL = 5e-5
GRAD_TOL = 2e-4


@pytest.fixture(scope="module")
def megatron_gpu():
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    init = tempfile.mktemp(prefix="logitless_nccl_")
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    if os.path.exists(init):
        os.remove(init)


def build(seed, mtp):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import TransformerConfig
    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, hidden_dropout=0.0,
                            attention_dropout=0.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                            moe_token_dispatcher_type="alltoall",
                            mtp_num_layers=1 if mtp else None)
    spec = get_gpt_layer_local_spec(num_experts=4)
    kw = {"mtp_block_spec": get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)} if mtp else {}
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=1031, max_sequence_length=64, **kw).cuda()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "output_layer" in name or "word_embeddings" in name:
                p.mul_(25.0)
    return model


def grads(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


@pytest.mark.parametrize("mtp", [False, True], ids=["moe", "moe-mtp"])
def test_overlapped_schedule_plan_equals_the_models_logits(megatron_gpu, mtp):
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    from megatron.core.pipeline_parallel.utils import set_streams

    from logitless.megatron import last_path
    from logitless.megatron.mtp import disable_fused_mtp
    from logitless.megatron.schedule import build_fused_schedule_plan
    set_streams()
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    gen = torch.Generator().manual_seed(seed)
    model = build(seed, mtp).train()
    b, s, v = 2, 24, model.vocab_size
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device="cuda").triu(1)
    pos = torch.arange(s, device="cuda").expand(b, s)
    mbs = []
    for _ in range(2):
        ids = torch.randint(0, v, (b, s), generator=gen).cuda()
        labels = torch.randint(0, v, (b, s), generator=gen).cuda()
        temps = (0.5 + torch.rand(b, s, generator=gen)).cuda()
        w = (torch.randn(b, s, generator=gen).cuda(), torch.randn(b, s, generator=gen).cuda())
        mbs.append((ids, labels, temps, w))

    def plan(i):
        ids, labels, temps, _ = mbs[i]
        return build_fused_schedule_plan(model, ids, pos, mask, labels=labels, temperature=temps)

    model.zero_grad(set_to_none=True)
    p1 = plan(0)
    out1 = Plan.run(p1, None)                                  # micro-batch 1 forward
    p2 = plan(1)
    out2 = Plan.run(p2, p1, b_grad=mbs[0][3])                  # 2 forward overlapped with 1 backward
    rec = last_path()
    Plan.run(None, p2, b_grad=mbs[1][3])                       # 2 backward
    torch.cuda.synchronize()
    got = grads(model)
    assert rec.path == "schedule-plan" and rec.model == "GPTModel" and rec.backend is not None, rec

    disable_fused_mtp(model)              # the reference: the forward with megatron-core's own MTP loss
    model.zero_grad(set_to_none=True)
    total = 0
    worst = 0.0
    for (ids, labels, temps, (a, c)), out in zip(mbs, (out1, out2), strict=True):
        def logits_of(*, hidden_states, output_layer, output_weight, **_):
            return output_layer(hidden_states, weight=output_weight)[0].transpose(0, 1)
        z = model(ids, pos, mask, labels=labels, output_processor=logits_of).double() / temps.double()[..., None]
        logp = torch.log_softmax(z, -1)
        lp = logp.gather(-1, labels[..., None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        worst = max(worst, float((out[0].double() - lp).abs().max()), float((out[1].double() - ent).abs().max()))
        total = total + (a * lp).sum() + (c * ent).sum()
    total.backward()
    want = grads(model)
    assert worst <= LP_TOL, worst
    gworst = 0.0
    for name, g in want.items():
        assert (g is None) == (got[name] is None), name
        if g is not None and g.norm() > 0:
            err = float((got[name].double() - g.double()).norm() / g.double().norm())
            assert err <= GRAD_TOL, (name, err)
            gworst = max(gworst, err)
    if mtp:
        assert all(got[n] is not None and got[n].norm() > 0 for n in got if n.startswith("mtp."))
    print(f"schedule-plan overlapped ({'moe+mtp' if mtp else 'moe'}): max |d logprob/entropy| {worst:.2e}, "
          f"max grad rel err {gworst:.2e}")
