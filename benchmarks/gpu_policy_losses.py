"""Time every named policy loss on one CUDA GPU, in one process: a row per loss.

    PYTHONPATH=src python3 benchmarks/gpu_policy_losses.py [--shapes S,L] [--losses NAME,...] [--coupled] [--out DIR]

Shapes (bf16, H=4096, V=151936, about 12% of tokens unscored at the start of each sequence): S = 16
sequences x 1024 tokens, L = 4 x 8192. Per shape: the 4-GEMM cuBLAS floor (``GemmFloor``) before and after;
then per loss: fused_policy_loss forward+backward on the triton backend, policy_loss_reference (fused_logprobs
and autograd, four GEMMs), the fused loss's peak memory beyond the inputs less the gradient buffers, which
pass ran (one fused pass or the two-pass path), the fused loss's relative error against the reference path,
and Liger-Kernel's LigerFusedLinearGRPOLoss where it has the loss and is installed. Writes
DIR/gpu_policy_losses.json and a markdown table after each shape (a run cut off keeps what it did).
--dry-run: tiny shapes on the CPU (triton's interpreter, slow: a few minutes a shape):
a check of the script only, not a measurement. Results: benchmarks/results/gpu-policy-losses-2026-12-04.md.

--coupled: only the losses coupled within sequences (GSPO sequence and sequence-token, vespo, geo_mean, the
off-policy mask), no Liger, 5 timed calls each, at both shapes (about 2-3 minutes on one H100): whether the triton
pass's chunk, grown to the longest sequence within LOGITLESS_POLICY_WORKSPACE_MAX_BYTES, keeps them in one pass
at L (4 x 8192), and their time against the floor and peak memory over the gradients there (targets: <= 0.75x,
<= 2.5 GiB). With
--dry-run the workspace is set to one token tile and its bound to 1 GiB, so the tiny sequences exceed a chunk
and the grown chunk runs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from logitless.losses import PolicyLoss, fused_policy_loss, policy_loss_reference  # noqa: E402
from logitless.losses.policy import reads_rollout_logprobs  # noqa: E402
from logitless.tools.common import GemmFloor, markdown_table, peak_extra_bytes, time_cuda  # noqa: E402
from logitless.tools.machine import machine, versions  # noqa: E402

SHAPES = {"S": (16, 1024, 4096, 151936), "L": (4, 8192, 4096, 151936)}
DRY_SHAPES = {"S": (3, 24, 32, 263), "L": (2, 40, 32, 263)}
UNSCORED = 0.12
BASE = dict(clip_low=0.2, clip_high=0.28, loss_agg="token-mean")
# name -> (settings, Liger's loss_type when LigerFusedLinearGRPOLoss has this loss)
LOSSES = {
    "ppo-dual_clip-k3": (dict(dual_clip=3.0, kl_coef=0.01, kl_type="k3", entropy_coef=0.01), "bnpo"),
    "trl-grpo-k3_unclamped-bias_corrected": (dict(kl_coef=0.04, kl_type="k3_unclamped", kl_ratio=True,
                                                  loss_agg="seq-mean-token-mean"), "grpo"),
    "two_sided_delta": (dict(delta=1.5), None),
    "cispo": (dict(surrogate="cispo", clip_low=1.0, clip_high=4.0), None),
    "sapo": (dict(surrogate="sapo", loss_agg="seq-mean-token-mean"), None),
    "gpg": (dict(surrogate="gpg"), None),
    "dro": (dict(surrogate="dro", dro_beta=0.1), None),
    "dppo_tv": (dict(surrogate="dppo_tv", clip_low=0.02, clip_high=0.02), None),
    "dppo_kl": (dict(surrogate="dppo_kl", clip_low=0.02, clip_high=0.02), None),
    "rollout_is-token_truncate": (dict(rollout_is="token_truncate", rollout_is_max=2.0), None),
    "gspo-sequence": (dict(ratio_level="sequence", clip_low=3e-4, clip_high=4e-4,
                             loss_agg="seq-mean-token-mean"), None),
    "gspo-verl-sequence_token": (dict(ratio_level="sequence-token", clip_low=3e-4, clip_high=4e-4), None),
    "vespo": (dict(surrogate="vespo", loss_agg="token-sum"), None),
    "geo_mean": (dict(surrogate="geo_mean"), None),
    "off_policy_mask": (dict(off_policy_threshold=0.05), None),
    "entropy_quantile": (dict(entropy_quantile=0.2, entropy_coef=0.01), None),
    "clip_cov": (dict(surrogate="clip_cov", cov_ratio=2e-4), None),
    "kl_cov": (dict(surrogate="kl_cov", cov_ratio=2e-4), None),
}


def inputs(b, s, h, v, dev, dtype, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    hidden = torch.randn(b, s, h, device=dev, generator=g).to(dtype)
    weight = (torch.randn(v, h, device=dev, generator=g) * (4.0 / h ** 0.5)).to(dtype)
    labels = torch.randint(0, v, (b, s), device=dev, generator=g)
    labels[:, :int(UNSCORED * s)] = -100                   # the prompt
    adv = torch.randn(b, 1, device=dev, generator=g)
    with torch.no_grad():
        lp = policy_loss_reference(hidden, weight, labels, adv, backend="triton").logprobs
    noise = torch.randn((3, b, s), device=dev, generator=g) * 0.3
    return hidden, weight, labels, adv, lp + noise[0], lp + noise[1], lp + noise[2]


def which_pass(call):
    """Run ``call`` once, noting which custom op ran: ``logitless::fused_policy_loss`` is the one fused pass, the
    two-pass path runs ``fused_logprobs``' forward and backward ops (the profiler records each op by name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    ops = {e.name for e in prof.events()}
    return "one pass (3 GEMMs)" if "logitless::fused_policy_loss" in ops else "two-pass (4 GEMMs)"


def step(fn, x, settings, rollout_needed):
    hidden, weight, labels, adv, old, ref, rollout = x
    kw = dict(BASE, **settings)
    if rollout_needed:
        kw["rollout_logprobs"] = rollout

    def call():
        torch.manual_seed(0)           # clip_cov draws its tokens at random: the same draw in every call
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        out = fn(h, w, labels, adv, old, ref_logprobs=ref, backend="triton", **kw)
        out.loss.backward()
        return out.loss.detach(), h.grad, w.grad
    return call


def liger_step(x, loss_type, settings):
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError:
        return None
    hidden, weight, labels, adv, old, ref, _ = x
    loss = LigerFusedLinearGRPOLoss(beta=settings.get("kl_coef", 0.0), epsilon_low=0.2, epsilon_high=0.28,
                                    loss_type=loss_type, use_ref_model=settings.get("kl_coef", 0.0) != 0.0)
    mask = (labels != -100).long()
    ids = labels.clamp(min=0)

    def call():
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        out = loss(h, w, ids, mask, adv.squeeze(1), ref_per_token_logps=ref, old_per_token_logps=old)
        (out[0] if isinstance(out, tuple) else out).backward()
        return h.grad, w.grad
    return call


def run_shape(tag, shape, dev, dtype, names, dry, liger=True, reps=7):
    b, s, h, v = shape
    x = inputs(b, s, h, v, dev, dtype)
    warm, reps = (0, 1) if dry else (1, reps)     # the dry run checks the steps, in the interpreter: one call each
    floor = GemmFloor(x[0].reshape(-1, h), x[1])
    floor_ms = [time_cuda(floor.forward_backward, warm, reps, device=dev)[0]]
    print(tag, "4-GEMM floor (before)", floor_ms[0], flush=True)
    grad_bytes = (x[0].numel() + x[1].numel()) * x[0].element_size()   # d_hidden and d_weight, kept by the caller
    rows = {}
    for name in names:
        settings, liger_type = LOSSES[name]
        rollout = reads_rollout_logprobs(settings)
        fused, ref = step(fused_policy_loss, x, settings, rollout), step(policy_loss_reference, x, settings, rollout)
        path = which_pass(fused)
        fused_mem, got = peak_extra_bytes(fused, dev)
        ref_mem, want = peak_extra_bytes(ref, dev)
        row = {"coupling": coupling(settings), "pass": path, "fused_ms": time_cuda(fused, warm, reps, device=dev)[0],
               "reference_ms": time_cuda(ref, warm, reps, device=dev)[0], "fused_extra_bytes": fused_mem,
               "reference_extra_bytes": ref_mem,
               "loss_rel_vs_reference": abs(got[0].item() - want[0].item()) / max(abs(want[0].item()), 1e-30),
               "dw_rel_vs_reference": float((got[2].double() - want[2].double()).norm() / want[2].double().norm())}
        liger_call = liger_step(x, liger_type, settings) if liger and liger_type and not dry else None
        if liger_call is not None:
            # Liger compiles its loss per chunk with dynamic shapes; at a second shape in one process torch 2.11's
            # dynamo failed in its guards ("sources must not be empty"): reset it, and report a failure as one
            torch._dynamo.reset()
            try:
                row["liger_ms"] = time_cuda(liger_call, warm, reps, device=dev)[0]
            except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, not the end of the run
                row["liger_error"] = repr(exc)[:200]
        rows[name] = row
        print(tag, name, row, flush=True)
    floor_ms.append(time_cuda(floor.forward_backward, warm, reps, device=dev)[0])
    print(tag, "4-GEMM floor (after)", floor_ms[1], flush=True)
    floor.close()
    return {"shape": dict(b=b, s=s, H=h, V=v), "floor4_ms": floor_ms, "gradient_bytes": grad_bytes, "losses": rows}


def coupling(settings):
    """Which target of the issue a loss is held to, as the library classifies it (``TermSpec``): token-local
    (<= 0.75x the floor), sequence-coupled (<= 0.80x when sequences fit a chunk) or batch-coupled (no
    slower than the reference path)."""
    t = torch.zeros(1, 2)
    kw = dict(BASE, **settings)
    rollout = t if reads_rollout_logprobs(kw) else None     # given where nothing reads it: refused
    spec = PolicyLoss(advantages=t, old_logprobs=t, ref_logprobs=t, rollout_logprobs=rollout, **kw).term_spec()
    return "batch" if spec.coupled and not spec.sequence_coupled else "sequence" if spec.coupled else "token"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="S,L")
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--coupled", action="store_true", help="only the sequence-coupled losses, no Liger")
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    if a.coupled:
        a.losses = ",".join(n for n in LOSSES if coupling(LOSSES[n][0]) == "sequence")
        if a.dry_run:   # tiny sequences longer than a chunk of the smallest workspace: the grown chunk runs
            os.environ["LOGITLESS_POLICY_WORKSPACE_BYTES"] = "1"
            os.environ["LOGITLESS_POLICY_WORKSPACE_MAX_BYTES"] = str(1 << 30)
    dev = "cpu" if a.dry_run else "cuda"
    dtype = torch.float32 if a.dry_run else torch.bfloat16
    names = [n for n in a.losses.split(",") if n]
    unknown = [n for n in names if n not in LOSSES]
    if unknown:
        raise SystemExit(f"unknown losses {unknown}; known: {list(LOSSES)}")
    shapes = DRY_SHAPES if a.dry_run else SHAPES
    results = {"machine": machine(), "versions": versions(), "dry_run": a.dry_run, "shapes": {}}
    os.makedirs(a.out, exist_ok=True)
    for tag in a.shapes.split(","):      # the JSON and the table after each shape: a cut-off run keeps what it did
        res = results["shapes"][tag] = run_shape(tag, shapes[tag], dev, dtype, names, a.dry_run, liger=not a.coupled,
                                                 reps=5 if a.coupled else 7)
        name = "gpu_policy_losses_coupled.json" if a.coupled else "gpu_policy_losses.json"
        with open(os.path.join(a.out, name), "w") as f:
            json.dump(results, f, indent=1)
        print_table(tag, res)
        if a.coupled and not a.dry_run:
            floor = sum(res["floor4_ms"]) / len(res["floor4_ms"])
            for name, r in res["losses"].items():
                extra = r["fused_extra_bytes"]
                gib = None if extra is None else (extra - res["gradient_bytes"]) / 2**30
                ok = r["pass"].startswith("one") and r["fused_ms"] / floor <= 0.75 and (gib is None or gib <= 2.5)
                print(f"{tag} {name}: targets (one pass, <= 0.75x the floor, <= 2.5 GiB over gradients) "
                      f"{'met' if ok else 'NOT met'}", flush=True)


def print_table(tag, res):
    floor = sum(res["floor4_ms"]) / len(res["floor4_ms"])
    table = [[name, r["coupling"], r["pass"], f"{r['fused_ms']:.1f}", f"{r['fused_ms'] / floor:.2f}",
              f"{r['reference_ms']:.1f}", f"{r['fused_ms'] / r['reference_ms']:.2f}",
              f"{r['liger_ms']:.1f}" if "liger_ms" in r else "-",
              "-" if r["fused_extra_bytes"] is None else
              f"{(r['fused_extra_bytes'] - res['gradient_bytes']) / 2**30:.2f}"]
             for name, r in res["losses"].items()]
    print(f"\nshape {tag} {res['shape']}: 4-GEMM floor {floor:.1f} ms (mean of before and after)")
    print(markdown_table(["loss", "coupling", "pass", "fused ms", "x floor", "reference ms", "x reference",
                          "Liger ms", "GiB over gradients"], table), flush=True)


if __name__ == "__main__":
    main()
