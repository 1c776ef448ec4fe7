"""The reference backend: materialises the whole float32 logits tensor [N, V].

Memory O(N x V): meant as the ground truth for tests and as the naive baseline, not for training.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .maths import (
    accumulate_mm,
    apply_softcap_derivative,
    dlogits_from_logits,
    label_logits,
    logits_from_products,
    mm_fp32,
)
from .precision import GradOperands

name = "reference"


def unavailable_reason(hidden: Tensor, weight: Tensor) -> Optional[str]:
    return None


def logits(hidden: Tensor, weight: Tensor, inv_temp: Tensor, softcap: Optional[float] = None,
           keep_tanh: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """float32 [N, V] (softcapped, then) tempered logits, and tanh(raw / softcap) if keep_tanh."""
    return logits_from_products(mm_fp32(hidden, weight.t()), inv_temp, softcap, keep_tanh)


def stats(hidden, weight, labels, inv_temp, with_entropy, softcap=None):
    z, _ = logits(hidden, weight, inv_temp, softcap)
    lse = torch.logsumexp(z, dim=1)
    zy = label_logits(z, labels)
    ent = None
    if with_entropy:
        logp = z.sub_(lse.unsqueeze(1))
        ent = -(logp.exp() * logp).sum(dim=1)
    return lse, ent, zy


def grads(hidden, weight, labels, inv_temp, lse, ent, g_lp, g_ent, need_dh, need_dw, softcap=None, dw_acc=None,
          grad_operands=None):
    go = grad_operands or GradOperands.plain(hidden, weight, torch.float32)
    z, t = logits(hidden, weight, inv_temp, softcap, keep_tanh=True)
    dz = apply_softcap_derivative(dlogits_from_logits(z, labels, inv_temp, lse, ent, g_lp, g_ent), t)
    dh = dw = None
    if need_dh:
        dh = torch.zeros((hidden.shape[0], go.hidden_size), dtype=torch.float32, device=hidden.device)
        for a, b in go.products(dz, go.weight_parts):
            accumulate_mm(dh, a, b)
    if need_dw:
        acc = dw_acc if dw_acc is not None else torch.zeros((weight.shape[0], go.hidden_size), dtype=torch.float32,
                                                            device=weight.device)
        for a, b in go.products(dz.t(), go.hidden_parts):
            accumulate_mm(acc, a, b)
        dw = None if dw_acc is not None else acc.to(go.out_dtype)
    return dh, dw


def token_rows(stage: str, hidden: Tensor, weight: Tensor, with_entropy: bool) -> int:
    """Every token at once: the reference materialises [N, V] by design (the naive baseline)."""
    return max(1, hidden.shape[0])
