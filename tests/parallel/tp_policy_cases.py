"""The tensor-parallel cases of the fused policy loss, run inside every rank of a gloo group by tp_harness
(``run_world(world, "tp_policy_cases")``).

Every rank builds the same full inputs (same seed), holds its shard of the LM head's vocabulary rows, and
runs fused_policy_loss (and policy_loss_reference) across the group; the loss, its metrics, the local
d_weight shard and d_hidden are compared with float64 ground truth on the full weight (tests/policy64.py).
Shards of different sizes make the ranks' own chunk plans differ: every rank must still cut the same
token chunks (the statistics are combined with one all-gather per chunk).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from logitless import last_backend, last_precision
from logitless.losses import fused_policy_loss, policy_loss_reference
from policy64 import loss64, policy_inputs
from tp_cases import BF16X3_STATS, Checks, Ctx, even_sizes, same_on_every_rank, shard, uneven_sizes  # noqa: F401

V, H = 1031, 48
LEAD = (3, 6)
TOL = {torch.float32: (2e-5, 2e-5, 1e-4), torch.bfloat16: (1e-4, 2e-3, 1e-2)}   # loss, logprob/entropy, grads


def configure_process() -> None:
    torch.set_num_threads(1)   # the ranks share the machine's cores
    # several token chunks per call on both backends (the triton interpreter's chunk is one 16-row tile)
    os.environ["LOGITLESS_CHUNK_ELEMENTS"] = str(3 * 600)
    os.environ["LOGITLESS_POLICY_WORKSPACE_BYTES"] = "1"


def check_policy_sharded(ctx: Ctx, ck: Checks, *, backend: str, sizes, lead=LEAD, h=H, dtype=torch.float32,
                         reduce_grad_hidden=True, fn=fused_policy_loss, tag="", salt=0, tol=None, **loss_kw):
    tag = f"[{backend}{' ' + tag if tag else ''}]"
    torch.manual_seed(ctx.seed + salt)     # the same inputs on every rank
    hidden, weight, labels, adv, old, ref = policy_inputs(lead, h, sum(sizes), dtype, old_noise=0.5)
    temperature = torch.rand(lead) + 0.5
    off, w_local = shard(ctx, weight, sizes)
    h_in = hidden.clone().requires_grad_(True)
    w_in = w_local.requires_grad_(True)
    out = fn(h_in, w_in, labels, adv, old, ref_logprobs=ref, temperature=temperature, tp_group=ctx.group,
             reduce_grad_hidden=reduce_grad_hidden, backend=backend, **loss_kw)
    ck.true(f"{tag} last_backend", last_backend() == backend, f"is {last_backend()}")
    out.loss.backward()
    if "precision" in loss_kw:
        ran = tuple(last_precision())
        want = (loss_kw["precision"], loss_kw.get("grad_precision") or "bf16")
        ck.true(f"{tag} last_precision", ran == want, f"is {ran}, not {want}")
    spec = {k: v for k, v in loss_kw.items() if k not in ("loss_agg", "precision", "grad_precision")}
    loss, lp, ent, clip_fraction, kl, dh, dw = loss64(hidden, weight, labels, adv, old, temperature=temperature,
                                                      loss_agg=loss_kw.get("loss_agg", "token-mean"), ref=ref, **spec)
    tol = tol or TOL[dtype]
    valid = labels != -100
    ck.abs_le(f"{tag} loss", out.loss.detach().reshape(1), loss.reshape(1), tol[0])
    ck.abs_le(f"{tag} logprobs", out.logprobs, lp, tol[1])
    ck.abs_le(f"{tag} entropy", out.entropy, ent, tol[1])
    ck.abs_le(f"{tag} clip fraction", out.clip_fraction.reshape(1), clip_fraction.reshape(1), 1e-6)
    ck.abs_le(f"{tag} kl", out.kl.reshape(1), kl.reshape(1), tol[0] * 10)
    for name, t in (("loss", out.loss), ("logprobs", out.logprobs), ("kl", out.kl)):
        same_on_every_rank(ctx, ck, f"{tag} {name}", t.detach().reshape(-1))
    ck.rel_le(f"{tag} d_weight (local shard)", w_in.grad, dw[off: off + sizes[ctx.rank]], tol[2])
    dh_got = h_in.grad
    if not reduce_grad_hidden:
        dh_got = dh_got.float().clone()
        dist.all_reduce(dh_got, group=ctx.group)
    ck.rel_le(f"{tag} d_hidden{'' if reduce_grad_hidden else ' (all-reduced partials)'}", dh_got[valid],
              dh[valid], tol[2])
    ck.true(f"{tag} ignored rows", bool((h_in.grad[~valid] == 0).all()), "got a gradient or NaN")


def case_policy_chunked_and_reference(ctx):
    ck = Checks()
    for backend in ("chunked", "reference"):
        check_policy_sharded(ctx, ck, backend=backend, sizes=even_sizes(V, ctx.world), loss_agg="seq-mean-token-mean",
                             entropy_coef=0.05, kl_coef=0.2, dual_clip=3.0)
        check_policy_sharded(ctx, ck, backend=backend, sizes=uneven_sizes(V, ctx.world), loss_agg="token-mean",
                             kl_type="k2", kl_coef=0.3, reduce_grad_hidden=False, tag="unequal, partial", salt=3)
    ck.done()


def case_policy_reference_path(ctx):
    """policy_loss_reference (fused_logprobs under TP + autograd) against the same truth."""
    ck = Checks()
    check_policy_sharded(ctx, ck, backend="chunked", sizes=uneven_sizes(V, ctx.world), fn=policy_loss_reference,
                         loss_agg="seq-mean-token-sum", entropy_coef=0.1, tag="reference path")
    ck.done()


def case_policy_bfloat16(ctx):
    ck = Checks()
    check_policy_sharded(ctx, ck, backend="chunked", sizes=even_sizes(V, ctx.world), dtype=torch.bfloat16,
                         loss_agg="seq-mean-token-sum-norm", entropy_coef=0.05)
    ck.done()


def case_policy_triton_interpreted(ctx):
    """The triton pass across the group on tiny shapes, kernels run by triton's interpreter."""
    ck = Checks()
    check_policy_sharded(ctx, ck, backend="triton", sizes=[60, 37, 40][:ctx.world], lead=(3, 7), h=32,
                         loss_agg="seq-mean-token-mean", entropy_coef=0.5, kl_coef=0.1)
    ck.done()


def case_policy_split_precision(ctx):
    """A float32 head by the three-product bfloat16 split, each rank splitting its own shard: the loss and its
    statistics within the split's bound of float64, bfloat16 gradient products by default (bfloat16's relative
    error), float32-exact ones with grad_precision="bf16x3"."""
    ck = Checks()
    for backend in ("chunked", "triton"):
        sizes, lead, h = (even_sizes(V, ctx.world), LEAD, H) if backend == "chunked" else ([60, 37, 40][:ctx.world],
                                                                                          (3, 7), 32)
        check_policy_sharded(ctx, ck, backend=backend, sizes=sizes, lead=lead, h=h, loss_agg="seq-mean-token-mean",
                             entropy_coef=0.05, kl_coef=0.2, precision="bf16x3",
                             tol=(BF16X3_STATS, BF16X3_STATS, 3e-2), tag="bf16x3")
        check_policy_sharded(ctx, ck, backend=backend, sizes=sizes, lead=lead, h=h, loss_agg="token-mean",
                             entropy_coef=0.05, precision="bf16x3", grad_precision="bf16x3",
                             reduce_grad_hidden=False, tol=(BF16X3_STATS, BF16X3_STATS, 1e-4), tag="bf16x3 split grads",
                             salt=5)
    ck.done()


def case_policy_coupled(ctx):
    """Losses that couple a sequence's tokens (GSPO's sequence ratio with TRL's bias-corrected KL) and the
    batch's (the entropy mask), across the group: the one fused pass with chunks cut at sequence boundaries
    (CHUNK_ELEMENTS of 8 rows here), and the two-pass path (the entropy mask); every rank's loss and
    gradients equal the same loss on the unsharded head (itself held to float64 in tests/losses)."""
    ck = Checks()
    os.environ["LOGITLESS_CHUNK_ELEMENTS"] = str(8 * V)
    try:
        for tag, kw in (("sequence ratio", dict(ratio_level="sequence", kl_coef=0.1, kl_type="k3_unclamped",
                                                 kl_ratio=True)),
                        ("entropy mask", dict(entropy_quantile=0.5, entropy_coef=0.05))):
            torch.manual_seed(ctx.seed + 11)
            hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, old_noise=0.5)
            sizes = uneven_sizes(V, ctx.world)
            off, w_local = shard(ctx, weight, sizes)
            outs = []
            for w, group in ((w_local, ctx.group), (weight, None)):
                h_in = hidden.clone().requires_grad_(True)
                w_in = w.clone().requires_grad_(True)
                out = fused_policy_loss(h_in, w_in, labels, adv, old, ref_logprobs=ref, tp_group=group,
                                        backend="chunked", loss_agg="seq-mean-token-mean", **kw)
                out.loss.backward()
                outs.append((out.loss.detach().reshape(1), h_in.grad, w_in.grad))
            (loss, dh, dw_local), (loss_full, dh_full, dw_full) = outs
            valid = labels != -100
            ck.abs_le(f"[{tag}] loss", loss, loss_full, 2e-6)
            # two float32 evaluations whose vocabulary sums run in other orders; the entropy term's gradient,
            # p (log p + H), cancels within each row (seen once: 1.6e-5 over 3 ranks), so 5e-5 of float32 order
            ck.rel_le(f"[{tag}] d_hidden", dh[valid], dh_full[valid].double(), 5e-5)
            ck.rel_le(f"[{tag}] d_weight (local shard)", dw_local, dw_full[off: off + sizes[ctx.rank]].double(), 5e-5)
    finally:
        os.environ["LOGITLESS_CHUNK_ELEMENTS"] = str(3 * 600)
    ck.done()


def _named(fns):
    return [(fn.__name__[len("case_"):], fn) for fn in fns]


def pre_init_cases():
    return []


def cases_for(world: int):
    return _named([case_policy_chunked_and_reference, case_policy_reference_path, case_policy_bfloat16,
                   case_policy_triton_interpreted, case_policy_split_precision, case_policy_coupled])
