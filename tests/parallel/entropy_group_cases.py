"""The entropy mask's quantile over a process group (``entropy_quantile_group``: TRL's top_entropy_quantile
spans its processes), run inside every rank of a gloo group by tp_harness (``run_world(world,
"entropy_group_cases")``).

Data parallel: each rank its own batch (its own shape and scored tokens) and the whole LM head. Every
rank's loss and gradients equal float64 ground truth in which the threshold is the quantile of every
rank's float64 entropies of scored tokens (gathered here with all_gather_object, nothing of logitless),
on inputs where that mask differs from each rank's own quantile's on some rank.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from logitless.losses import fused_policy_loss
from policy64 import aggregate64, policy_inputs
from reference64 import logprobs_entropy64
from tp_cases import Checks

V, H = 263, 40
LEADS = [(3, 6), (2, 7), (4, 5)]          # one per rank: different numbers of scored tokens
QUANTILE, COEF = 0.4, 0.05


def configure_process() -> None:
    torch.set_num_threads(1)              # the ranks share the machine's cores
    os.environ["LOGITLESS_CHUNK_ELEMENTS"] = str(4 * V)       # several chunks per call
    os.environ["LOGITLESS_POLICY_WORKSPACE_BYTES"] = "1"


def _inputs(ctx, attempt):
    """This rank's batch (its own shape and tokens; higher entropies on higher ranks) on the head every rank
    shares, old log-probs around this head's."""
    torch.manual_seed(ctx.seed + 7 * ctx.rank + 1000 * attempt)
    hidden, _, labels, adv, old, _ = policy_inputs(LEADS[ctx.rank], H, V, old_noise=0.5)
    hidden = hidden * (1.0 - 0.15 * ctx.rank)
    torch.manual_seed(ctx.seed)
    _, weight, _, _, _, _ = policy_inputs(LEADS[0], H, V)
    valid = labels != -100
    with torch.no_grad():
        lp, _ = logprobs_entropy64(torch.where(valid.unsqueeze(-1), hidden, 0.0), weight, labels)
        old = torch.where(valid, (lp + 0.5 * torch.randn_like(lp)).clamp(max=0.0).float(), old)
    return hidden, weight, labels, adv, old


def _masks(ent, valid, group):
    """(the group-wide quantile's mask, this rank's own quantile's mask) of float64 entropies, TRL's way (the
    quantile of float32 entropies of the scored tokens; every rank's gathered with all_gather_object)."""
    e = ent.detach().float()
    pool = [None] * dist.get_world_size(group)
    dist.all_gather_object(pool, e[valid].tolist(), group=group)
    everyone = torch.tensor([x for part in pool for x in part])
    return (valid & (e >= torch.quantile(everyone, 1.0 - QUANTILE)),
            valid & (e >= torch.quantile(e[valid], 1.0 - QUANTILE)))


def _truth(hidden, weight, labels, adv, old, group):
    """(loss, d_hidden, d_weight) float64: TRL's clipped loss (seq-mean-token-mean) on the tokens whose
    entropy is at least the group-wide quantile, minus COEF times the token mean of their entropies (0
    without any), and whether that mask differs from each rank's own quantile's on some rank."""
    valid = labels != -100
    h = torch.where(valid.unsqueeze(-1), hidden.double(), 0.0).requires_grad_(True)
    w = weight.double().requires_grad_(True)
    lp, ent = logprobs_entropy64(h, w, labels)
    keep, own = _masks(ent, valid, group)
    differs = torch.tensor([float((keep != own).any())])
    dist.all_reduce(differs, group=group)
    zero = torch.zeros_like(lp)
    adv, old = (torch.where(valid, t.double(), zero) for t in (adv, old))
    ratio = torch.exp(lp - old)
    pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv) * keep
    loss = aggregate64(pg, valid, "seq-mean-token-mean") - COEF * (ent * keep).sum() / keep.sum().clamp_min(1)
    loss.backward()
    return loss.detach(), h.grad, w.grad, differs.item() > 0


def _case(ctx, backend):
    ck = Checks()
    for attempt in range(10):      # inputs on which the group's quantile keeps other tokens than each rank's own
        hidden, weight, labels, adv, old = _inputs(ctx, attempt)
        loss, dh, dw, differs = _truth(hidden, weight, labels, adv, old, ctx.group)
        if differs:
            break
    ck.true("inputs where the group's quantile matters", differs)
    valid = labels != -100
    settings = dict(entropy_quantile=QUANTILE, entropy_coef=COEF, entropy_agg="token-mean",
                    loss_agg="seq-mean-token-mean", backend=backend)
    h_in, w_in = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_policy_loss(h_in, w_in, labels, adv, old, entropy_quantile_group=ctx.group, **settings)
    out.loss.backward()
    tag = f"[{backend}]"
    ck.abs_le(f"{tag} loss", out.loss.detach().reshape(1), loss.reshape(1), 2e-5 * max(1.0, abs(loss.item())))
    ck.rel_le(f"{tag} d_hidden", h_in.grad[valid], dh[valid], 1e-4)
    ck.rel_le(f"{tag} d_weight", w_in.grad, dw, 1e-4)
    ck.done()


def case_chunked(ctx):
    _case(ctx, "chunked")


def case_reference(ctx):
    _case(ctx, "reference")


def case_triton_interpreted(ctx):
    _case(ctx, "triton")


def pre_init_cases():
    return []


def cases_for(world: int):
    return [(fn.__name__[len("case_"):], fn) for fn in (case_chunked, case_reference, case_triton_interpreted)]
