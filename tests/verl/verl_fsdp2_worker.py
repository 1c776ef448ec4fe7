"""One rank of the two-process check of verl's FSDP2 fused forward (gloo, CPU), spawned by
test_verl_fsdp2.py: a tiny untied Qwen2 wrapped by verl's own ``apply_fsdp2`` (each decoder layer, the
embedding and lm_head in their own units, then the root) and patched by verl's ``patch_forward_with_backends``.
Without logitless verl's fused head fails on the sharded head weight; with ``logitless.verl.install()`` it runs,
and its values and the gradients FSDP2 reduces equal verl's unfused path on the unsharded model."""
import copy
import datetime
import traceback

import torch
import torch.distributed as dist

from ranks import finish

CASES = ["verl's own fused head fails on the sharded lm_head", "backend torch", "backend triton"]
TEMPERATURE = 0.8
ORIGINAL = {}   # transformers' own Qwen2ForCausalLM.forward (verl patches the class)


def _models(seed, mesh, backend, reshard=True):
    from test_verl_fsdp import tiny_qwen2
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.utils.fsdp_utils import apply_fsdp2
    model = tiny_qwen2(seed).train()
    plain = copy.deepcopy(model)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    apply_fsdp2(model, {"mesh": mesh, "reshard_after_forward": reshard}, {})
    assert type(model.lm_head.weight).__name__ == "DTensor" and type(model.lm_head).__name__.startswith("FSDP")
    return model, plain


def _batch(seed):
    from test_verl_fsdp import batch
    gen = torch.Generator().manual_seed(seed)
    ids, mask, pos = batch(gen)
    return ids, mask, pos, torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)


def _own_fused_head_fails(seed, mesh) -> str:
    import logitless.verl as lv
    lv.uninstall()
    model, _ = _models(seed, mesh, "torch")
    ids, mask, pos, _, _ = _batch(seed + 1)
    try:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, temperature=TEMPERATURE, return_dict=True)
    except Exception as e:   # noqa: BLE001 - whatever verl raises; the message is checked
        assert "DTensor" in str(e), str(e)
        return f"{type(e).__name__}: {str(e)[:120]}"
    raise AssertionError("verl's own fused head ran on the sharded lm_head (the premise of this check is gone)")


def _check(backend, seed, mesh) -> str:
    from verl.utils import torch_functional as verl_F

    import logitless.verl as lv
    from reference64 import rel_err
    lv.install()
    try:
        model, plain = _models(seed, mesh, backend)
        ids, mask, pos, a, c = _batch(seed + 1 + dist.get_rank())   # a different batch per rank
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, temperature=TEMPERATURE, return_dict=True)
        lp, ent = out.log_probs.view(ids.shape), out.entropy.view(ids.shape)
        ((a * lp).sum() + (c * ent.float()).sum()).backward()
        got = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        lv.uninstall()
    logits = ORIGINAL["forward"](plain, input_ids=ids, attention_mask=mask, position_ids=pos).logits / TEMPERATURE
    labels = torch.roll(ids, -1, dims=-1)
    lp_r, ent_r = verl_F.logprobs_from_logits(logits, labels), verl_F.entropy_from_logits(logits)
    ((a * lp_r).sum() + (c * ent_r).sum()).backward()
    ref = {n: p.grad.clone() for n, p in plain.named_parameters() if p.grad is not None}
    for g in ref.values():   # FSDP2 averages the ranks' gradients
        dist.all_reduce(g)
        g /= dist.get_world_size()
    err = max(float((lp - lp_r).abs().max()), float((ent.float() - ent_r).abs().max()))
    assert err <= 2e-5, err
    assert sorted(got) == sorted(ref)
    worst = max(rel_err(got[n], g) for n, g in ref.items())
    assert worst <= 1e-4, worst
    return f"value err {err:.1e}, worst grad rel err {worst:.1e}"


def run(rank: int, init_file: str, seed: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from transformers import Qwen2ForCausalLM
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2,))
    cls_forward = ORIGINAL["forward"] = Qwen2ForCausalLM.forward
    results = {}
    checks = [lambda: _own_fused_head_fails(seed, mesh), lambda: _check("torch", seed, mesh),
              lambda: _check("triton", seed, mesh)]
    try:
        for case, check in zip(CASES, checks, strict=True):
            try:
                results[case] = [True, check()]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[case] = [False, traceback.format_exc()[-3000:]]
            finally:
                Qwen2ForCausalLM.forward = cls_forward   # verl patches the class: give it back
    finally:
        finish(results, out_dir, rank)
