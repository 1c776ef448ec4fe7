"""The truncation rows of `logitless bench`: the label's log-prob and entropy under a sampler's top-p (vLLM's order,
docs/truncation.md), on the bench's inputs and against the same GEMM floor.

- ``truncation``: ``fused_logprobs(..., truncation=Truncation(top_p=TOP_P))`` on the auto backend;
- ``naive-truncation``: what a trainer writes by hand (the TRL and prime-rl fixes): the logits in the input dtype as
  the ``naive`` row makes them, float32, vLLM's top-p mask by a sort of every row, the log-softmax over the kept ids
  (a label outside them: z_y - lse over them, as logitless defines it, where the plain log-softmax gives -inf).

fwd = log-probs and entropies without gradients; fwd+bwd = sum(a * logprob + b * entropy) and its backward. Errors
against ``fused_logprobs(..., truncation=...)`` on the reference backend (float32 logits) on the first
``check_tokens`` tokens; the note gives the kept sets' median size and whether the rows kept the same sets.
"""
from __future__ import annotations

import gc
import time

import torch
from torch import Tensor

from .common import rel_err

TOP_P = 0.95


def naive_truncated(h: Tensor, w: Tensor, y: Tensor, t: float, top_p: float = TOP_P):
    """(log-prob, entropy, kept count) under vLLM's top-p, the logits built whole."""
    z = (h @ w.t()).float() / t
    srt, idx = z.sort(dim=-1)                                   # ascending, as vLLM's apply_top_k_top_p
    drop = srt.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
    drop[:, -1] = False
    kept = z.masked_fill(torch.zeros_like(drop).scatter(1, idx, drop), float("-inf"))
    logp = torch.log_softmax(kept, dim=-1)
    # a label outside the kept set: z_y - lse over the kept set (as logitless defines it), not -inf
    lp = z.gather(1, y.unsqueeze(1)).squeeze(1) - torch.logsumexp(kept, dim=-1)
    p = logp.exp()
    ent = -(p * logp.masked_fill(p == 0, 0.0)).sum(dim=-1)
    return lp, ent, (~drop).sum(dim=-1)


def _fn(name: str, backend: str):
    """(h, w, y, t) -> (log-prob, entropy, kept count)."""
    if name == "naive-truncation":
        return naive_truncated
    from logitless import Truncation, fused_logprobs

    def run(h, w, y, t):
        out = fused_logprobs(h, w, y, temperature=t, backend=backend, truncation=Truncation(top_p=TOP_P))
        return out.logprobs, out.entropy, out.kept_count
    return run


def _step(fn, x, t, a, b, rows=slice(None), grad=True):
    def call():
        h = x.hidden[rows].detach().requires_grad_(grad)
        w = x.weight.detach().requires_grad_(grad)
        lp, ent, count = fn(h, w, x.labels[rows], t)
        if grad:
            ((a[rows] * lp).sum() + (b[rows] * ent).sum()).backward()
        return lp.detach(), ent.detach(), count, h.grad, w.grad
    return call


def prepare_truncation_row(row, name: str, backend: str, x, cfg, meter, sync):
    """Fill ``row`` (bench.Row): checked warm-up and peak memory; returns (forward without grad,
    forward+backward), the calls the bench times in its rounds."""
    device = torch.device(cfg.device)
    t, s = cfg.temperature, slice(0, min(cfg.check_tokens, x.hidden.shape[0]))
    fn = _fn(name, backend)
    gc.collect()
    t0 = time.perf_counter()
    lp, ent, count, dh, dw = _step(fn, x, t, x.a, x.b, s)()
    sync(device)
    row.warmup_s = time.perf_counter() - t0
    r_lp, r_ent, r_count, rdh, rdw = _step(_fn("truncation", "reference"), x, t, x.a, x.b, s)()
    for what, value in (("logprobs", lp), ("entropy", ent), ("d_hidden", dh), ("d_weight", dw)):
        if value is None or not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"{what} is missing or has non-finite values")
    row.err_logprob = float((lp - r_lp).abs().max())
    row.err_entropy = float((ent - r_ent).abs().max())
    row.err_dh, row.err_dw = rel_err(dh, rdh), rel_err(dw, rdw)
    same = int((count.cpu() == r_count.cpu()).sum())
    row.reason = (f"top_p {TOP_P}: kept median {int(r_count.float().median())} ids, the same kept sets on "
                  f"{same}/{r_count.numel()} tokens")
    del lp, ent, count, dh, dw, r_lp, r_ent, r_count, rdh, rdw
    forward = _step(fn, x, t, x.a, x.b, grad=False)

    def fwd():
        with torch.no_grad():
            return forward()
    fwd()
    row.fwd_extra_bytes = meter.measure(fwd)
    step = _step(fn, x, t, x.a, x.b)
    row.fwd_bwd_extra_bytes = meter.measure(step)
    return fwd, step
