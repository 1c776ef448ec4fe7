"""One rank of the two-process FSDP1 check (gloo, CPU), spawned by test_transformers_fsdp.py.
lm_head in its own unit (auto_wrap_policy on nn.Linear) is gathered by its unit's own call, as for the
unfused head; a tied embedding in its own unit is refused (it reshards before the head runs).
Every case runs in the one spawn (spawning is the slow part); each rank writes {case: [ok, message]}
as JSON. Each rank scores its own batch, so the gradients FSDP reduce-scatters are a real average."""
import copy
import traceback

import torch
import torch.distributed as dist

from ranks import finish, refused

# (model kind, use_orig_params, lm_head in its own unit): Llama's head is its own weight, GPT-2's is tied to
# the input embedding
THROUGH_FSDP = [("llama", False, False), ("llama", True, False), ("gpt2", False, False), ("gpt2", True, False),
                ("llama", True, True)]
CASES = [f"{kind} use_orig_params={orig}" + (", lm_head in its own unit" if own else "")
         for kind, orig, own in THROUGH_FSDP] + ["tied embedding in its own unit"]
TOL_LP = TOL_ENT = 2e-5
TOL_GRAD = 1e-4


def _full_grads(fsdp, use_orig_params: bool) -> dict:
    """{parameter name: full unsharded gradient} of an FSDP1 root."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    if use_orig_params:
        with FSDP.summon_full_params(fsdp, with_grads=True):
            return {n: p.grad.detach().clone() for n, p in fsdp.named_parameters() if p.grad is not None}
    out = {}
    for flat in fsdp.parameters():  # FlatParameters: each rank holds an equal shard of the flat gradient
        parts = [torch.empty_like(flat.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, flat.grad.detach().contiguous())
        full, at, names = torch.cat(parts), 0, iter(flat._fqns)
        for numel, padding in zip(flat._numels_with_padding, flat._is_padding_mask, strict=True):
            if not padding:
                out[next(names)] = full[at:at + numel]
            at += numel
    return out


def _check_through_fsdp(kind: str, use_orig_params: bool, own_unit: bool, seed: int) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from logitless.transformers import fused_forward, is_patched, patch_model, unpatch_model, unwrap_model
    from reference64 import rel_err
    from test_transformers import expected_targets, grads_of, padded_batch, reference_from_logits, tiny_model

    torch.manual_seed(seed)  # the same weights on both ranks, as FSDP expects
    model = tiny_model(kind).train()
    plain = copy.deepcopy(model)
    torch.manual_seed(seed + 1 + dist.get_rank())  # a different batch per rank
    ids, mask = padded_batch(3, 7, "left")
    temp = torch.rand(3) + 0.5
    a, b = torch.randn(ids.shape), torch.randn(ids.shape)

    fsdp = FSDP(model, device_id=torch.device("cpu"), use_orig_params=use_orig_params,
                auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}) if own_unit else None)
    if own_unit:
        assert isinstance(model.lm_head, FSDP)
    assert unwrap_model(fsdp) is model
    if use_orig_params and not own_unit:  # the module inside, outside FSDP's forward: its head weight is a flat shard
        refused([lambda: patch_model(model)], ("FSDP", "lm_head.weight"),
                "patching the module inside FSDP, with its head sharded,")
    fused = fused_forward(fsdp, ids, mask, temperature=temp)
    assert not is_patched(fsdp)
    (a * fused.logprobs).sum().add((b * fused.entropy).sum()).backward()
    got = _full_grads(fsdp, use_orig_params)

    logits = plain(input_ids=ids, attention_mask=mask, use_cache=False).logits
    ref_lp, ref_ent = reference_from_logits(logits, expected_targets(ids, mask), temp)
    err_lp = float((fused.logprobs.detach().double() - ref_lp.detach()).abs().max())
    err_ent = float((fused.entropy.detach().double() - ref_ent.detach()).abs().max())
    assert err_lp <= TOL_LP and err_ent <= TOL_ENT, (err_lp, err_ent)
    ref = grads_of(plain, ref_lp, ref_ent, a.double(), b.double())
    for g in ref.values():  # FSDP averages the ranks' gradients
        dist.all_reduce(g)
        g /= dist.get_world_size()
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    worst = max(rel_err(got[n].view_as(g), g) for n, g in ref.items())
    assert worst <= TOL_GRAD, worst

    patch_model(fsdp, temperature=temp)
    assert is_patched(fsdp) and "forward" not in vars(fsdp)  # FSDP's own forward keeps running
    out = fsdp(input_ids=ids, attention_mask=mask)
    assert torch.equal(out.logprobs, fused.logprobs) and torch.equal(out.entropy, fused.entropy)
    unpatch_model(fsdp)
    return f"logprob err {err_lp:.1e}, entropy err {err_ent:.1e}, worst grad rel err {worst:.1e}"


def _check_own_unit_refused(kind: str, wrapped: type, seed: int) -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from logitless.transformers import fused_forward, patch_model
    from test_transformers import tiny_model
    torch.manual_seed(seed)
    fsdp = FSDP(tiny_model(kind), device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({wrapped}))
    refused([lambda: fused_forward(fsdp, torch.randint(0, 1031, (2, 5))), lambda: patch_model(fsdp)],
            ("FSDP", "lm_head"), "a tied embedding in its own FSDP unit")
    return "refused"


def run(rank: int, init_file: str, seed: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    results = {}
    try:
        checks = [lambda k=kind, o=orig, u=own: _check_through_fsdp(k, o, u, seed) for kind, orig, own in THROUGH_FSDP]
        checks += [lambda: _check_own_unit_refused("gpt2", torch.nn.Embedding, seed)]  # lm_head stays in the root
        for case, check in zip(CASES, checks, strict=True):
            try:
                results[case] = [True, check()]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-2000:]]
    finally:
        finish(results, out_dir, rank)
