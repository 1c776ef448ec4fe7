"""logitless.record.last_path(): every public op leaves its record (path "op", its name, the backend and how the
products ran), so that a caller can tell what ran without grepping logs (after a TRL distillation run it was None).
The integrations' step records are asserted after real trainer steps in tests/trl and tests/transformers."""
from __future__ import annotations

import pytest
import torch

import logitless
from logitless import fused_logprobs, fused_topk
from logitless.losses import fused_distillation_loss, fused_policy_loss
from logitless.record import last_path

V, H = 4099, 96


def _inputs():
    hidden = torch.randn(2, 7, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.1).requires_grad_()
    labels = torch.randint(0, V, (2, 7))
    labels[:, :2] = -100
    return hidden, weight, labels


@pytest.mark.parametrize("entry", ["fused_logprobs", "fused_policy_loss", "fused_distillation_loss", "fused_topk"])
def test_every_public_op_writes_its_record(entry):
    hidden, weight, labels = _inputs()
    before = last_path()
    if entry == "fused_logprobs":
        fused_logprobs(hidden, weight, labels)
    elif entry == "fused_policy_loss":
        fused_policy_loss(hidden, weight, labels, torch.randn(2, 1))
    elif entry == "fused_distillation_loss":
        fused_distillation_loss(hidden, weight, labels, teacher_hidden=torch.randn(2, 7, 64),
                                teacher_weight=torch.randn(V, 64) * 0.1, divergence="reverse_kl")
    else:
        fused_topk(hidden, weight, 5)
    rec = last_path()
    assert rec is not None and (before is None or rec.serial > before.serial)
    assert (rec.path, rec.entry) == ("op", entry)
    assert rec.backend == logitless.last_backend() and rec.backend is not None
    assert rec.precision == logitless.last_precision() and rec.precision is not None
