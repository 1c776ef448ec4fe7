"""verl's Ulysses sequence parallelism on CPU: the attention it needs, and one rank of the two-process check
(test_verl_ulysses.py).

verl's FSDP engine with ``ulysses_sequence_parallel_size`` > 1 (remove-padding only) slices each packed
micro-batch along the sequence across the sp group, and gathers the per-token outputs back before the loss
(``gather_outputs_and_unpad``, whose backward scales by the sp size). For a text model its Ulysses attention is
a patch of transformers' *flash-attention* path (``_ulysses_flash_attention_forward``: all-to-all from
sequence-sharded to head-sharded, flash-attention varlen, all-to-all back), which needs the CUDA flash_attn
package; with eager or sdpa attention the all-to-all never runs and each rank attends within its own slice.
``ulysses_attention`` is that same attention for CPU, registered with transformers as "ulysses_cpu": verl's
own all-to-alls (``gather_seq_scatter_heads`` / ``gather_heads_scatter_seq``, which gloo runs), and exact
causal attention within the packed sequences (a sequence starts where the position id is 0). Everything else
is verl's engine as it runs on the GPU.
"""
from __future__ import annotations

import datetime
import traceback

import torch
import torch.distributed as dist

from ranks import finish

NAME = "ulysses_cpu"
FSDP1 = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp"]


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                      **kwargs):
    """transformers' attention interface (query [b, heads, s_local, d], key / value [b, kv heads, s_local, d]);
    returns [b, s_local, heads, d]. verl's _ulysses_flash_attention_forward with a float64 softmax in place
    of flash-attention."""
    from verl.models.transformers.monkey_patch import repeat_kv
    from verl.utils.ulysses import (
        gather_heads_scatter_seq,
        gather_seq_scatter_heads,
        get_ulysses_sequence_parallel_group,
        get_ulysses_sequence_parallel_world_size,
    )
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))          # [b, s, h, d], verl's layout
    sp = get_ulysses_sequence_parallel_world_size()
    if sp > 1:
        repeats = max(sp // k.size(2), 1)
        k, v = repeat_kv(k, repeats), repeat_kv(v, repeats)
        q, k, v = (gather_seq_scatter_heads(t, seq_dim=1, head_dim=2) for t in (q, k, v))
        parts = [torch.empty_like(position_ids) for _ in range(sp)]
        dist.all_gather(parts, position_ids, group=get_ulysses_sequence_parallel_group())
        position_ids = torch.cat(parts, dim=-1)
    k, v = repeat_kv(k, q.size(2) // k.size(2)), repeat_kv(v, q.size(2) // v.size(2))
    s = q.size(1)
    seq = (position_ids == 0).cumsum(-1)                                 # [b, s] packed sequence ids
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    allowed = causal & (seq[:, :, None] == seq[:, None, :])              # [b, s, s]
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * (scaling or q.size(-1) ** -0.5)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double()).to(q.dtype)
    if sp > 1:
        out = gather_heads_scatter_seq(out, seq_dim=1, head_dim=2)
    return out, None


def register() -> None:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    from transformers import AttentionInterface
    AttentionInterface.register(NAME, ulysses_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, lambda *args, **kwargs: None)   # it builds its own mask


def run(rank: int, init_file: str, model_dir: str, cases, out_dir: str) -> None:
    """Each case: (name, actor overrides, engine settings, seed); per case the unfused update (verl's loss) and
    the fused one on the sp=2 engine (a name starting "triton": on verl's "triton" fused-kernel backend;
    "untied": an untied head, against verl's logits path; "fsdp1": strategy fsdp; "distill": verl's top-k
    distillation with the case's distillation settings, against verl's logits path), both ranks writing their
    parameters' norms of difference and metrics."""
    import os
    torch.set_num_threads(1)
    # verl's Worker reads the launcher's variables (the group itself is initialised from init_file)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    results = {}
    try:
        import verl_engine as ve
        ve.setup()
        register()
        import logitless.verl as lv
        built = ["actor_rollout_ref.model.use_fused_kernels=True",
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                 "actor_rollout_ref.model.use_remove_padding=True",
                 f"actor_rollout_ref.model.override_config.attn_implementation={NAME}"]
        actor = ve.Actor(model_dir, built)
        # a case named "triton...": the fused run on verl's "triton" fused-kernel backend (the kernel site)
        triton = (ve.Actor(model_dir, [*built, "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"])
                  if any(c[0].startswith("triton") for c in cases) else None)
        # a case named "untied...": the untied model in model_dir/untied, whose lm_head FSDP2 shards as a unit of
        # its own; verl's own fused head fails on it, so the reference is verl's logits path (no fused kernels)
        untied = None
        if any(c[0].startswith("untied") for c in cases):
            untied = (ve.Actor(f"{model_dir}/untied", built[1:]), ve.Actor(f"{model_dir}/untied", built))
        # a case named "fsdp1...": strategy fsdp (FSDP1 over both ranks, verl_engine.cpu_fsdp1)
        fsdp1 = (ve.Actor(model_dir, [*built, *FSDP1]) if any(c[0].startswith("fsdp1") for c in cases) else None)
        # a case named "distill...": verl's top-k distillation, against verl's logits path (its fused kernels have
        # no top-k distillation) on the sp=2 engine without fused kernels
        logits = ve.Actor(model_dir, built[1:]) if any(c[0].startswith("distill") for c in cases) else None
        for name, overrides, engine, seed in cases:
            try:
                reference, fused = untied if name.startswith("untied") else (actor, actor)
                if name.startswith("fsdp1"):
                    reference = fused = fsdp1
                fused = triton if name.startswith("triton") else fused
                gen = torch.Generator().manual_seed(seed)
                if name.startswith("distill"):
                    reference = logits
                    tensors, meta = ve.teacher_batch(gen, model_dir, topk=True)
                    overrides = ve.distillation_enabled(model_dir, "forward_kl_topk", *overrides)
                else:
                    tensors, meta = ve.rollout_batch(gen, reference.model_dir, is_weights=True)
                want = reference.update(tensors, meta, overrides, calculate_entropy=True, mini_batch_size=6,
                                        engine=engine)
                if rank == 0:
                    torch.save(want[1], f"{out_dir}/{name}.pt")      # for the single-rank comparison
                lv.install(fused_loss=True, strict=True)
                try:
                    got = fused.update(tensors, meta, overrides, calculate_entropy=True, mini_batch_size=6,
                                       engine=engine)
                    rec = lv.last_path()
                finally:
                    lv.uninstall()
                results[name] = [True, {**summary(reference, got, want, rec), "forward": fused.forward.__name__,
                                        "module": type(fused.worker.engine.module).__name__}]
            except Exception:  # recorded per case, so one failure does not hide the others
                results[name] = [False, traceback.format_exc()[-3000:]]
    except Exception:
        results["setup"] = [False, traceback.format_exc()[-3000:]]
    finally:
        finish(results, out_dir, rank)


def summary(actor, got, want, rec) -> dict:
    """What the test compares, as JSON: per parameter the norms of the step and of the difference; the
    metrics of both runs; the fused run's record."""
    (m_got, p_got), (m_want, p_want) = got, want
    initial = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in actor.initial]
    params = {}
    for (n, p), p0 in zip(p_want.items(), initial, strict=True):
        step = p - p0
        params[n] = {"norm": float(p.norm()), "diff": float((p_got[n] - p).norm()), "step": float(step.norm()),
                     "step_diff": float(((p_got[n] - p0) - step).norm())}

    def plain(metrics):
        if metrics is None:          # a rank that does not collect the output
            return None
        return {k: [float(x) for x in (v if isinstance(v, list) else [v])] for k, v in metrics.items()}
    return {"params": params, "got": plain(m_got), "want": plain(m_want),
            "record": [rec.path, rec.entry, rec.reason, rec.backend]}
