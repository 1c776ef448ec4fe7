"""Accuracy of the fused ops under torch.autocast on CUDA with the triton backend, against float64 of the
operands autocast makes (F.linear's contract: both cast to the autocast dtype), and the compiled
fused_policy_loss against eager. Prints one line per case; summary in benchmarks/results/gpu-contexts-*.md.

    PYTHONPATH=src python benchmarks/gpu_contexts.py [N H V]
"""
from __future__ import annotations

import math
import os
import sys

import torch

from logitless import fused_logprobs, last_backend
from logitless.losses import fused_policy_loss

# LOGITLESS_CONTEXTS_DEVICE=cpu (with TRITON_INTERPRET=1 and small shapes) tries this script without a GPU
DEVICE = os.environ.get("LOGITLESS_CONTEXTS_DEVICE", "cuda")


def inputs(n, h, v, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(n, h, device=DEVICE, generator=g)
    weight = torch.randn(v, h, device=DEVICE, generator=g) * (4.0 / math.sqrt(h))
    with torch.no_grad():
        probs = torch.softmax(hidden.double() @ weight.double().t(), dim=-1)
        labels = torch.multinomial(probs, 1, generator=g).squeeze(1)
        lp = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1).gather(1, labels[:, None])[:, 0]
    labels[: n // 8] = -100
    adv = torch.randn(n, device=DEVICE, generator=g)
    old = (lp + 0.3 * torch.randn(n, device=DEVICE, generator=g, dtype=torch.float64)).float()
    return hidden, weight, labels, adv, old


def truth(hidden, weight, labels, adv, old, dtype):
    """float64 log-probs, entropies, policy loss (token-mean, clip 0.2 / 0.28) and d_hidden, d_weight of
    the operands autocast uses."""
    h = hidden.to(dtype).double().requires_grad_(True)
    w = weight.to(dtype).double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.t(), dim=-1)
    valid = labels != -100
    lp = torch.where(valid, logp.gather(1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(logp.exp() * logp).sum(1), 0.0)
    ratio = torch.exp(torch.clamp(lp - old.double(), -20, 20))
    a = adv.double()
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.28))
    loss = (pg * valid).sum() / valid.sum()
    dh, dw = torch.autograd.grad(loss, (h, w))
    return lp.detach(), ent.detach(), loss.detach(), dh, dw


def rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def main():
    n, h, v = (int(x) for x in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 2048, 32003)
    where = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"torch {torch.__version__}, {where}, N={n} H={h} V={v}")
    hidden, weight, labels, adv, old = inputs(n, h, v)
    for dtype in (torch.bfloat16, torch.float16):
        lp64, ent64, loss64, dh64, dw64 = truth(hidden, weight, labels, adv, old, dtype)
        name = str(dtype).split(".")[1]
        for operands in ("fp32 hidden + fp32 weight", "bf16 hidden + fp32 weight"):
            hid = hidden if operands.startswith("fp32") else hidden.bfloat16()
            if not operands.startswith("fp32") and dtype != torch.bfloat16:
                continue      # a bf16 hidden state cast to fp16 is another operand; the truth above is for bf16
            with torch.autocast(DEVICE, dtype=dtype):
                out = fused_logprobs(hid, weight, labels, backend="triton")
            print(f"fused_logprobs autocast {name} [{operands}] {last_backend()}: logprob max err "
                  f"{(out.logprobs - lp64).abs().max():.2e}, entropy max err {(out.entropy - ent64).abs().max():.2e}")
        with torch.autocast(DEVICE, dtype=dtype), torch.no_grad():    # the unfused path, for comparison
            logp = torch.log_softmax(torch.nn.functional.linear(hidden, weight).float(), dim=-1)
        unfused = logp.gather(1, labels.clamp_min(0)[:, None])[:, 0]
        del logp
        print(f"unfused F.linear + float32 log_softmax autocast {name}: logprob max err "
              f"{(unfused - lp64)[labels != -100].abs().max():.2e} (its logits are rounded to {name})")
        hh = hidden.clone().requires_grad_(True)
        ww = weight.clone().requires_grad_(True)
        with torch.autocast(DEVICE, dtype=dtype):
            out = fused_policy_loss(hh, ww, labels, adv, old, backend="triton")
        out.loss.backward()
        valid = labels != -100
        loss_err = abs(float(out.loss.detach()) - float(loss64))
        print(f"fused_policy_loss autocast {name} {last_backend()}: loss err {loss_err:.2e}, "
              f"logprob max err {(out.logprobs - lp64)[valid].abs().max():.2e}, d_hidden rel {rel(hh.grad, dh64):.2e}, "
              f"d_weight rel {rel(ww.grad, dw64):.2e}, grads {hh.grad.dtype}")
        del lp64, ent64, dh64, dw64

    # the compiled loss against eager, bf16 operands
    hb, wb = hidden.bfloat16(), weight.bfloat16()

    def step(h_, w_):
        o = fused_policy_loss(h_, w_, labels, adv, old)
        return o.loss, o.logprobs, o.entropy, o.clip_fraction

    results = []
    for fn in (step, torch.compile(step, fullgraph=True)):
        h_ = hb.clone().requires_grad_(True)
        w_ = wb.clone().requires_grad_(True)
        loss, *metrics = fn(h_, w_)
        loss.backward()
        results.append([loss.detach(), *metrics, h_.grad, w_.grad])
    diffs = [rel(c, e.double()) if e.norm() > 0 else float((c - e).abs().max()) for c, e in zip(*results[::-1],
                                                                                                strict=True)]
    print("compiled fused_policy_loss (fullgraph, triton) vs eager, relative differences "
          "(loss, logprobs, entropy, clip_fraction, d_hidden, d_weight): " + ", ".join(f"{d:.1e}" for d in diffs))


if __name__ == "__main__":
    main()
