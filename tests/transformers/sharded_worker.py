"""One rank of the sharded-head checks (gloo, CPU), spawned by test_transformers_sharded.py. Every case of a
suite runs in one spawn (spawning is the slow part); each rank writes {case: [ok, message]} as JSON.

FSDP2 suite (2 ranks, each scoring its own batch, so the gradients FSDP2 reduce-scatters are a real average):
fused_forward, patch_model and fused_policy_loss on a model with ``fully_shard`` on each decoder layer and the
root, the head in the root unit or its own, tied embeddings, reshard_after_forward True / False, a bf16
MixedPrecisionPolicy (each also under inference_mode / no_grad: the values of the call with grad); against the
unsharded model (its logits in float64; the bf16 case against the unsharded model cast to bf16).
TP suite (2 or 3 ranks, the same batch everywhere): the head sharded over the vocabulary by parallelize_module's
ColwiseParallel (uneven shards), against the unsharded model; a Shard(1) head refused."""
import copy
import datetime
import os
import traceback

import torch
import torch.distributed as dist

from ranks import finish, refused

TOL_LP = TOL_ENT = 2e-5
TOL_GRAD = 1e-4
# (name, model kind, head layout, reshard_after_forward, bf16 mixed precision)
FSDP2 = [
    ("llama head in root unit", "llama", "root", True, False),
    ("llama head in own unit, reshard", "llama", "own", True, False),
    ("llama head in own unit, no reshard", "llama", "own", False, False),
    ("llama head in own unit, bf16 mixed precision", "llama", "own", True, True),
    ("llama head in root unit, bf16 mixed precision", "llama", "root", False, True),
    ("gpt2 tied head in root unit", "gpt2", "root", True, False),
    ("gpt2 tied embedding and head in their own unit, reshard", "gpt2", "tied unit", True, False),
    ("gpt2 tied embedding and head in their own unit, no reshard", "gpt2", "tied unit", False, False),
]
FSDP2_CASES = [c[0] for c in FSDP2]
TP_CASES = ["ColwiseParallel head", "RowwiseParallel head (Shard(1)): refused",
            "FSDP2 and ColwiseParallel both on the head: refused",
            "a head on a 2-D mesh (Replicate(), Shard(0)): refused"]


def _layers(model):
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _batch(seed):
    from test_transformers import padded_batch
    torch.manual_seed(seed)
    ids, mask = padded_batch(3, 7, "left")
    return ids, mask, torch.rand(3) + 0.5, torch.randn(ids.shape), torch.randn(ids.shape)


def _grads(model) -> dict:
    """{name: full gradient}; a DTensor gradient (FSDP2's reduced shard, a tensor-parallel shard) gathered."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _mean_over_ranks(grads: dict) -> dict:
    for g in grads.values():
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads


def _compare_grads(got: dict, want: dict, tol: float) -> float:
    from reference64 import rel_err
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    worst = 0.0
    for n, g in want.items():
        err = rel_err(got[n].view_as(g).double(), g.double())
        assert err <= tol, (n, err)
        worst = max(worst, err)
    return worst


def _policy_inputs(ids):
    from test_transformers_policy_loss import SPEC
    adv = torch.randn(ids.shape[0], 1)
    old = -torch.rand(ids.shape) * 3
    ref = (old + 0.3 * torch.randn(ids.shape)).clamp(max=0.0)
    return dict(advantages=adv, old_logprobs=old, ref_logprobs=ref, loss_agg="seq-mean-token-mean", **SPEC)


def _check_fsdp2(kind, layout, reshard, bf16, seed, mesh) -> str:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from logitless.transformers import fused_forward, fused_policy_loss, is_patched, patch_model, unpatch_model
    from test_transformers import expected_targets, grads_of, reference_from_logits, tiny_model
    from test_transformers_policy_loss import truth

    torch.manual_seed(seed)  # the same weights on every rank, as FSDP expects
    model = tiny_model(kind).train()
    plain = copy.deepcopy(model)
    kw = dict(mesh=mesh, reshard_after_forward=reshard)
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for p in plain.parameters():   # what FSDP2's policy casts: the parameters (not buffers, e.g. inv_freq)
            p.data = p.data.to(torch.bfloat16)
    for layer in _layers(model):
        fully_shard(layer, **kw)
    if layout == "own":
        fully_shard(model.lm_head, **kw)
    elif layout == "tied unit":   # FSDP2 wants tied parameters in one unit: fully_shard([embedding, head])
        fully_shard([model.get_input_embeddings(), model.lm_head], **kw)
    fully_shard(model, **kw)
    assert type(model.get_output_embeddings().weight).__name__ == "DTensor"
    ids, mask, temp, a, b = _batch(seed + 1 + dist.get_rank())  # a different batch per rank

    patch_model(model, temperature=temp)   # outside the forward the head weight is a DTensor shard: accepted
    unpatch_model(model)
    fused = fused_forward(model, ids, mask, temperature=temp)
    assert not is_patched(model) and fused.logprobs.dtype == torch.float32
    (a * fused.logprobs).sum().add((b * fused.entropy).sum()).backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)

    if bf16:   # the unsharded model in bf16, through the same fused op: FSDP2 must not change a number
        want = fused_forward(plain, ids, mask, temperature=temp)
        err_lp = float((fused.logprobs.detach() - want.logprobs.detach()).abs().max())
        err_ent = float((fused.entropy.detach() - want.entropy.detach()).abs().max())
        ref = grads_of(plain, want.logprobs, want.entropy, a, b)
        ref = {n: g.float() for n, g in ref.items()}
        tol, grad_tol = 1e-6, 2e-2
    else:
        logits = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
        ref_lp, ref_ent = reference_from_logits(logits, expected_targets(ids, mask), temp)
        err_lp = float((fused.logprobs.detach().double() - ref_lp.detach()).abs().max())
        err_ent = float((fused.entropy.detach().double() - ref_ent.detach()).abs().max())
        ref = grads_of(plain, ref_lp, ref_ent, a.double(), b.double())
        tol, grad_tol = TOL_LP, TOL_GRAD
    ref = _mean_over_ranks(ref)   # FSDP2 averages the ranks' gradients (a collective: before any assert)
    assert err_lp <= tol and err_ent <= tol, (err_lp, err_ent)
    worst = _compare_grads(got, ref, grad_tol)

    patch_model(model, temperature=temp)
    assert is_patched(model)
    out = model(input_ids=ids, attention_mask=mask)
    assert torch.equal(out.logprobs, fused.logprobs.detach()) and torch.equal(out.entropy, fused.entropy.detach())
    unpatch_model(model)
    model.zero_grad(set_to_none=True)
    with torch.inference_mode():   # how trainers score old log-probs: the head's unit gathered without autograd
        scored = fused_forward(model, ids, mask, temperature=temp)
    assert torch.equal(scored.logprobs, fused.logprobs.detach()) and torch.equal(scored.entropy, fused.entropy.detach())

    policy = _policy_inputs(ids)
    res = fused_policy_loss(model, ids, mask, temperature=temp, **policy)
    res.loss.backward()
    got = _grads(model)
    with torch.no_grad():          # the statistics only: the same loss and metrics
        stats = fused_policy_loss(model, ids, mask, temperature=temp, **policy)
    for s, r in zip(stats, res, strict=True):
        assert not s.requires_grad and torch.allclose(s, r.detach(), rtol=1e-6, atol=1e-7), (s, r)
    plain.zero_grad(set_to_none=True)
    targets = expected_targets(ids, mask)
    if bf16:
        want = fused_policy_loss(plain, ids, mask, temperature=temp, **policy)
        want.loss.backward()
        loss, loss_tol = want.loss.detach(), 1e-6
        ref = {n: p.grad.float() for n, p in plain.named_parameters() if p.grad is not None}
    else:
        loss, _ = truth(plain, ids, mask, None, targets, temp[:, None].expand(ids.shape), policy["advantages"],
                        policy["old_logprobs"],
                        policy["ref_logprobs"], policy["loss_agg"])
        loss_tol = 1e-5
        ref = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    ref = _mean_over_ranks(ref)
    assert abs(res.loss.item() - loss.item()) <= loss_tol, (res.loss.item(), loss.item())
    worst_pl = _compare_grads(got, ref, grad_tol)
    return (f"logprob err {err_lp:.1e}, entropy err {err_ent:.1e}, worst grad rel err {worst:.1e}; policy loss "
            f"{res.loss.item():.6f} vs {loss.item():.6f}, worst grad rel err {worst_pl:.1e}")


def _check_tp_colwise(seed, mesh) -> str:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from logitless.transformers import fused_forward, fused_policy_loss, patch_model, unpatch_model
    from test_transformers import V, expected_targets, grads_of, reference_from_logits, tiny_model
    from test_transformers_policy_loss import truth

    torch.manual_seed(seed)
    model = tiny_model("llama").train()
    plain = copy.deepcopy(model)
    parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    w = model.lm_head.weight
    world = dist.get_world_size()
    sizes = [len(c) for c in torch.arange(V).chunk(world)]   # uneven: V = 1031 is prime
    assert w.to_local().shape[0] == sizes[dist.get_rank()] and len(set(sizes)) > 1, sizes
    ids, mask, temp, a, b = _batch(seed + 1)   # tensor parallelism: the same batch on every rank

    fused = fused_forward(model, ids, mask, temperature=temp)
    (a * fused.logprobs).sum().add((b * fused.entropy).sum()).backward()
    got = _grads(model)
    model.zero_grad(set_to_none=True)
    logits = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, expected_targets(ids, mask), temp)
    err_lp = float((fused.logprobs.detach().double() - ref_lp.detach()).abs().max())
    err_ent = float((fused.entropy.detach().double() - ref_ent.detach()).abs().max())
    assert err_lp <= TOL_LP and err_ent <= TOL_ENT, (err_lp, err_ent)
    worst = _compare_grads(got, grads_of(plain, ref_lp, ref_ent, a.double(), b.double()), TOL_GRAD)

    patch_model(model, temperature=temp)
    out = model(input_ids=ids, attention_mask=mask)
    assert torch.equal(out.logprobs, fused.logprobs.detach())
    unpatch_model(model)

    policy = _policy_inputs(ids)
    res = fused_policy_loss(model, ids, mask, temperature=temp, **policy)
    res.loss.backward()
    got = _grads(model)
    plain.zero_grad(set_to_none=True)
    per_token = temp[:, None].expand(ids.shape)
    loss, _ = truth(plain, ids, mask, None, expected_targets(ids, mask), per_token, policy["advantages"],
                    policy["old_logprobs"], policy["ref_logprobs"], policy["loss_agg"])
    assert abs(res.loss.item() - loss.item()) <= 1e-5, (res.loss.item(), loss.item())
    worst_pl = _compare_grads(got, {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}, TOL_GRAD)
    return (f"shard rows {w.to_local().shape[0]}; logprob err {err_lp:.1e}, entropy err {err_ent:.1e}, worst grad "
            f"rel err {worst:.1e}; policy loss worst grad rel err {worst_pl:.1e}")


def _check_tp_rowwise_refused(seed, mesh) -> str:
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from logitless.transformers import fused_forward, patch_model
    from test_transformers import tiny_model
    torch.manual_seed(seed)
    model = tiny_model("llama").train()
    parallelize_module(model, mesh, {"lm_head": RowwiseParallel()})
    ids, mask, _, _, _ = _batch(seed + 1)
    refused([lambda: patch_model(model), lambda: fused_forward(model, ids, mask)], ("Shard(dim=1)", "ColwiseParallel"),
            "a head sharded over the hidden dimension")
    return "refused"


def _check_fsdp2_and_tp_refused(seed) -> str:
    """A (dp=1, tp=W) mesh: the head vocabulary-sharded over tp, then fully_shard over dp: inside the root unit's
    forward the head weight is still a tensor-parallel DTensor, which logitless does not combine with FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from logitless.transformers import fused_forward
    from test_transformers import tiny_model
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = tiny_model("llama").train()
    parallelize_module(model, mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    fully_shard(model, mesh=mesh["dp"])
    ids, mask, _, _, _ = _batch(seed + 1)
    message = refused([lambda: fused_forward(model, ids, mask)], ("tensor parallelism", "Shard(dim=0)"),
                      "FSDP2 + tensor parallelism on the head")
    return f"refused: {message}"


def _check_2d_mesh_refused(seed) -> str:
    """A vocabulary shard on a (1, W) mesh, replicated over the first dimension: not the 1-D layout logitless
    computes (a per-rank copy's gradient would stay unreduced), refused naming the placements and the submesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from logitless.transformers import fused_forward, patch_model
    from test_transformers import tiny_model
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(seed)
    model = tiny_model("llama").train()
    weight = distribute_tensor(model.lm_head.weight.detach(), mesh, [Replicate(), Shard(0)])
    model.lm_head.weight = torch.nn.Parameter(weight)
    ids, mask, _, _, _ = _batch(seed + 1)
    refused([lambda: patch_model(model), lambda: fused_forward(model, ids, mask)],
            ("(Replicate(), Shard(dim=0))", "mesh['tp']"), "a head on a 2-D mesh")
    return "refused"


def run(rank: int, world: int, suite: str, init_file: str, seed: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))   # a rank stuck in a collective fails
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    try:
        only = os.environ.get("SHARDED_CASES")   # a ;-separated subset, to run a few by hand
        if suite == "fsdp2":
            cases = FSDP2_CASES
            checks = [lambda c=c: _check_fsdp2(*c[1:], seed, mesh) for c in FSDP2]
        else:
            cases = TP_CASES
            checks = [lambda: _check_tp_colwise(seed, mesh), lambda: _check_tp_rowwise_refused(seed, mesh),
                      lambda: _check_fsdp2_and_tp_refused(seed), lambda: _check_2d_mesh_refused(seed)]
        for case, check in zip(cases, checks, strict=True):
            if only and case not in only.split(";"):
                continue
            try:
                results[case] = [True, check()]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)
