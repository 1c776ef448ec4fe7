"""The public ops' calls whose kernel launches ``sm90_launches`` records: every dtype, precision, compile-time switch
and loss setting that changes which kernel runs or how it is specialised, forward and backward, on small shapes."""
from __future__ import annotations

import contextlib
import sys
import time

import torch

import logitless
from logitless import Truncation
from logitless.losses import PolicyLoss, fused_distillation_loss, fused_policy_loss, policy_loss
from logitless.tools.common import env_set

N, K = 7, 3
SMALL = dict(H=96, V=1031, H_TEACHER=64)
# a model's head, whose sizes set some compile-time constants (the combine's block of 512 tiles, the distillation's
# spans of 8192 columns, an even K loop): these calls are recorded, not run (the interpreter would take minutes)
MODEL = dict(H=128, V=151936, H_TEACHER=192)
DIMS = dict(SMALL)
G = torch.Generator().manual_seed(0)


def head(dtype, h=None, layout="rows", lead=(N,)):
    h = h or DIMS["H"]
    hidden = torch.randn(*lead, h, generator=G)
    if layout == "columns":    # unit stride along the tokens: no bulk-copy descriptor, the pointer-load path
        hidden = hidden.reshape(-1, h).t().contiguous().t().reshape(*lead, h)
    weight = torch.randn(DIMS["V"], h, generator=G) / h ** 0.5
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()


def labels(lead=(N,), k=None):
    if k is None:
        return torch.randint(0, DIMS["V"], lead, generator=G)
    return torch.stack([torch.randperm(DIMS["V"], generator=G)[:k] for _ in range(int(torch.tensor(lead).prod()))]
                       ).reshape(*lead, k)


def logprobs_cases():
    """fused_logprobs: forward statistics (Gluon or Triton), combine, backward dlogits; k labels; the split."""
    yield "bf16", dict(dtype=torch.bfloat16)
    yield "bf16 no entropy", dict(dtype=torch.bfloat16, with_entropy=False)
    yield "bf16 softcap", dict(dtype=torch.bfloat16, softcap=30.0)
    yield "bf16 softcap no entropy", dict(dtype=torch.bfloat16, softcap=30.0, with_entropy=False)
    yield "bf16 per-token temperature", dict(dtype=torch.bfloat16, temperature=torch.rand(N, generator=G) + 0.5)
    yield "bf16 column-major hidden", dict(dtype=torch.bfloat16, layout="columns")
    yield "bf16 k labels", dict(dtype=torch.bfloat16, k=K)
    yield "fp16", dict(dtype=torch.float16)
    for precision, grads in (("ieee", ("ieee",)), ("tf32", (None,)), ("bf16x3", (None, "bf16x3", "ieee")),
                             ("bf16x6", (None, "bf16x6"))):
        for grad in grads:
            yield f"fp32 {precision} grad {grad}", dict(dtype=torch.float32, precision=precision, grad_precision=grad)
    yield "fp32 bf16x3 softcap", dict(dtype=torch.float32, precision="bf16x3", softcap=30.0)
    yield "fp32 bf16x3 k labels", dict(dtype=torch.float32, precision="bf16x3", k=K)
    yield "fp32 ieee k labels", dict(dtype=torch.float32, precision="ieee", k=K)
    yield "fp32 ieee column-major hidden", dict(dtype=torch.float32, precision="ieee", layout="columns")
    # the adaptive split: the detection kernel, and the products split in registers (bf16x2 / bf16x2w / bf16x3)
    for exact in (None, "hidden", "weight", "both"):
        yield f"fp32 split exact {exact}", dict(dtype=torch.float32, precision="split", exact=exact)
    yield "fp32 split exact hidden softcap", dict(dtype=torch.float32, precision="split", exact="hidden",
                                                  softcap=30.0)
    yield "fp32 split column-major hidden", dict(dtype=torch.float32, precision="split", layout="columns")


def run_logprobs(dtype, layout="rows", k=None, exact=None, **kw):
    hidden, weight = head(dtype, layout=layout)
    with torch.no_grad():   # operands that hold bfloat16 values only (the split's fewer products)
        if exact in ("hidden", "both"):
            hidden.copy_(hidden.bfloat16())
        if exact in ("weight", "both"):
            weight.copy_(weight.bfloat16())
    out = logitless.fused_logprobs(hidden, weight, labels(k=k), backend="triton", **kw)
    loss = out.logprobs.sum() + (out.entropy.sum() if out.entropy is not None else 0)
    loss.backward()


def topk_cases():
    """fused_topk through the selection kernels (candidates, finish; one candidate a tile forces the exact second
    pass with C >= k), softcap, float32 operands; k 32, 128 and 2048 (the fast path's limit) on the model-sized head."""
    yield "topk bf16", dict(dtype=torch.bfloat16)
    yield "topk bf16 softcap", dict(dtype=torch.bfloat16, softcap=30.0)
    yield "topk bf16 one candidate a tile", dict(dtype=torch.bfloat16, candidates=1)
    yield "topk bf16 eight candidates a tile", dict(dtype=torch.bfloat16, candidates=8)
    yield "topk fp32 bf16x3", dict(dtype=torch.float32, precision="bf16x3")
    yield "topk fp32 ieee", dict(dtype=torch.float32, precision="ieee")
    # the backward's tail dlogits kernel: without the tail's gradient, fp16 dlogits, pointer loads, the products
    # split in registers (bf16x2 / bf16x2w; bf16x3 above)
    yield "topk bf16 log-probs only", dict(dtype=torch.bfloat16, tail=False)
    yield "topk fp16", dict(dtype=torch.float16)
    yield "topk bf16 column-major hidden", dict(dtype=torch.bfloat16, layout="columns")
    for exact in ("hidden", "weight"):
        yield f"topk fp32 split exact {exact}", dict(dtype=torch.float32, precision="split", exact=exact)


def run_topk(dtype, k=K, candidates=None, tail=True, layout="rows", exact=None, **kw):
    hidden, weight = head(dtype, layout=layout)
    with torch.no_grad():   # operands that hold bfloat16 values only (the split's fewer products)
        if exact == "hidden":
            hidden.copy_(hidden.bfloat16())
        if exact == "weight":
            weight.copy_(weight.bfloat16())
    with contextlib.nullcontext() if candidates is None else env_set(LOGITLESS_TOPK_CANDIDATES=str(candidates)):
        out = logitless.fused_topk(hidden, weight, k, backend="triton", **kw)
    (out.logprobs.sum() + (out.tail_logprob.sum() if tail else 0)).backward()


def policy_cases():
    """fused_policy_loss: the fused pass (statistics with e, combine, the terms kernel's switches, dlogits in place,
    the upstream scale), the coupled losses' two passes, statistics only."""
    yield "ppo", dict()
    yield "ppo on-policy", dict(on_policy=True)
    for kl_type in ("k1", "k2", "k3", "abs", "k3_unclamped", "k1+", "k3+"):
        yield f"ppo kl {kl_type}", dict(ref=True, kl_coef=0.1, kl_type=kl_type, entropy_coef=0.01, dual_clip=3.0)
    yield "ppo ref without kl", dict(ref=True)
    yield "ppo trl", dict(ref=True, kl_coef=0.1, kl_type="k3_unclamped", kl_ratio=True, delta=2.0,
                          ratio_log_clamp=None, rollout=True, rollout_is="token_truncate", rollout_is_max=2.0,
                          entropy_coef=0.01, entropy_agg="token-sum")
    yield "ppo kl weights", dict(ref=True, kl_coef=0.1, kl_agg="token-sum", entropy_coef=0.01)
    yield "ppo rollout weights", dict(rollout_weights=True)
    for surrogate, extra in (("cispo", {}), ("sapo", {}), ("gpg", {}), ("dro", dict(dro_beta=0.1)), ("vespo", {}),
                             ("dppo_tv", {}), ("dppo_kl", {}), ("geo_mean", {}), ("clip_cov", {}), ("kl_cov", {})):
        yield f"surrogate {surrogate}", dict(surrogate=surrogate, **extra)
    yield "ratio sequence", dict(ratio_level="sequence")
    yield "loss_agg seq-mean-token-mean", dict(loss_agg="seq-mean-token-mean")
    yield "softcap", dict(softcap=30.0)
    yield "no grad", dict(no_grad=True)
    yield "unchecked", dict(check_inputs=False)
    yield "upstream gradient 2", dict(upstream=2.0)
    yield "fp16", dict(dtype=torch.float16)
    yield "column-major hidden", dict(layout="columns", check_inputs=False)   # no gather of the scored rows
    for precision in ("ieee", "tf32", "bf16x3", "bf16x6"):
        yield f"fp32 {precision}", dict(dtype=torch.float32, precision=precision)
    yield "fp32 bf16x3 grad bf16x3", dict(dtype=torch.float32, precision="bf16x3", grad_precision="bf16x3")
    # the adaptive split: the statistics kernel splits float32 tiles in registers (bf16x2 / bf16x2w / bf16x3;
    # bf16x1 runs the bfloat16 path's kernels on bfloat16 copies)
    for exact in (None, "hidden", "weight", "both"):
        yield f"fp32 split exact {exact}", dict(dtype=torch.float32, precision="split", exact=exact)
    yield "fp32 split no grad", dict(dtype=torch.float32, precision="split", no_grad=True)


def run_policy(dtype=torch.bfloat16, on_policy=False, ref=False, rollout=False, rollout_weights=False,
               no_grad=False, upstream=1.0, softcap=None, layout="rows", exact=None, **kw):
    lead = (2, N)
    hidden, weight = head(dtype, lead=lead, layout=layout)
    with torch.no_grad():   # operands that hold bfloat16 values only (the split's fewer products)
        if exact in ("hidden", "both"):
            hidden.copy_(hidden.bfloat16())
        if exact in ("weight", "both"):
            weight.copy_(weight.bfloat16())
    y = labels(lead)
    y[1, -2:] = -100
    adv = torch.randn(lead, generator=G)
    old = None if on_policy else -torch.rand(lead, generator=G) * 5
    if ref:
        kw["ref_logprobs"] = -torch.rand(lead, generator=G) * 5
    if rollout:
        kw["rollout_logprobs"] = -torch.rand(lead, generator=G) * 5
    if rollout_weights:
        kw["rollout_weights"] = torch.rand(lead, generator=G) + 0.5
    with torch.no_grad() if no_grad else contextlib.nullcontext():
        if softcap is None:
            out = fused_policy_loss(hidden, weight, y, adv, old, backend="triton", **kw)
        else:     # a softcapped head's loss: the statistics pass, then fused_logprobs' backward (four GEMMs)
            out = policy_loss(PolicyLoss(adv, old, **kw), hidden, weight, y, softcap=softcap, backend="triton")
    if not no_grad:
        (out.loss * upstream).backward()


def distill_cases():
    for divergence, beta in (("forward_kl", None), ("reverse_kl", None), ("jsd", 0.3)):
        yield f"{divergence} bf16", dict(divergence=divergence, beta=beta)
    yield "jsd bf16 softcaps and scales", dict(divergence="jsd", beta=0.5, student_softcap=30.0, teacher_softcap=50.0,
                                               student_logit_scale=0.5, teacher_logit_scale=2.0)
    yield "forward_kl bf16 student softcap", dict(divergence="forward_kl", student_softcap=30.0)
    yield "reverse_kl fp32", dict(divergence="reverse_kl", dtype=torch.float32)
    # forward_kl_topk: the one-pass route (the policy pass; its statistics written by the selection kernel with
    # STATS, STORE_E: ``topk_select.select_with_stats``)
    yield "forward_kl_topk bf16", dict(divergence="forward_kl_topk", topk=True)
    yield "forward_kl_topk_tail bf16", dict(divergence="forward_kl_topk_tail", topk=True)
    # the tail's forward: with the overlap, the selection kernel running the given set's epilogue (GIVEN); without,
    # the given-set kernel alone (``given_set``); softcapped, and on float32 operands (IEEE products)
    no_overlap = dict(divergence="forward_kl_topk_tail", topk=True, with_overlap=False)
    yield "forward_kl_topk_tail bf16 no overlap", no_overlap
    yield "forward_kl_topk_tail bf16 student softcap", dict(no_overlap, student_softcap=30.0)
    yield "forward_kl_topk_tail bf16 student softcap overlap", dict(divergence="forward_kl_topk_tail", topk=True,
                                                                    student_softcap=30.0)
    yield "forward_kl_topk_tail fp32", dict(divergence="forward_kl_topk_tail", topk=True, dtype=torch.float32)
    yield "forward_kl_topk_tail fp32 no overlap", dict(no_overlap, dtype=torch.float32)
    yield "forward_kl_topk fp32", dict(divergence="forward_kl_topk", topk=True, dtype=torch.float32)


def run_distill(divergence, dtype=torch.bfloat16, topk=False, **kw):
    hidden, weight = head(dtype)
    if topk:
        ids = labels(k=K)
        kw.update(teacher_topk_ids=ids, teacher_topk_logprobs=torch.log_softmax(torch.randn(N, K, generator=G), -1)
                  - 0.5)
    else:
        t_hidden, t_weight = head(dtype, h=DIMS["H_TEACHER"])
        kw.update(teacher_hidden=t_hidden.detach(), teacher_weight=t_weight.detach())
    out = fused_distillation_loss(hidden, weight, labels(), divergence=divergence, backend="triton", **kw)
    out.loss.backward()


def truncation_cases():
    """fused_logprobs(truncation=): the kept pairs' kernels (products, d_hidden by row, d_weight by id) on each
    operand dtype (the replay form: no selection pass; the settings form's selection kernels are the top-k's)."""
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        yield f"truncation replay {name}", dict(dtype=dtype)
    # the settings form past its first candidates: the wide round's above-threshold kernel (8 candidates first)
    yield "truncation top_p wide bf16", dict(dtype=torch.bfloat16, wide=True)
    yield "truncation top_p wide fp16 softcap", dict(dtype=torch.float16, wide=True, softcap=30.0)


def run_truncation(dtype, wide=False, softcap=None):
    hidden, weight = head(dtype)
    if wide:
        # and the dense backward (the dlogits kernel masked to each kept set: MEMBER) for every token
        with env_set(LOGITLESS_TRUNCATION_CANDIDATES="8", LOGITLESS_TRUNCATION_DENSE_IDS="1"):
            out = logitless.fused_logprobs(hidden, weight, labels(), backend="triton", softcap=softcap,
                                           truncation=Truncation(top_p=0.95, min_p=torch.tensor(
                                               [0.0] * (N - 1) + [0.001])))
            (out.logprobs.sum() + out.entropy.sum()).backward()
        # and the wide round's kernel itself, whatever the selection decided above
        from logitless.ops.triton.above_select import above
        with torch.no_grad():
            above(hidden, weight, torch.ones(N), torch.zeros(N), 16, softcap)
        return
    kept = 8 + torch.stack([torch.randperm(DIMS["V"] - 8, generator=G)[:5] for _ in range(N)])
    kept[1, 3:] = -1
    kept[:, 0] = 7                     # an id every token keeps
    y = labels()
    y[:2] = kept[:2, 1]
    out = logitless.fused_logprobs(hidden, weight, y, backend="triton", truncation=Truncation(kept_ids=kept))
    (out.logprobs.sum() + out.entropy.sum()).backward()


def run_wide_kernels(dtype):
    """The truncation wide round's two kernels called directly (a model-sized drive records launches without
    running them, so the op's own path, which reads the emitted counts, cannot reach them there): the emitting
    pass at its first slots and the nucleus decisions over them."""
    from logitless.ops.triton.above_select import above
    from logitless.ops.triton.nucleus import nucleus
    hidden, weight = head(dtype)
    n = hidden.shape[0]
    with torch.no_grad():
        a = above(hidden, weight, torch.ones(n), torch.zeros(n), 16384, None)
        nucleus(a.values, a.ids, a.count, torch.zeros(n), torch.full((n,), 0.9, dtype=torch.float64),
                torch.full((n,), float("-inf"), dtype=torch.float64), torch.zeros(n, dtype=torch.bool),
                torch.zeros(n, dtype=torch.long))


def _runner(case):
    """run_case(name, run, kw): runs one case, ``case[0]`` naming it (for the record)."""
    def run_case(name, run, kw):
        case[0] = f"{run.__name__[4:]}: {name}"
        start = time.perf_counter()
        run(**kw)
        print(f"{case[0]}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
    return run_case


# the Triton statistics kernels where Gluon would take them on Hopper (LOGITLESS_*_KERNEL=triton)
TRITON_STATS = (("bf16", run_logprobs, dict(dtype=torch.bfloat16)),
                ("bf16 no entropy", run_logprobs, dict(dtype=torch.bfloat16, with_entropy=False)),
                ("fp16", run_logprobs, dict(dtype=torch.float16)),
                ("fp32 bf16x3", run_logprobs, dict(dtype=torch.float32, precision="bf16x3")),
                ("ppo bf16", run_policy, dict()),
                ("ppo fp16", run_policy, dict(dtype=torch.float16)),
                ("ppo no grad", run_policy, dict(no_grad=True)),
                ("ppo fp32 bf16x6", run_policy, dict(dtype=torch.float32, precision="bf16x6")))


def drive(case, record_only):
    """Every case above; ``case[0]`` names the one running (for the record)."""
    run_case = _runner(case)
    for cases, run in ((logprobs_cases, run_logprobs), (topk_cases, run_topk), (policy_cases, run_policy),
                       (distill_cases, run_distill), (truncation_cases, run_truncation)):
        for name, kw in cases():
            run_case(name, run, kw)
    with env_set(LOGITLESS_TRITON_FWD_KERNEL="triton", LOGITLESS_POLICY_STATS_KERNEL="triton"):
        for name, run, kw in TRITON_STATS:
            run_case(f"{name} (Triton statistics kernel)", run, kw)
    model_sized(case, record_only)


def model_sized(case, record_only):
    """A model's head, recorded only (``sm90_model``: these alone, for ptxas' registers and spills)."""
    run_case = _runner(case)
    DIMS.update(MODEL)
    record_only[0] = True
    try:
        for name, run, kw in (("bf16", run_logprobs, dict(dtype=torch.bfloat16)),
                              ("bf16 softcap", run_logprobs, dict(dtype=torch.bfloat16, softcap=30.0)),
                              ("fp32 bf16x3", run_logprobs, dict(dtype=torch.float32, precision="bf16x3")),
                              ("ppo bf16", run_policy, dict()),
                              ("ppo fp16", run_policy, dict(dtype=torch.float16)),
                              ("ppo fp32 bf16x3", run_policy, dict(dtype=torch.float32, precision="bf16x3")),
                              ("ppo fp32 split exact hidden", run_policy,
                               dict(dtype=torch.float32, precision="split", exact="hidden")),
                              ("jsd bf16", run_distill, dict(divergence="jsd", beta=0.5)),
                              ("forward_kl_topk bf16", run_distill, dict(divergence="forward_kl_topk", topk=True)),
                              ("forward_kl_topk_tail bf16", run_distill,
                               dict(divergence="forward_kl_topk_tail", topk=True)),
                              ("forward_kl_topk_tail bf16 no overlap", run_distill,
                               dict(divergence="forward_kl_topk_tail", topk=True, with_overlap=False)),
                              ("topk bf16 k 32", run_topk, dict(dtype=torch.bfloat16, k=32)),
                              ("topk bf16 k 128", run_topk, dict(dtype=torch.bfloat16, k=128)),
                              ("truncation replay bf16", run_truncation, dict(dtype=torch.bfloat16)),
                              ("truncation wide round bf16", run_wide_kernels, dict(dtype=torch.bfloat16)),
                              # the fast path's largest k (a top-p nucleus of ~2000 ids): C 16, 2048 keys a row
                              ("topk bf16 k 2048", run_topk, dict(dtype=torch.bfloat16, k=2048))):
            run_case(f"{name} (model-sized, recorded only)", run, kw)
        with env_set(LOGITLESS_TRITON_FWD_KERNEL="triton", LOGITLESS_POLICY_STATS_KERNEL="triton"):
            for name, run, kw in TRITON_STATS[:1] + TRITON_STATS[4:5]:  # bf16 logprobs, ppo
                run_case(f"{name} (model-sized, recorded only, Triton statistics kernel)", run, kw)
    finally:
        DIMS.update(SMALL)
        record_only[0] = False
