"""The policy-loss rows of `logitless bench`: the fused PPO / GRPO loss (``fused_policy_loss``, three
GEMMs) and the same loss through ``fused_logprobs`` and autograd (``policy_loss_reference``, four), on the
bench's inputs and against the same GEMM floor.

The loss: clipped ratio (clip 0.2 / 0.28), k3 KL to a reference policy (coefficient 0.01), entropy bonus
(0.01), token-mean. A peer row computes it as TRL's GRPOTrainer does: its loss in torch on the log-probs and
entropies of its fused head (``trl_loss_fn``). Advantages are the bench's signed per-token ``a``; old and
reference log-probs are the current ones plus N(0, 0.1) noise (at most 0), so the ratio clips on both sides for
some tokens.

fwd = the loss without gradients (metrics only); fwd+bwd = the loss and its backward. Errors are against
``policy_loss_reference`` on the reference backend (fp32 logits) over the first ``check_tokens`` tokens:
log-prob and entropy max abs, gradients relative; the loss's relative error is in the note.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from .common import rel_err

SETTINGS = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.01, kl_type="k3", entropy_coef=0.01, loss_agg="token-mean")
NOISE = 0.1


@dataclass
class PolicyInputs:
    advantages: Tensor      # [N] float32
    old_logprobs: Tensor    # [N] float32
    ref_logprobs: Tensor    # [N] float32


def make_policy_inputs(x, temperature: float, seed: int) -> PolicyInputs:
    """Per-token PPO inputs for the bench inputs ``x`` (hidden, weight, labels, a, b)."""
    from logitless import fused_logprobs
    gen = torch.Generator(device=x.hidden.device).manual_seed(seed + 7)
    with torch.no_grad():
        lp = fused_logprobs(x.hidden, x.weight, x.labels, temperature=temperature, with_entropy=False).logprobs
    noise = torch.randn((2,) + tuple(lp.shape), device=lp.device, generator=gen) * NOISE
    # log-probabilities stay <= 0 (the loss refuses anything else): a near-certain token's noise is cut at 0
    return PolicyInputs(x.a, (lp + noise[0]).clamp(max=0.0), (lp + noise[1]).clamp(max=0.0))


@dataclass
class TrlOutput:
    """What the TRL row's loss returns, in PolicyLossOutput's names."""
    loss: Tensor
    logprobs: Tensor
    entropy: Tensor


def trl_loss_fn(device: torch.device) -> Callable:
    """The same loss as TRL's GRPOTrainer computes it (its ``_compute_loss``, loss_type "bnpo" (token-mean) with
    epsilon 0.2, epsilon_high 0.28, beta 0.01 without the KL's bias correction, entropy_coef 0.01), in torch, on
    the log-probs and entropies of TRL's fused head (``peers.trl_head``): TRL's k3 is unclamped, the settings'
    verl k3 clamped at |ref - lp| = 20, which these inputs (noise 0.1) never reach."""
    from .peers import trl_head
    head = trl_head(device)
    lo, hi = 1.0 - SETTINGS["clip_low"], 1.0 + SETTINGS["clip_high"]
    beta, coef = SETTINGS["kl_coef"], SETTINGS["entropy_coef"]

    def run(h: Tensor, w: Tensor, y: Tensor, t: float, p: PolicyInputs, rows: slice = slice(None)):
        lp, ent = head(h, w, y, t)
        adv, old, ref = p.advantages[rows], p.old_logprobs[rows], p.ref_logprobs[rows]
        ratio = torch.exp(lp - old)
        pg = -torch.min(ratio * adv, ratio.clamp(lo, hi) * adv)
        kl = torch.exp(ref - lp) - (ref - lp) - 1
        loss = (pg + beta * kl).mean() - coef * ent.mean()
        return TrlOutput(loss, lp.detach(), ent.detach())
    return run


def loss_fn(fused: bool, backend: str, device: Optional[torch.device] = None) -> Callable:
    """(hidden, weight, labels, temperature, PolicyInputs, slice) -> PolicyLossOutput (backend
    ``peers.TRL_HEAD``: TRL's loss on TRL's head, ``trl_loss_fn``)."""
    from logitless.losses import fused_policy_loss, policy_loss_reference

    from .peers import TRL_HEAD
    if backend == TRL_HEAD:
        return trl_loss_fn(device or torch.device("cpu"))
    fn = fused_policy_loss if fused else policy_loss_reference

    def run(h: Tensor, w: Tensor, y: Tensor, t: float, p: PolicyInputs, rows: slice = slice(None)):
        return fn(h, w, y, p.advantages[rows], p.old_logprobs[rows], ref_logprobs=p.ref_logprobs[rows],
                  temperature=t, backend=backend, **SETTINGS)
    return run


def _step(run, x, t, p, rows=slice(None), grad=True):
    def call():
        h = x.hidden[rows].detach().requires_grad_(grad)
        w = x.weight.detach().requires_grad_(grad)
        out = run(h, w, x.labels[rows], t, p, rows)
        if grad:
            out.loss.backward()
        return out, h.grad, w.grad
    return call


def prepare_policy_row(row, fused: bool, backend: str, x, cfg, p: PolicyInputs, meter, sync):
    """Fill ``row`` (bench.Row): checked warm-up and peak memory; returns (forward without grad,
    forward+backward), the calls the bench times in its rounds."""
    device = torch.device(cfg.device)
    t, s = cfg.temperature, min(cfg.check_tokens, x.hidden.shape[0])
    run = loss_fn(fused, backend, device)
    gc.collect()
    t0 = time.perf_counter()
    out, dh, dw = _step(run, x, t, p, slice(0, s))()
    sync(device)
    row.warmup_s = time.perf_counter() - t0
    ref, rdh, rdw = _step(loss_fn(False, "reference"), x, t, p, slice(0, s))()
    for name, value in (("loss", out.loss), ("d_hidden", dh), ("d_weight", dw)):
        if value is None or not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"{name} is missing or has non-finite values")
    row.err_logprob = float((out.logprobs - ref.logprobs).abs().max())
    row.err_entropy = float((out.entropy - ref.entropy).abs().max())
    row.err_dh, row.err_dw = rel_err(dh, rdh), rel_err(dw, rdw)
    loss, ref_loss = out.loss.item(), ref.loss.item()
    loss_rel = abs(loss - ref_loss) / max(abs(ref_loss), 1e-30)
    row.reason = f"PPO loss, rel err {loss_rel:.1e} vs policy_loss_reference"
    del out, dh, dw, ref, rdh, rdw
    forward = _step(run, x, t, p, grad=False)

    def fwd():
        with torch.no_grad():
            return forward()
    fwd()
    row.fwd_extra_bytes = meter.measure(fwd)
    step = _step(run, x, t, p)
    row.fwd_bwd_extra_bytes = meter.measure(step)
    return fwd, step
