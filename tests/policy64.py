"""Float64 ground truth of the policy loss, written out here from verl's definitions without any of
logitless' code (materialised logits, torch autograd), and random inputs that make every branch matter."""
from __future__ import annotations

import math

import torch

from reference64 import logprobs_entropy64


def kl64(lp, ref, kl_type):
    base = kl_type.rstrip("+")
    if base in ("k1", "kl"):
        kl = lp - ref
    elif base == "abs":
        kl = (lp - ref).abs()
    elif base in ("k2", "mse"):
        kl = 0.5 * (lp - ref) ** 2
    else:
        r = torch.clamp(ref - lp, -20, 20)
        kl = torch.clamp(torch.exp(r) - r - 1, -10, 10)
    if kl_type.endswith("+"):
        k2 = 0.5 * (lp - ref) ** 2
        kl = k2 - k2.detach() + kl.detach()
    return kl


def term64(lp, ent, adv, old, ref, *, clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=0.0, kl_type="k3",
           entropy_coef=0.0):
    """(per-token term, clipped mask, kl or None), float64, differentiable in lp and ent."""
    old = lp.detach() if old is None else old
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    kl = None if ref is None else kl64(lp, ref, kl_type)
    f = pg
    if kl is not None and kl_coef:
        f = f + kl_coef * kl
    return f - entropy_coef * ent, clipped, kl


def sequences(valid, cu_seqlens=None):
    """List of index lists, one per sequence (rows of [..., s] labels, or packed by cu_seqlens)."""
    flat = valid.reshape(-1)
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        return [list(range(a, b)) for a, b in zip(cu[:-1], cu[1:], strict=True)], max(
            [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)] + [1])
    s = valid.shape[-1]
    return [list(range(r * s, (r + 1) * s)) for r in range(flat.numel() // s)], s


def aggregate64(values, valid, loss_agg, cu_seqlens=None):
    """verl's agg_loss (0.9: fully masked sequences excluded), by explicit loops over sequences."""
    v = values.reshape(-1)
    m = valid.reshape(-1)
    total = torch.zeros((), dtype=torch.float64)
    if loss_agg == "token-sum":
        return (v * m).sum()
    if loss_agg == "token-mean":
        n = int(m.sum())
        return (v * m).sum() / n if n else total
    seqs, horizon = sequences(valid, cu_seqlens)
    kept = [idx for idx in seqs if int(m[idx].sum()) > 0]
    for idx in kept:
        s = (v[idx] * m[idx]).sum()
        if loss_agg == "seq-mean-token-mean":
            s = s / int(m[idx].sum())
        elif loss_agg == "seq-mean-token-sum-norm":
            s = s / horizon
        total = total + s
    return total / len(kept) if kept else total


def loss64(hidden, weight, labels, adv, old, *, temperature=1.0, ignore_index=-100, loss_agg="token-mean",
           cu_seqlens=None, ref=None, with_scale=False, **spec):
    """(loss, logprobs, entropy, clip_fraction, kl_aggregated or None, d_hidden, d_weight), all float64;
    with_scale: and, last, the loss's float scale, the same aggregation of |term| (a loss of terms that
    nearly cancel is small against the rounding of its terms; its error is measured against this)."""
    valid = labels != ignore_index
    # ignored rows may hold NaN: they must get no gradient and leak nothing, so the truth never sees them
    h = torch.where(valid.unsqueeze(-1), hidden.detach().double(), 0.0).requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    lp, ent = logprobs_entropy64(h, w, labels, temperature, ignore_index)

    def full(t):
        return None if t is None else torch.broadcast_to(t.double(), labels.shape)
    adv_, old_, ref_ = full(adv), full(old), full(ref)
    # padding may hold anything (NaN included): put zeros there before any arithmetic
    zero = torch.zeros_like(lp)
    adv_ = torch.where(valid, adv_, zero)
    old_ = None if old_ is None else torch.where(valid, old_, zero)
    ref_ = None if ref_ is None else torch.where(valid, ref_, zero)
    f, clipped, kl = term64(lp, ent, adv_, old_, ref_, **spec)
    loss = aggregate64(f, valid, loss_agg, cu_seqlens)
    loss.backward()
    n = int(valid.sum())
    clip_fraction = (clipped & valid).sum().double() / max(n, 1)
    kl_agg = None if kl is None else aggregate64(kl.detach(), valid, loss_agg, cu_seqlens)
    out = (loss.detach(), lp.detach(), ent.detach(), clip_fraction, kl_agg, h.grad, w.grad)
    return out + (aggregate64(f.detach().abs(), valid, loss_agg, cu_seqlens),) if with_scale else out


def policy_inputs(lead, h, v, dtype=torch.float32, *, ignored=0.25, logit_std=4.0, old_noise=0.4, device="cpu"):
    """hidden [*lead, h], weight [v, h], labels [*lead] (sampled from the softmax; a share ``ignored`` of
    them ignore_index, padding hidden rows non-finite), and per-token advantages, old and ref log-probs
    (float32, NaN at ignored positions) around the true log-probs so that clipping is active on both sides."""
    hidden = torch.randn(*lead, h, device=device)
    weight = torch.randn(v, h, device=device) * (logit_std / math.sqrt(h))
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.no_grad():
        lp_all = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)
        labels = torch.multinomial(lp_all.exp().reshape(-1, v), 1).reshape(lead)
        lp = lp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ignore = torch.rand(lead, device=device) < ignored
    labels = torch.where(ignore, torch.full_like(labels, -100), labels)
    adv = torch.randn(lead, device=device)
    # log-probs stay <= 0 (above 0 they are refused)
    old = (lp + old_noise * torch.randn(lead, device=device).double()).clamp(max=0.0).float()
    ref = (lp + old_noise * torch.randn(lead, device=device).double()).clamp(max=0.0).float()
    # both sides of the clip bind somewhere: a scored token with log-prob below -1 has ratio e^-1 with A < 0
    # (old = lp + 1 <= 0), another scored token ratio e^1 with A > 0 (the clipped surrogate is the larger on each)
    scored, flat_lp = (~ignore).reshape(-1), lp.reshape(-1)
    low = (scored & (flat_lp < -1.0)).nonzero().squeeze(1)[:1].tolist()
    rest = [i for i in scored.nonzero().squeeze(1).tolist() if i not in low][:1]
    for i, sign in [(i, -1.0) for i in low] + [(i, 1.0) for i in rest]:
        adv.view(-1)[i] = sign * (0.5 + adv.view(-1)[i].abs())
        old.view(-1)[i] = (flat_lp[i] - sign).float()
    nan = torch.full(lead, float("nan"), device=device)
    adv, old, ref = (torch.where(ignore, nan, t) for t in (adv, old, ref))
    hidden = hidden.clone()
    hidden[ignore] = float("nan")
    return hidden, weight, labels, adv, old, ref
