"""FSDP2 on one CUDA rank (NCCL, world size 1) with the triton backend, against the unsharded model.

A Llama-style transformers model (2 decoder layers, H=512, V=32003) wrapped with ``fully_shard`` on each decoder
layer, on lm_head (its own unit, reshard_after_forward=True) and on the root: ``fused_forward`` and
``fused_policy_loss`` against the unsharded copy -- log-probs / entropy against the copy's own float32 logits in
float64, gradients against the copy's -- in float32, and with a bf16 MixedPrecisionPolicy against the unsharded
copy with bf16 parameters through the same fused op. Without transformers on the machine, the same layout on a
small pure-torch model through ``logitless.sharded_head.call_head``. Writes a JSON summary to $OUT (or prints it).

    python benchmarks/gpu_fsdp2_check.py
"""
from __future__ import annotations

import copy
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import logitless  # noqa: E402

# LOGITLESS_CHECK_DEVICE=cpu runs the same on CPU over gloo, smaller (a smoke test of this script)
DEV = os.environ.get("LOGITLESS_CHECK_DEVICE", "cuda")
V, H, B, S = (32003, 512, 4, 255) if DEV == "cuda" else (1031, 48, 2, 17)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def full_grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach()
            for n, p in model.named_parameters() if p.grad is not None}


def shard(model, layers, head, mp=None):
    from torch.distributed.fsdp import fully_shard
    kw = {} if mp is None else {"mp_policy": mp}
    for layer in layers:
        fully_shard(layer, **kw)
    fully_shard(head, reshard_after_forward=True, **kw)
    fully_shard(model, **kw)


def transformers_case(bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import transformers as tf
    from logitless.transformers import fused_forward, fused_policy_loss
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2,
                         num_attention_heads=8 if H % 8 == 0 else 4, num_key_value_heads=4, max_position_embeddings=512)
    model = tf.LlamaForCausalLM(cfg).to(DEV).train()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.05)
    plain = copy.deepcopy(model)
    mp = None
    if bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for p in plain.parameters():
            p.data = p.data.to(torch.bfloat16)
    shard(model, model.model.layers, model.lm_head, mp)
    ids = torch.randint(0, V, (B, S), device=DEV)
    temp = 0.8
    out = fused_forward(model, ids, temperature=temp)
    backend = logitless.last_backend()
    a = torch.randn(B, S, device=DEV)
    (a * out.logprobs).sum().add(out.entropy.sum()).backward()
    got = full_grads(model)
    if bf16:
        ref = fused_forward(plain, ids, temperature=temp)
        ref_lp, ref_ent = ref.logprobs, ref.entropy
    else:
        logits = plain(input_ids=ids, use_cache=False).logits.double() / temp
        logp = torch.log_softmax(logits, -1)
        tgt = torch.full_like(ids, -100)
        tgt[:, :-1] = ids[:, 1:]
        valid = tgt != -100
        ref_lp = torch.where(valid, logp.gather(-1, tgt.clamp(min=0)[..., None])[..., 0], 0.0)
        ref_ent = torch.where(valid, -(logp.exp() * logp).sum(-1), 0.0)
    (a.to(ref_lp.dtype) * ref_lp).sum().add(ref_ent.sum()).backward()
    want = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    res = dict(backend=backend, logprob_max_abs_err=float((out.logprobs.double() - ref_lp.double()).abs().max()),
               entropy_max_abs_err=float((out.entropy.double() - ref_ent.double()).abs().max()),
               worst_grad_rel_err=max(rel(got[n], g) for n, g in want.items()), n_grads=len(want))
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    adv = torch.randn(B, 1, device=DEV)
    old = out.logprobs.detach() + 0.1 * torch.randn(B, S, device=DEV)
    pl = fused_policy_loss(model, ids, temperature=temp, advantages=adv, old_logprobs=old)
    pl.loss.backward()
    got = full_grads(model)
    pl_ref = fused_policy_loss(plain, ids, temperature=temp, advantages=adv, old_logprobs=old)
    pl_ref.loss.backward()
    want = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    res.update(policy_backend=logitless.last_backend(), policy_loss=pl.loss.item(),
               policy_loss_unsharded=pl_ref.loss.item(),
               policy_worst_grad_rel_err=max(rel(got[n], g) for n, g in want.items()))
    return res


def torch_case():
    """The same layout on a pure-torch model (no transformers here): the head called through call_head."""
    from logitless.sharded_head import call_head

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, H)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(2))
            self.head = torch.nn.Linear(H, V, bias=False)

        def forward(self, ids, labels):
            h = self.embed(ids)
            for layer in self.layers:
                h = torch.tanh(layer(h))
            h = h.reshape(-1, H)

            def compute(x, w, group):
                r = logitless.fused_logprobs(x, w, labels.reshape(-1), tp_group=group)
                return r.logprobs, r.entropy
            return call_head(self.head, h, compute, owner=self)

    torch.manual_seed(0)
    model = Tiny().to(DEV)
    plain = copy.deepcopy(model)
    shard(model, model.layers, model.head)
    ids = torch.randint(0, V, (B, S), device=DEV)
    labels = torch.randint(0, V, (B, S), device=DEV)
    lp, ent = model(ids, labels)
    backend = logitless.last_backend()
    lp.sum().add(ent.sum()).backward()
    got = full_grads(model)
    lp_r, ent_r = plain(ids, labels)
    lp_r.sum().add(ent_r.sum()).backward()
    want = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    return dict(backend=backend, logprob_max_abs_err=float((lp - lp_r).abs().max()),
                entropy_max_abs_err=float((ent - ent_r).abs().max()),
                worst_grad_rel_err=max(rel(got[n], g) for n, g in want.items()))


def main():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29571")
    dist.init_process_group("nccl" if DEV == "cuda" else "gloo", rank=0, world_size=1)
    if DEV == "cuda":
        torch.cuda.set_device(0)
    summary = dict(device=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", torch=torch.__version__,
                   python=platform.python_version())
    try:
        import triton
        summary["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers
        summary["transformers"] = transformers.__version__
        summary["fp32"] = transformers_case(False)
        summary["bf16_mixed_precision"] = transformers_case(True)
    except ImportError:
        summary["transformers"] = None
        summary["pure_torch"] = torch_case()
    dist.destroy_process_group()
    text = json.dumps(summary, indent=2)
    print(text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "fsdp2_check.json"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
