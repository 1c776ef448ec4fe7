"""verl 0.9.1's actor update at V=151936 on one CUDA GPU, in one process: logitless' fused loss against verl's own
fused kernel and verl unfused, times and peak memory.

    PYTHONPATH=src:wheels python3 benchmarks/gpu_verl_actor.py --out DIR      (--dry-run: tiny shapes on the CPU)

Each variant is verl's real actor update (``TrainingWorker.train_mini_batch`` -> ``FSDPEngineWithLMHead`` on FSDP2,
one rank, NCCL; tests/verl/verl_engine.py builds it as verl's ``ActorRolloutRefWorker.init_model`` does) of a
2-layer Qwen2 (H=1024, untied head, V=151936, float32 parameters, SGD), one mini-batch of 6 sequences (prompt 64,
response 1024 tokens, micro-batches of 2, remove-padding on: verl's "triton" backend returns flat log-probs,
which its padded path cannot take, with verl's own kernel as with logitless'; eager attention, no flash-attn),
vanilla PPO (dual clip) with a low_var_kl KL loss
and an entropy bonus, token-mean:
  verl-unfused         use_fused_kernels=False: the model's logits, verl's log-softmax / entropy, ppo_loss
  verl-fused-torch     use_fused_kernels=True, impl_backend "torch" (verl's FusedLinearForPPO, chunked torch)
  verl-fused-triton    use_fused_kernels=True, impl_backend "triton" (verl's own Triton linear_cross_entropy)
  logitless            logitless.verl.install(fused_loss=True) on the "triton" actor: the whole loss fused
Per variant: the median (min, max) of 5 timed updates after 2 warm-ups (CUDA events), the peak memory allocated
during one update above what was allocated before it, and the step against verl-unfused's: per parameter tensor
|p - p_unfused| / |p_unfused - p_initial| (how far the step lands from unfused's, relative to the step), the
largest over the tensors. Writes DIR/gpu_verl_actor.json and .md; prints a table last. About a minute on one H100.

The GPU machine has torch, triton and transformers but not verl. verl's actor import chain
(``verl.workers.engine_workers``, ``verl.workers.engine.fsdp.transformer_impl``, ``verl.workers.utils.losses``;
the config through hydra) needs these wheels beyond them, checked on CPU by blocking each module in turn: every
one below is imported unconditionally on that chain (hydra by the config composition), while megatron-core,
einops and msgpack may be absent:
  verl==0.9.1 (py3-none-any, installed with --no-deps), ray==2.60.0 (cp312 manylinux x86_64; verl/__init__ ->
  verl/protocol.py and verl/single_controller/base/worker.py ``import ray`` at module level: unavoidable, about
  70 MB), tensordict==0.10.0 (cp312 manylinux), pyvers==0.1.0, hydra-core==1.3.8, omegaconf==2.3.1,
  antlr4-python3-runtime==4.9.3, codetiming==1.4.0, peft==0.21.2, accelerate==1.16.0 (peft's), datasets==5.2.0 with
  pyarrow==26.0.1 (cp312 manylinux, about 40 MB), pandas==3.1.1 (cp312 manylinux), multiprocess==0.70.19,
  dill==0.4.1, xxhash==4.1.0 (cp312 manylinux), pydantic==2.14.4 with pydantic_core==2.50.5 (cp312 manylinux),
  typing-inspection==0.4.5, annotated-types==0.8.0, jsonschema==4.26.0 with jsonschema-specifications==2025.9.1,
  referencing==0.37.0, rpds-py==2026.9.1 (cp312 manylinux), orjson==3.13.0 (cp312 manylinux), psutil==7.2.2
  (cp312 manylinux), colorama==0.4.6, python-dateutil==4.0.0, requests==2.34.2, urllib3==2.8.0, protobuf==7.36.2.
  Versions: those of the CPU venv where this chain was checked (verl 0.9.1 pins none of them tightly). The
  total is far above 30 MiB: ray (~70 MB) and pyarrow (~40 MB, through datasets) alone exceed it, and both are
  imported unconditionally. uvicorn / fastapi (verl's rollout server module) are replaced by empty stand-ins when
  absent, as in the tests (the update never uses them).
Unpack the wheels into a directory (``pip install --no-deps --target wheels *.whl``) and put it on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "src"), os.path.join(HERE, "..", "tests", "verl"),
                os.path.join(HERE, "..", "tests")]
DRY = "--dry-run" in sys.argv
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from logitless.tools.common import markdown_table, time_cuda  # noqa: E402

P = "actor_rollout_ref.actor."
SHAPE = dict(vocab=151936, hidden=1024, layers=2, prompt=64, response=1024) if not DRY else \
    dict(vocab=263, hidden=40, layers=2, prompt=5, response=9)
LOSS = [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}kl_loss_coef=0.01", f"{P}entropy_coeff=0.01",
        f"{P}clip_ratio_c=3.0", f"{P}loss_agg_mode=token-mean"]
FUSED = "actor_rollout_ref.model.use_fused_kernels=True"
TRITON = "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"
VARIANTS = {"verl-unfused": [], "verl-fused-torch": [FUSED], "verl-fused-triton": [FUSED, TRITON],
            "logitless": [FUSED, TRITON]}
GIB = 1 << 30


def setup(device: torch.device) -> None:
    """verl on this device: the test harness's CPU platform and gloo group (dry run), or verl's own CUDA platform
    and a 1-rank NCCL group."""
    import verl_engine as ve
    if device.type == "cpu":
        ve.setup()
        return
    ve.stub_server_modules()
    # as the test harness does: verl's value-head patch imports trl's AutoModelForCausalLMWithValueHead, which trl
    # 1.16 no longer has (the H100 run of 2026-12-06 stopped there with trl installed); the actor never uses it
    import verl.models.transformers.monkey_patch as mp
    mp.is_trl_available = lambda: False
    import socket

    import torch.distributed as dist
    torch.cuda.set_device(0)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                          LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        dist.init_process_group("nccl", rank=0, world_size=1)
    ve._READY = True        # the harness's own setup (CPU platform, gloo) is not wanted here


def save_model(path: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=2 * SHAPE["hidden"],
                      num_hidden_layers=SHAPE["layers"], num_attention_heads=8 if not DRY else 4,
                      num_key_value_heads=4 if not DRY else 2, max_position_embeddings=4096,
                      tie_word_embeddings=False, attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 4.0 / SHAPE["hidden"] ** 0.5)     # logits of standard deviation ~4
    model.save_pretrained(path)


def batch(gen: torch.Generator, path: str, device: torch.device, b: int = 6):
    """A rollout batch as verl's trainer hands it to the actor (prompts left-padded, responses right-padded);
    old / ref log-probs the saved model's own plus noise of 0.3 (ratios inside and outside the clip range).

    Why the head is untied and the log-probs are the model's: with a tied head of logit std 4 at H=1024, each
    position's own input embedding dominates the last hidden state (its logit ~ 4 sqrt(H) = 128), the
    distribution is one-hot on it (entropy ~1e-8), every response token's log-prob is near -130, and old
    log-probs drawn near -12 made every ratio ~e^-120: the loss's gradient was ~1e-7 in norm and the
    parameters after the step compared rounding noise (the first H100 run: every fused variant 0.07-1.8 from
    unfused, each within float32 rounding of a near-zero update)."""
    prompt, response, vocab = SHAPE["prompt"], SHAPE["response"], SHAPE["vocab"]
    p_len = torch.randint(prompt // 2, prompt + 1, (b,), generator=gen)
    r_len = torch.randint(response // 2, response + 1, (b,), generator=gen)
    r_len[0] = response
    pmask = torch.arange(prompt)[None] >= prompt - p_len[:, None]
    rmask = torch.arange(response)[None] < r_len[:, None]
    prompts = torch.randint(1, vocab, (b, prompt), generator=gen).masked_fill(~pmask, 0)
    responses = torch.randint(1, vocab, (b, response), generator=gen).masked_fill(~rmask, 0)
    attention = torch.cat([pmask, rmask], 1).long()
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
               "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),
               "response_mask": rmask.long(), "advantages": torch.randn(b, response, generator=gen),
               "old_log_probs": None, "ref_log_prob": None}
    lp = current_logprobs(path, tensors, device)
    for key in ("old_log_probs", "ref_log_prob"):
        tensors[key] = (lp + 0.3 * torch.randn(b, response, generator=gen)).clamp(max=-1e-3)
    return tensors, {"temperature": 1.0}


def current_logprobs(path: str, tensors: dict, device: torch.device) -> torch.Tensor:
    """The saved model's log-probs of the response tokens [b, response] (plain transformers, float64
    log-softmax), a sequence at a time on ``device``."""
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(path, attn_implementation="eager").to(device)
    r = tensors["responses"].shape[1]
    rows = []
    with torch.no_grad():
        for i in range(tensors["input_ids"].shape[0]):
            ids = tensors["input_ids"][i:i + 1].to(device)
            logits = model(input_ids=ids, attention_mask=tensors["attention_mask"][i:i + 1].to(device),
                           position_ids=tensors["position_ids"][i:i + 1].to(device)).logits[0, -r - 1:-1]
            lp = torch.log_softmax(logits.double(), -1).gather(-1, ids[0, -r:, None]).squeeze(-1)
            rows.append(lp.float().cpu())
    return torch.stack(rows)


def run(args) -> dict:
    import verl_engine as ve
    device = torch.device("cpu" if DRY else "cuda")
    setup(device)
    ve.VOCAB = SHAPE["vocab"]
    tmp = tempfile.mkdtemp(prefix="verl_actor_")
    save_model(tmp)
    tensors, meta = batch(torch.Generator().manual_seed(1), tmp, device)
    results = {"shape": SHAPE, "tokens": int(tensors["attention_mask"].sum()),
               "scored": int(tensors["response_mask"].sum()), "variants": {}}
    params = {}
    for name, overrides in VARIANTS.items():
        if DRY and name == "verl-fused-triton":
            # verl's own Triton kernel is CUDA only (it opens an NVTX range first); logitless replaces it below
            results["variants"][name] = {"skipped": "CUDA only"}
            continue
        try:
            params[name] = _variant(name, overrides, device, tmp, tensors, meta, results)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a variant that fails is a result too; the others still run
            import traceback
            results["variants"][name] = {"error": traceback.format_exc()[-2000:]}
            print(traceback.format_exc(), flush=True)
    ref = params.get("verl-unfused")
    initial = _initial(tmp)
    for name, p in params.items():
        if ref is not None:
            # per parameter tensor: how far this variant's step lands from unfused's, relative to unfused's step
            results["variants"][name]["update_rel_diff_vs_unfused"] = max(
                float((p[k].double() - ref[k].double()).norm()
                      / (ref[k].double() - initial[k]).norm().clamp_min(1e-30)) for k in ref)
    if ref is not None:
        # the step's size: |p_unfused - p_initial| / |p_initial| over all parameters together
        step = sum(float((ref[k].double() - initial[k]).square().sum()) for k in ref)
        results["update_rel_size"] = (step / sum(float(initial[k].square().sum()) for k in ref)) ** 0.5
    return results


def _initial(path: str) -> dict:
    """The saved model's parameters by name (float64, CPU)."""
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(path, attn_implementation="eager")
    return {k: v.detach().double() for k, v in model.named_parameters()}


def _variant(name, overrides, device, tmp, tensors, meta, results):
    """One variant's actor built, timed and measured; returns its parameters after the step."""
    import verl_engine as ve

    import logitless.verl as lv
    t0 = time.perf_counter()
    actor = ve.Actor(tmp, overrides)
    if name == "logitless":
        lv.install(fused_loss=True, strict=True)
    try:
        def update():
            return actor.update(tensors, meta, LOSS, calculate_entropy=True, mini_batch_size=6,
                                engine={"use_remove_padding": True})
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        metrics, after = update()
        peak = (torch.cuda.max_memory_allocated() - base) if device.type == "cuda" else None
        med, lo, hi = time_cuda(update, warmup=1 if DRY else 2, reps=2 if DRY else 5, device=device)
        rec = lv.last_path()
    finally:
        lv.uninstall()
    results["variants"][name] = {
        "median_ms": med, "min_ms": lo, "max_ms": hi, "peak_extra_gib": None if peak is None else peak / GIB,
        "path": [rec.path, rec.entry, rec.backend] if name == "logitless" else None,
        "pg_loss": _first(metrics.get("actor/pg_loss")), "build_s": time.perf_counter() - t0}
    return after      # the actor (its model, optimizer and gradients) is freed with this frame


def _first(v):
    if v is None:
        return None
    return float(v[0] if isinstance(v, list) else v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    from logitless.tools.machine import machine, versions
    results = run(args)
    results["machine"], results["versions"] = machine(), versions()
    rows = [[name, f"{r['median_ms']:.1f}", f"{r['min_ms']:.1f}-{r['max_ms']:.1f}",
             "-" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}",
             f"{r.get('update_rel_diff_vs_unfused', float('nan')):.1e}"] if "median_ms" in r
            else [name, r.get("skipped") or "error (see JSON)", "-", "-", "-"]
            for name, r in results["variants"].items()]
    table = markdown_table(["variant", "update ms (median)", "min-max", "peak extra GiB", "step vs unfused's"], rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_verl_actor.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        with open(os.path.join(args.out, "gpu_verl_actor.md"), "w") as f:
            f.write(table)
    print(json.dumps({k: v for k, v in results.items() if k != "variants"}, default=str))
    for name, r in results["variants"].items():
        print(name, json.dumps({k: v for k, v in r.items() if k != "error"}, default=str),
              (r.get("error") or "")[-600:])
    print(table)


if __name__ == "__main__":
    main()
