"""The tensor-parallel cases of fused_distillation_loss, run inside every rank of a gloo group by tp_harness
(``run_world(world, "tp_distill_cases")``).

Every rank builds the same full inputs (same seed) and holds its shard of both heads' vocabulary rows (the
same rows of the student's and the teacher's weight); the loss, the per-token divergence and entropy, the
local d_weight shard and d_hidden are compared with float64 ground truth on the full weights
(tests/distill64.py). Unequal shards (one of a single row) and several token chunks per call.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from distill64 import FLOAT32_UNITS, distill64
from logitless import last_backend
from logitless.losses import fused_distillation_loss
from tp_cases import Checks, Ctx, even_sizes, same_on_every_rank, shard, uneven_sizes  # noqa: F401

V, HS, HT = 1031, 48, 40
LEAD = (3, 6)


def configure_process() -> None:
    torch.set_num_threads(1)   # the ranks share the machine's cores
    os.environ["LOGITLESS_CHUNK_ELEMENTS"] = str(4 * 600)     # several token chunks per call


def check_sharded(ctx: Ctx, ck: Checks, *, backend: str, sizes, kind: str, beta=None, dtype=torch.float32,
                  reduce_grad_hidden=True, tag="", salt=0, **kw):
    tag = f"[{backend} {kind}{' ' + tag if tag else ''}]"
    torch.manual_seed(ctx.seed + salt)     # the same inputs on every rank
    hs = torch.randn(*LEAD, HS).to(dtype)
    ws = (torch.randn(V, HS) / HS ** 0.5 * 3).to(dtype)
    ht = torch.randn(*LEAD, HT)
    wt = torch.randn(V, HT) / HT ** 0.5 * 3
    labels = torch.randint(0, V, LEAD)
    labels[0, :2] = -100
    labels[2, 4] = -100
    temperature = torch.rand(LEAD) + 0.5
    off, ws_local = shard(ctx, ws, sizes)
    _, wt_local = shard(ctx, wt, sizes)
    h_in = hs.clone().requires_grad_(True)
    w_in = ws_local.requires_grad_(True)
    out = fused_distillation_loss(h_in, w_in, labels, teacher_hidden=ht, teacher_weight=wt_local, divergence=kind,
                                  beta=beta, temperature=temperature, tp_group=ctx.group,
                                  reduce_grad_hidden=reduce_grad_hidden, backend=backend, **kw)
    ck.true(f"{tag} last_backend", last_backend() == backend, f"is {last_backend()}")
    out.loss.backward()
    heads = {"s_scale": kw.get("student_logit_scale", 1.0), "t_scale": kw.get("teacher_logit_scale", 1.0),
             "s_softcap": kw.get("student_softcap"), "t_softcap": kw.get("teacher_softcap")}
    truth = distill64(hs, ws, ht, wt, labels, kind, beta, temperature=temperature, **heads)
    loss, d, ent, dh, dw = truth
    grad_tol = 1e-4 if dtype == torch.float32 else 1e-2
    ck.abs_le(f"{tag} loss", out.loss.detach().reshape(1), loss.float().reshape(1), 2e-5 * max(1, loss.item()))
    ck.abs_le(f"{tag} divergence", out.divergence, d.float(), 2e-5 * max(1, d.abs().max().item()))
    ck.abs_le(f"{tag} entropy", out.entropy, ent.float(), 2e-4)
    for name, t in (("loss", out.loss), ("divergence", out.divergence), ("entropy", out.entropy)):
        same_on_every_rank(ctx, ck, f"{tag} {name}", t.detach().reshape(-1))
    # the local shard's error against the whole d_weight's scale: a one-row shard's own norm may be a sum that
    # nearly cancels, where float32 cannot give a small relative error
    want = dw[off: off + sizes[ctx.rank]]
    err = (w_in.grad.double() - want).abs().max().item() / dw.abs().max().item()
    if dtype == torch.float32:
        # or within float32's resolution of the gradient's terms (distill64.FLOAT32_UNITS: jsd's gradient cancels
        # to ~1/300 of them, where 1e-4 of its largest entry fails by chance)
        grad_tol = max(grad_tol, FLOAT32_UNITS * 2.0 ** -24 * truth.grad_scale[1] / dw.abs().max().item())
    ck.true(f"{tag} d_weight (local shard)", err <= grad_tol, f"error {err:.3g} of max |d_weight| > {grad_tol}")
    dh_got = h_in.grad
    if not reduce_grad_hidden:
        dh_got = dh_got.float().clone()
        dist.all_reduce(dh_got, group=ctx.group)
    valid = labels != -100
    ck.rel_le(f"{tag} d_hidden", dh_got[valid].float(), dh[valid].float(), grad_tol)
    ck.true(f"{tag} ignored rows", bool((h_in.grad[~valid] == 0).all()), "got a gradient or NaN")


def case_distill_every_divergence(ctx):
    ck = Checks()
    for backend in ("chunked", "reference"):
        for i, (kind, beta) in enumerate((("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3))):
            check_sharded(ctx, ck, backend=backend, sizes=even_sizes(V, ctx.world), kind=kind, beta=beta, salt=i)
            check_sharded(ctx, ck, backend=backend, sizes=uneven_sizes(V, ctx.world), kind=kind, beta=beta,
                          reduce_grad_hidden=False, tag="unequal, partial", salt=10 + i)
    # check_inputs=False: every row on every rank, the collectives alike, the same numbers
    check_sharded(ctx, ck, backend="chunked", sizes=uneven_sizes(V, ctx.world), kind="jsd", beta=0.3,
                  check_inputs=False, tag="unchecked", salt=20)
    ck.done()


def case_distill_bfloat16_student(ctx):
    ck = Checks()
    check_sharded(ctx, ck, backend="chunked", sizes=uneven_sizes(V, ctx.world), kind="jsd", beta=0.6,
                  dtype=torch.bfloat16, student_softcap=6.0, teacher_logit_scale=0.8)
    ck.done()


def case_distill_triton_interpreted(ctx):
    """The triton backend's kernels (through the interpreter on CPU) with both heads sharded."""
    from logitless.ops.triton.common import INTERPRETING
    if not INTERPRETING:
        from tp_harness import Skip
        raise Skip("CPU tensors: the triton backend needs its interpreter (TRITON_INTERPRET=1)")
    ck = Checks()
    check_sharded(ctx, ck, backend="triton", sizes=uneven_sizes(V, ctx.world), kind="jsd", beta=0.4,
                  student_softcap=7.0, reduce_grad_hidden=False, tag="unequal, partial")
    check_sharded(ctx, ck, backend="triton", sizes=even_sizes(V, ctx.world), kind="reverse_kl", salt=5)
    ck.done()


def case_distill_shards_differ(ctx):
    """A teacher sharded differently from the student is refused on every rank."""
    ck = Checks()
    sizes = even_sizes(V, ctx.world)
    other = uneven_sizes(V, ctx.world)
    _, ws = shard(ctx, torch.randn(V, HS), sizes)
    _, wt = shard(ctx, torch.randn(V, HT), other)
    labels = torch.randint(0, V, LEAD)
    try:
        fused_distillation_loss(torch.randn(*LEAD, HS), ws, labels, teacher_hidden=torch.randn(*LEAD, HT),
                                teacher_weight=wt, divergence="forward_kl", tp_group=ctx.group)
    except ValueError as exc:
        ck.true("message", "sharded the same way" in str(exc), str(exc))
    else:
        ck.true("refused", False, "no error")
    ck.done()


def _named(fns):
    return [(fn.__name__[len("case_"):], fn) for fn in fns]


def pre_init_cases():
    return []


def cases_for(world: int):
    return _named([case_distill_every_divergence, case_distill_bfloat16_student, case_distill_triton_interpreted,
                   case_distill_shards_differ])
