"""The distillation and top-k rows of `logitless bench`, on the bench's inputs and against the same GEMM floor.

The student is the bench's head (hidden, weight); the teacher a head of the same shape near it (the student's
hidden states and weight plus noise, fixed by the seed). Rows:

- ``distill``: ``fused_distillation_loss``, TRL's generalised JSD at beta 0.5 (symmetric, so every peer's
  convention for beta gives the same divergence), token-mean, at the bench's temperature: 4 GEMMs forward+backward
  (teacher, student, d_hidden, d_weight), 2 forward;
- ``distill-topk``: ``fused_distillation_loss`` with verl's ``forward_kl_topk`` toward the teacher's top-``K``
  (selected once by ``fused_topk``, not timed: a trainer receives them with the batch);
- ``fused-topk``: ``fused_topk`` of the student's head (k = ``K``): the ids, log-probs and tail, backward
  through log-probs and tail;
- ``trl-divergence``: TRL's ``ChunkedDivergenceFunction`` (its DistillationTrainer's kernel), the same JSD;
- ``liger-jsd``: Liger's ``LigerFusedLinearJSD``, the same JSD (a Triton GPU kernel: on a CPU it says so).

fwd = the loss without gradients; fwd+bwd = the loss and its backward. Errors: the loss's relative error in the
note and the gradients' (dh rel, dW rel) against ``fused_distillation_loss`` on the reference backend (float32
logits) on the first ``check_tokens`` tokens; for ``fused-topk`` against the reference backend's ``fused_topk``
(its log-probs' max error in the lp column; the ids must be equal).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .common import rel_err

BETA = 0.5
K = 32
NOISE = 0.3         # the teacher: the student's tensors plus this much of their scale in noise


@dataclass
class DistillInputs:
    teacher_hidden: Tensor
    teacher_weight: Tensor
    topk_ids: Tensor          # [N, K] the teacher's top-K (fused_topk)
    topk_logprobs: Tensor     # [N, K]


def make_distill_inputs(x, temperature: float, seed: int) -> DistillInputs:
    from logitless import fused_topk
    gen = torch.Generator(device=x.hidden.device).manual_seed(seed + 11)

    def near(t: Tensor) -> Tensor:
        noise = torch.randn(t.shape, device=t.device, generator=gen, dtype=torch.float32)
        return (t.float() + NOISE * t.float().std() * noise).to(t.dtype)
    th, tw = near(x.hidden), near(x.weight)
    with torch.no_grad():
        top = fused_topk(th, tw, K, temperature=temperature)
    return DistillInputs(th, tw, top.ids, top.logprobs)


def _loss_fn(name: str, backend: str, d: DistillInputs, device: torch.device) -> Callable:
    """(hidden, weight, temperature, rows) -> (loss, a tensor whose values the check compares or None)."""
    from logitless import fused_topk
    from logitless.losses import fused_distillation_loss
    if name == "distill":
        def run(h, w, t, rows):
            out = fused_distillation_loss(h, w, torch.zeros(h.shape[0], dtype=torch.long, device=h.device),
                                          teacher_hidden=d.teacher_hidden[rows], teacher_weight=d.teacher_weight,
                                          divergence="jsd", beta=BETA, temperature=t, backend=backend)
            return out.loss, None
    elif name == "distill-topk":
        def run(h, w, t, rows):
            out = fused_distillation_loss(h, w, torch.zeros(h.shape[0], dtype=torch.long, device=h.device),
                                          teacher_topk_ids=d.topk_ids[rows], teacher_topk_logprobs=
                                          d.topk_logprobs[rows], divergence="forward_kl_topk", temperature=t,
                                          backend=backend)
            return out.loss, None
    elif name == "fused-topk":
        def run(h, w, t, rows):
            top = fused_topk(h, w, K, temperature=t, backend=backend)
            return top.logprobs.sum() + top.tail_logprob.sum(), top
    elif name == "trl-divergence":
        from .peers import trl_divergence
        fn = trl_divergence(device)

        def run(h, w, t, rows):
            div, _ = fn(h, w, d.teacher_hidden[rows], d.teacher_weight, BETA, t)
            return div.float().mean(), None
    elif name == "liger-jsd":
        from .peers import liger_jsd
        jsd = liger_jsd(device, BETA)

        def run(h, w, t, rows):
            return jsd(h, w, d.teacher_hidden[rows], d.teacher_weight, t), None
    else:
        raise ValueError(f"unknown distillation row {name!r}")
    return run


def _step(run, x, t, rows=slice(None), grad=True):
    def call():
        h = x.hidden[rows].detach().requires_grad_(grad)
        w = x.weight.detach().requires_grad_(grad)
        loss, extra = run(h, w, t, rows)
        if grad:
            loss.backward()
        return loss.detach(), extra, h.grad, w.grad
    return call


def prepare_distill_row(row, name: str, backend: str, x, cfg, d: DistillInputs, meter, sync):
    """Fill ``row`` (bench.Row): checked warm-up and peak memory; returns (forward without grad,
    forward+backward), the calls the bench times in its rounds."""
    device = torch.device(cfg.device)
    t, s = cfg.temperature, slice(0, min(cfg.check_tokens, x.hidden.shape[0]))
    run = _loss_fn(name, backend, d, device)
    gc.collect()
    t0 = time.perf_counter()
    loss, extra, dh, dw = _step(run, x, t, s)()
    sync(device)
    row.warmup_s = time.perf_counter() - t0
    ref_name = "distill" if name in ("trl-divergence", "liger-jsd") else name
    ref, ref_extra, rdh, rdw = _step(_loss_fn(ref_name, "reference", d, device), x, t, s)()
    for what, value in (("loss", loss), ("d_hidden", dh), ("d_weight", dw)):
        if value is None or not bool(torch.isfinite(value).all()):
            raise FloatingPointError(f"{what} is missing or has non-finite values")
    row.err_dh, row.err_dw = rel_err(dh, rdh), rel_err(dw, rdw)
    if name == "fused-topk":
        if not torch.equal(extra.ids, ref_extra.ids):
            raise AssertionError("fused_topk's ids differ from the reference backend's")
        row.err_logprob = float((extra.logprobs - ref_extra.logprobs).detach().abs().max())
        row.reason = f"k={K}: ids equal to the reference backend's"
    else:
        rel = abs(loss.item() - ref.item()) / max(abs(ref.item()), 1e-30)
        what = f"forward_kl_topk, k={K}" if name == "distill-topk" else f"JSD beta {BETA}"
        row.reason = f"{what}, loss rel err {rel:.1e} vs the reference backend"
    del loss, extra, dh, dw, ref, ref_extra, rdh, rdw
    forward = _step(run, x, t, grad=False)

    def fwd():
        with torch.no_grad():
            return forward()
    fwd()
    row.fwd_extra_bytes = meter.measure(fwd)
    step = _step(run, x, t)
    row.fwd_bwd_extra_bytes = meter.measure(step)
    return fwd, step
