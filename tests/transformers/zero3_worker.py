"""One rank of the two-process DeepSpeed ZeRO-3 check (deepspeed's CPU accelerator, gloo), spawned by
test_transformers_zero3.py. ZeRO-3 partitions every parameter (the head weight is a 0-element placeholder
between calls) and gathers a module's parameters in hooks around that module's call; logitless calls the head,
so it is gathered and its gradient partitioned as for the unfused head. Each rank scores its own batch; the
full gradients (``safe_get_full_grad``) are compared with the unsharded model's, averaged over the ranks."""
import copy
import datetime
import os
import traceback

import torch
import torch.distributed as dist

from ranks import finish

CASES = ["llama fused_forward", "llama fused_policy_loss", "gpt2 (tied) fused_forward", "gpt2 (tied) fused_policy_loss"]


def _engine(kind, seed):
    import deepspeed

    from test_transformers import tiny_model
    torch.manual_seed(seed)
    model = tiny_model(kind).train()
    plain = copy.deepcopy(model)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=cfg)
    head = model.get_output_embeddings().weight
    assert head.numel() == 0 and tuple(head.ds_shape) == (1031, 48)   # really partitioned
    return engine, plain


def _check(kind, policy, seed) -> str:
    from deepspeed.utils import safe_get_full_grad

    from logitless.transformers import fused_forward, fused_policy_loss
    from reference64 import rel_err
    from sharded_worker import _mean_over_ranks, _policy_inputs
    from test_transformers import expected_targets, grads_of, padded_batch, reference_from_logits
    from test_transformers_policy_loss import truth

    engine, plain = _engine(kind, seed)
    torch.manual_seed(seed + 1 + dist.get_rank())   # a different batch per rank
    ids, mask = padded_batch(3, 7, "left")
    temp = torch.rand(3) + 0.5
    targets = expected_targets(ids, mask)
    if policy:
        inputs = _policy_inputs(ids)
        out = fused_policy_loss(engine, ids, mask, temperature=temp, **inputs)
        engine.backward(out.loss)
        loss, _ = truth(plain, ids, mask, None, targets, temp[:, None].expand(ids.shape), inputs["advantages"],
                        inputs["old_logprobs"], inputs["ref_logprobs"], inputs["loss_agg"])
        err = abs(out.loss.item() - loss.item())
        ref = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    else:
        a, b = torch.randn(ids.shape), torch.randn(ids.shape)
        out = fused_forward(engine, ids, mask, temperature=temp)
        engine.backward((a * out.logprobs).sum() + (b * out.entropy).sum())
        logits = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
        lp, ent = reference_from_logits(logits, targets, temp)
        err = max(float((out.logprobs.detach().double() - lp.detach()).abs().max()),
                  float((out.entropy.detach().double() - ent.detach()).abs().max()))
        ref = grads_of(plain, lp, ent, a.double(), b.double())
    got = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}   # collectives, every rank
    ref = _mean_over_ranks(ref)
    assert err <= 2e-5, err
    assert sorted(n for n, g in got.items() if g is not None) == sorted(ref)
    worst = max(rel_err(got[n].view_as(g).double(), g.double()) for n, g in ref.items())
    assert worst <= 1e-4, worst
    return f"value err {err:.1e}, worst grad rel err {worst:.1e}"


def run(rank: int, init_file: str, seed: int, out_dir: str) -> None:
    os.environ["DS_ACCELERATOR"] = "cpu"   # before deepspeed is imported
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")   # adopts the group above
    results = {}
    try:
        for case in CASES:
            try:
                results[case] = [True, _check(case.split()[0], "policy" in case, seed)]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
