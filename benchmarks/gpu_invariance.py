"""Batch invariance and determinism of the triton backend on one CUDA GPU, and the forward's speed.

    PYTHONPATH=src python3 benchmarks/gpu_invariance.py [--sections inv,time] [--label NAME] [--out DIR]
                                                        [--million] [--shapes A,B]

1. ``inv``: a reference batch of R = 4096 tokens (bf16, H = 4096, V = 151936, labels drawn from the softmax) is
   scored alone; then each case scores the same tokens inside another batch and compares a token's log-prob and
   entropy with its reference bits. Printed per case: the largest absolute difference and the share of tokens
   whose bits differ (log-prob, entropy); all must be 0. Cases: one token a call, batches of R + 1, R + 7,
   40000 and (--million) 1048576 tokens with the reference tokens at random places, a permutation, half and 37%
   of the other rows ignored, a per-token temperature tensor of ones, token chunks of the forward workspace,
   ``fused_policy_loss`` on a batch with ignored rows, the entropy-free call's log-prob, the Triton and Gluon
   forward kernels (LOGITLESS_TRITON_FWD_KERNEL), the pointer-load path (LOGITLESS_TRITON_TMA=0), run to run;
   and a fixed batch's gradients run to run.
   ``policy``: ``fused_policy_loss`` (with gradients) on each of its routes (the triton terms kernel, the torch
   terms of rejection masks and current_is, token chunks cut at sequence boundaries for sequence-coupled losses,
   the two passes of a batch-coupled one) against ``fused_logprobs``' bits; a scalar temperature against a float64
   tensor of the same value.
2. ``time``: at the README shapes (A 16384 x 4096 x 151936, B 8192 x 4096 x 131072), the cuBLAS floor (1 GEMM
   forward, 4 GEMMs forward+backward) and ``fused_logprobs`` (triton, with entropy) in rounds that alternate the
   variants: the default, and LOGITLESS_TRITON_FWD_KERNEL=triton (the Triton tile kernel, the forward of the
   code before the Gluon forward). Medians of all rounds; ratio = variant / floor.
3. ``chunked``: the chunked backend's cases under each LOGITLESS_CHUNKED_COLUMNS rule of --columns ("batch": the
   vocabulary chunk is budget / N columns wide, CUDA's default; "fixed": the same columns for every batch): run to
   run, calls of 1 and of 16 tokens, batches of R + 7, 3R and 40000 (token chunks), a permutation, 50% and 37% of
   the other rows ignored; then what is left under fixed columns, separated: cuBLAS's float32 logits of the same
   rows in products of other shapes, and torch's row sums of the same rows among other row counts.
   ``chunked_time``: fused_logprobs (chunked, with entropy) forward and forward+backward under each rule against
   the cuBLAS floor at --chunked-shapes (A, B and S 1024 x 4096 x 151936), alternating rounds, medians. Both
   sections end with a table, one column per rule:

    PYTHONPATH=src python3 benchmarks/gpu_invariance.py --label chunked-columns --sections chunked,chunked_time

Run it once per code version (``--label``); the numbers are written to DIR/gpu_invariance-<label>.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

from logitless import fused_logprobs
from logitless.tools.common import GemmFloor, random_head, sample_labels

H, V, R = 4096, 151936, 4096
SHAPES = {"A": (16384, 4096, 151936), "B": (8192, 4096, 131072), "S": (1024, 4096, 151936)}
RESULTS: dict = {"inv": [], "time": {}, "chunked_parts": [], "chunked_time": {}}


def log(*a):
    print(*a, flush=True)


class Env:
    """LOGITLESS_* knobs (read at call time) set for a block, restored after."""

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update({k: str(v) for k, v in self.values.items()})

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def score(hidden, weight, labels, **kw):
    with torch.no_grad():
        lp, ent = fused_logprobs(hidden, weight, labels, with_entropy=kw.pop("with_entropy", True),
                                 backend="triton", **kw)
    return lp, ent


def compare(name, lp, ent, lp0, ent0):
    row = {"case": name, "tokens": lp0.numel()}
    for key, a, b in (("lp", lp, lp0), ("ent", ent, ent0)):
        if a is None:
            row[key + "_max"] = row[key + "_share"] = None
            continue
        diff = (a.double() - b.double()).abs()
        row[key + "_max"] = diff.max().item()
        row[key + "_share"] = (a.view(torch.int32) != b.view(torch.int32)).double().mean().item()
    RESULTS["inv"].append(row)
    log(f"  {name:44s} lp max {_g(row['lp_max']):>9} share {_g(row['lp_share']):>9}   "
        f"ent max {_g(row['ent_max']):>9} share {_g(row['ent_share']):>9}")


def _g(x) -> str:
    """3 significant digits with the exponent (a fixed-width cut of repr dropped it), or None."""
    return "None" if x is None else f"{x:.3g}"


def embed(g, hidden, labels, n_total, dev):
    """A batch of n_total rows holding the reference rows at random places (the rest fresh random rows with
    random labels); returns (hidden, labels, where)."""
    n = hidden.shape[0]
    big_h = torch.randn(n_total, H, device=dev, generator=g).to(hidden.dtype)
    big_y = torch.randint(0, V, (n_total,), device=dev, generator=g)
    where = torch.randperm(n_total, device=dev, generator=g)[:n]
    big_h[where] = hidden
    big_y[where] = labels
    return big_h, big_y, where


def invariance(dev, million: bool):
    g = torch.Generator(device=dev).manual_seed(1234)
    hidden, weight = random_head(R, H, V, torch.bfloat16, dev, g)
    labels = sample_labels(hidden, weight, 1.0, g)
    lp0, ent0 = score(hidden, weight, labels)
    log("invariance: reference batch of", R, "tokens; case / largest |difference| / share of tokens not bit-equal")

    lp, ent = score(hidden, weight, labels)
    compare("run to run", lp, ent, lp0, ent0)

    k = min(64, R)
    one = [score(hidden[i:i + 1], weight, labels[i:i + 1]) for i in range(k)]
    compare(f"one token a call (first {k})", torch.cat([o[0] for o in one]), torch.cat([o[1] for o in one]),
            lp0[:k], ent0[:k])

    sizes = [R + 1, R + 7, 40000 if R == 4096 else 3 * R + 5] + ([1 << 20] if million else [])
    for n_total in sizes:
        bh, by, where = embed(g, hidden, labels, n_total, dev)
        lp, ent = score(bh, weight, by)
        compare(f"in a batch of {n_total}", lp[where], ent[where], lp0, ent0)
        del bh, by, lp, ent

    perm = torch.randperm(R, device=dev, generator=g)
    lp, ent = score(hidden[perm], weight, labels[perm])
    inv = torch.argsort(perm)
    compare("permuted", lp[inv], ent[inv], lp0, ent0)

    for share, name in ((0.5, "half of the other rows ignored"), (0.37, "37% of the other rows ignored")):
        n_total = int(R / (1 - share))
        bh, by, where = embed(g, hidden, labels, n_total, dev)
        ignored = torch.ones(n_total, dtype=torch.bool, device=dev)
        ignored[where] = False
        by = torch.where(ignored, torch.full_like(by, -100), by)
        lp, ent = score(bh, weight, by)
        compare(name, lp[where], ent[where], lp0, ent0)

    lp, ent = score(hidden, weight, labels, temperature=torch.ones(R, device=dev))
    compare("per-token temperature tensor of ones", lp, ent, lp0, ent0)

    for budget in (1 << 20, 5 << 20):
        with Env(LOGITLESS_TRITON_STATS_BYTES=budget):
            lp, ent = score(hidden, weight, labels)
        compare(f"forward token chunks ({budget >> 20} MiB statistics)", lp, ent, lp0, ent0)

    lp, _ = score(hidden, weight, labels, with_entropy=False)
    compare("with_entropy=False (log-prob)", lp, None, lp0, ent0)

    for knob, value in (("LOGITLESS_TRITON_FWD_KERNEL", "triton"), ("LOGITLESS_TRITON_TMA", "0")):
        with Env(**{knob: value}):
            lp, ent = score(hidden, weight, labels)
        compare(f"{knob}={value}", lp, ent, lp0, ent0)

    try:
        from logitless.losses import fused_policy_loss
        n_total = 2 * R + 123
        bh, by, where = embed(g, hidden, labels, n_total, dev)
        ignored = torch.ones(n_total, dtype=torch.bool, device=dev)
        ignored[where] = False
        by = torch.where(ignored, torch.full_like(by, -100), by)
        adv = torch.randn(n_total, device=dev, generator=g)
        bh.requires_grad_(True)
        out = fused_policy_loss(bh, weight, by, adv, entropy_coef=0.01, backend="triton")
        compare("fused_policy_loss, ignored rows", out.logprobs[where].detach(), out.entropy[where].detach(),
                lp0, ent0)
        del out, bh
    except Exception as exc:  # noqa: BLE001 - report and go on
        log("  fused_policy_loss case failed:", repr(exc)[:300])

    # a fixed batch's gradients, run to run (ignored rows among them)
    n_total = 2 * R + 77
    bh, by, where = embed(g, hidden, labels, n_total, dev)
    by[::3] = -100
    a = torch.randn(n_total, device=dev, generator=g)
    b = torch.randn(n_total, device=dev, generator=g)
    grads = []
    for _ in range(2):
        h = bh.detach().clone().requires_grad_(True)
        w = weight.detach().clone().requires_grad_(True)
        lp, ent = fused_logprobs(h, w, by, with_entropy=True, backend="triton")
        ((a * lp).sum() + (b * ent).sum()).backward()
        grads.append((h.grad, w.grad))
    same = [torch.equal(x, y) for x, y in zip(grads[0], grads[1], strict=True)]
    RESULTS["inv"].append({"case": "gradients run to run", "d_hidden_equal": same[0], "d_weight_equal": same[1]})
    log(f"  gradients run to run: d_hidden bit-equal {same[0]}, d_weight bit-equal {same[1]}")


def timed_rounds(variants: dict, rounds: int, reps: int):
    """Median ms of each variant over rounds x reps calls, the variants alternating within every round."""
    times = {k: [] for k in variants}
    cuda = torch.cuda.is_available()
    for fn in variants.values():     # warm-up: compilation, autotuning, allocator
        fn()
        fn()
    if cuda:
        torch.cuda.synchronize()
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            for _ in range(reps):
                if not cuda:     # the CPU dry run (--small)
                    t = time.perf_counter()
                    variants[name]()
                    times[name].append((time.perf_counter() - t) * 1e3)
                    continue
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                variants[name]()
                e.record()
                torch.cuda.synchronize()
                times[name].append(s.elapsed_time(e))
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}, times


# fused_logprobs variants timed against the floor: (LOGITLESS_* knobs, stages of the Gluon forward's ring or None)
VARIANTS = {
    "default": ({}, None),
    "triton_fwd_kernel": ({"LOGITLESS_TRITON_FWD_KERNEL": "triton"}, None),
    "gluon_fwd_5_stages": ({}, 5),
    "dlogits_2^27": ({"LOGITLESS_TRITON_DLOGITS_ELEMENTS": str(1 << 27)}, None),
}


def _variant(fn, env: dict, ring):
    def run():
        from logitless.ops.triton import stages
        # the Gluon forward's ring depth through the benchmarks' stable surface, restored after
        depth = stages.launch("gluon_stats", FWD_STAGES=ring) if ring is not None else contextlib.nullcontext()
        with depth, Env(**env):
            fn()
    return run


def timing_inputs(dev, n: int, h: int, v: int):
    """A timing shape's head (bf16), labels drawn from its softmax, the two per-token weights of the backward's
    loss (a . lp + b . entropy), and leaf copies of hidden and weight for the backward."""
    g = torch.Generator(device=dev).manual_seed(7)
    hidden, weight = random_head(n, h, v, torch.bfloat16, dev, g)
    labels = sample_labels(hidden, weight, 1.0, g)
    a = torch.randn(n, device=dev, generator=g)
    b = torch.randn(n, device=dev, generator=g)
    return (hidden, weight, labels, a, b, hidden.detach().clone().requires_grad_(True),
            weight.detach().clone().requires_grad_(True))


def time_shape(dev, tag: str, rounds: int, variants: list):
    n, h, v = SHAPES[tag]
    hidden, weight, labels, a, b, hg, wg = timing_inputs(dev, n, h, v)
    floor = GemmFloor(hidden, weight)

    def fwd():
        with torch.no_grad():
            fused_logprobs(hidden, weight, labels, with_entropy=True, backend="triton")

    def step():
        hg.grad = wg.grad = None
        lp, ent = fused_logprobs(hg, wg, labels, with_entropy=True, backend="triton")
        ((a * lp).sum() + (b * ent).sum()).backward()

    fwd_variants = {k: _variant(fwd, *VARIANTS[k]) for k in variants if not k.startswith("dlogits")}
    med_f, raw_f = timed_rounds({"floor": floor.forward, **fwd_variants}, rounds, 3)
    med_b, raw_b = timed_rounds({"floor": floor.forward_backward,
                                 **{k: _variant(step, *VARIANTS[k]) for k in variants}}, rounds, 2)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fwd()
    torch.cuda.synchronize()
    peak_fwd = torch.cuda.max_memory_allocated() - base
    floor.close()
    RESULTS["time"][tag] = {"fwd_ms": med_f, "fwdbwd_ms": med_b, "fwd_raw": raw_f, "fwdbwd_raw": raw_b,
                            "fwd_peak_extra_mib": peak_fwd / 2 ** 20}
    log(f"time {tag} (N={n}, H={h}, V={v}): floor fwd {med_f['floor']:.2f} ms, 4-GEMM {med_b['floor']:.2f} ms; "
        f"fwd peak extra {peak_fwd / 2 ** 20:.1f} MiB")
    for k in variants:
        f = f"fwd {med_f[k]:.2f} ms = {med_f[k] / med_f['floor']:.3f}x" if k in med_f else "fwd -"
        log(f"  {k:20s} {f:28s} fwd+bwd {med_b[k]:.2f} ms = {med_b[k] / med_b['floor']:.3f}x")


def chunked_cases(dev, rule: str):
    """The chunked backend under one LOGITLESS_CHUNKED_COLUMNS rule ("batch": the vocabulary chunk is budget / N
    columns wide; "fixed": the same columns for every batch): which cases hold. No guarantee either way: cuBLAS
    picks its kernels by shape, torch's row reductions their thread layout by the number of rows."""
    g = torch.Generator(device=dev).manual_seed(99)
    hidden, weight = random_head(R, H, V, torch.bfloat16, dev, g)
    labels = sample_labels(hidden, weight, 1.0, g)
    tag = f"chunked[{rule}]"

    def sc(hh, yy):
        with torch.no_grad(), Env(LOGITLESS_CHUNKED_COLUMNS=rule):
            return fused_logprobs(hh, weight, yy, with_entropy=True, backend="chunked")

    lp0, ent0 = sc(hidden, labels)
    log(f"{tag}: case / largest |difference| / share of tokens not bit-equal")
    lp, ent = sc(hidden, labels)
    compare(f"{tag}: run to run", lp, ent, lp0, ent0)
    for size in (1, 16):
        parts = [sc(hidden[i:i + size], labels[i:i + size]) for i in range(0, 64, size)]
        compare(f"{tag}: calls of {size} token(s) (first 64)", torch.cat([o[0] for o in parts]),
                torch.cat([o[1] for o in parts]), lp0[:64], ent0[:64])
    for n_total in (R + 7, 3 * R, 40000 if R == 4096 else 3 * R + 5):    # 40000: token chunks of 16384
        bh, by, where = embed(g, hidden, labels, n_total, dev)
        lp, ent = sc(bh, by)
        compare(f"{tag}: in a batch of {n_total}", lp[where], ent[where], lp0, ent0)
        del bh, by, lp, ent
    perm = torch.randperm(R, device=dev, generator=g)
    lp, ent = sc(hidden[perm], labels[perm])
    compare(f"{tag}: permuted", lp[torch.argsort(perm)], ent[torch.argsort(perm)], lp0, ent0)
    for share in (0.5, 0.37):
        n_total = int(R / (1 - share))
        bh, by, where = embed(g, hidden, labels, n_total, dev)
        ignored = torch.ones(n_total, dtype=torch.bool, device=dev)
        ignored[where] = False
        lp, ent = sc(bh, torch.where(ignored, torch.full_like(by, -100), by))
        compare(f"{tag}: {share:.0%} of the other rows ignored", lp[where], ent[where], lp0, ent0)


def _bits(name, a, b):
    """Largest |a - b| and the share of float32 elements not bit-equal, logged and kept."""
    row = {"case": name, "max": (a.double() - b.double()).abs().max().item(),
           "share": (a.view(torch.int32) != b.view(torch.int32)).double().mean().item()}
    RESULTS["chunked_parts"].append(row)
    log(f"  {name:58s} max {row['max']:.3g} share {row['share']:.4f}")


def chunked_parts(dev):
    """What is left under fixed columns, separated: (1) cuBLAS, the float32 logits of the reference tokens against
    the first 1024 vocabulary rows (one fixed chunk) computed in products of other row counts, and in a 4096-column
    product (the "batch" chunk at 4096 tokens); (2) torch's row sums (the online logsumexp's reductions) of the same
    float32 rows [n, 1024] among other row counts."""
    from logitless.ops.chunked import MIN_COLUMNS
    from logitless.ops.maths import mm_fp32
    g = torch.Generator(device=dev).manual_seed(5)
    hidden, weight = random_head(R, H, V, torch.bfloat16, dev, g)
    w = weight[:MIN_COLUMNS]
    with torch.no_grad():
        z0 = mm_fp32(hidden, w.t())
        log(f"chunked parts: the reference's [{R}, {MIN_COLUMNS}] float32 logits / their row sums; "
            "largest |difference| / share of elements not bit-equal")
        for size in (1, 7, 16):
            z = torch.cat([mm_fp32(hidden[i:i + size], w.t()) for i in range(0, 64, size)])[:64]
            _bits(f"cuBLAS logits: products of {size} row(s) (first 64)", z, z0[:64])
        for n_total in (R + 7, 3 * R):
            bh, _, where = embed(g, hidden, torch.zeros(R, dtype=torch.long, device=dev), n_total, dev)
            _bits(f"cuBLAS logits: in a product of {n_total} rows", mm_fp32(bh, w.t())[where], z0)
        wide = mm_fp32(hidden, weight[:4 * MIN_COLUMNS].t())[:, :MIN_COLUMNS]
        _bits(f"cuBLAS logits: columns 0-{MIN_COLUMNS - 1} of a {4 * MIN_COLUMNS}-column product", wide, z0)
        e0 = (z0 - z0.amax(dim=1, keepdim=True)).exp()
        s0 = e0.sum(dim=1)
        for size in (1, 7, 16):
            s = torch.cat([e0[i:i + size].sum(dim=1) for i in range(0, 64, size)])[:64]
            _bits(f"torch row sums: {size} row(s) a call (first 64)", s, s0[:64])
        for n_total in (R + 7, 3 * R):
            big = torch.rand(n_total, MIN_COLUMNS, device=dev, generator=g)
            where = torch.randperm(n_total, device=dev, generator=g)[:R]
            big[where] = e0
            _bits(f"torch row sums: among {n_total} rows", big.sum(dim=1)[where], s0)


def chunked_time(dev, tag: str, rounds: int, rules: list):
    """fused_logprobs (chunked, with entropy) forward and forward+backward under each column rule against the
    cuBLAS floor, in rounds that alternate them (medians); the forward's peak extra memory per rule."""
    n, h, v = SHAPES[tag]
    hidden, weight, labels, a, b, hg, wg = timing_inputs(dev, n, h, v)
    floor = GemmFloor(hidden, weight)

    def fwd(rule):
        def run():
            with torch.no_grad(), Env(LOGITLESS_CHUNKED_COLUMNS=rule):
                fused_logprobs(hidden, weight, labels, with_entropy=True, backend="chunked")
        return run

    def step(rule):
        def run():
            hg.grad = wg.grad = None
            with Env(LOGITLESS_CHUNKED_COLUMNS=rule):
                lp, ent = fused_logprobs(hg, wg, labels, with_entropy=True, backend="chunked")
                ((a * lp).sum() + (b * ent).sum()).backward()
        return run

    med_f, raw_f = timed_rounds({"floor": floor.forward, **{r: fwd(r) for r in rules}}, rounds, 3)
    med_b, raw_b = timed_rounds({"floor": floor.forward_backward, **{r: step(r) for r in rules}}, rounds, 2)
    floor.close()
    peaks = {}
    if dev.type == "cuda":
        for r in rules:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd(r)()
            torch.cuda.synchronize()
            peaks[r] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    RESULTS["chunked_time"][tag] = {"shape": [n, h, v], "fwd_ms": med_f, "fwdbwd_ms": med_b, "fwd_raw": raw_f,
                                    "fwdbwd_raw": raw_b, "fwd_peak_extra_mib": peaks}


def chunked_summary(rules: list):
    """The chunked cases and timings, one column per rule: log-prob / entropy share of tokens not bit-equal."""
    rows: dict = {}
    for row in RESULTS["inv"]:
        if row["case"].startswith("chunked["):
            rule, case = row["case"][len("chunked["):].split("]: ", 1)
            rows.setdefault(case, {})[rule] = f"{row['lp_share']:.3f} / {row['ent_share']:.3f}"
    if rows:
        log("\nchunked backend, share of tokens not bit-equal (log-prob / entropy):")
        log(f"  {'case':44s}" + "".join(f"{r:>18s}" for r in rules))
        for case, by_rule in rows.items():
            log(f"  {case:44s}" + "".join(f"{by_rule.get(r, '-'):>18s}" for r in rules))
    if RESULTS["chunked_time"]:
        log("\nchunked backend timing, medians in ms (x the cuBLAS floor: 1 GEMM fwd, 4 GEMMs fwd+bwd):")
        for tag, t in RESULTS["chunked_time"].items():
            f, b = t["fwd_ms"], t["fwdbwd_ms"]
            cells = "".join(f"  {r}: fwd {f[r]:.2f} ({f[r] / f['floor']:.3f}x) fwd+bwd {b[r]:.2f} "
                            f"({b[r] / b['floor']:.3f}x)" for r in rules)
            log(f"  {tag} {'x'.join(map(str, t['shape']))}: floor {f['floor']:.2f} / {b['floor']:.2f}{cells}")
            if len(rules) == 2:
                log(f"    {rules[1]} / {rules[0]}: fwd {f[rules[1]] / f[rules[0]]:.3f}, "
                    f"fwd+bwd {b[rules[1]] / b[rules[0]]:.3f}; fwd peak extra MiB {t['fwd_peak_extra_mib']}")


# fused_policy_loss's routes (losses/api.py), each of which must give fused_logprobs' bits
POLICY_ROUTES = {
    "token-local, triton terms kernel": dict(entropy_coef=0.01),
    "token-local, check_inputs=False (every row computed)": dict(entropy_coef=0.01, check_inputs=False),
    "rejection mask (torch terms)": dict(rejection_k2_max=0.05, entropy_coef=0.01),
    "current_is token (torch terms)": dict(surrogate="gpg", current_is="token_truncate", current_is_max=1.5),
    "sequence-level ratio (chunks at sequence boundaries)": dict(ratio_level="sequence",
                                                                 loss_agg="seq-mean-token-mean"),
    "sequence rejection (chunks at sequence boundaries)": dict(rejection_seq_mean_k2_max=0.2),
    "entropy mask (two passes)": dict(entropy_quantile=0.5, entropy_coef=0.01),
}


def policy_routes(dev):
    """fused_policy_loss on each of its routes, twice with gradients (run to run): the reference tokens at random
    places among 5 sequences (20% of the other rows ignored), compared with fused_logprobs' bits for them alone.
    The sequence-coupled routes cut the pass's token chunks at sequence boundaries, off the token tiles
    (asserted on CPU by tests/ops/test_batch_invariance.py).
    Then a scalar temperature of 1.1 against a float64 per-token tensor of 1.1."""
    from logitless.losses import fused_policy_loss
    g = torch.Generator(device=dev).manual_seed(4321)
    hidden, weight = random_head(R, H, V, torch.bfloat16, dev, g)
    labels = sample_labels(hidden, weight, 1.0, g)
    lp0, ent0 = score(hidden, weight, labels)
    b = 5
    s = -(-(2 * R + 123) // b)
    bh, by, where = embed(g, hidden, labels, b * s, dev)
    others = torch.ones(b * s, dtype=torch.bool, device=dev)
    others[where] = False
    drop = others & (torch.rand(b * s, device=dev, generator=g) < 0.2)
    by = torch.where(drop, torch.full_like(by, -100), by)
    lp_big, _ = score(bh, weight, by)
    old = lp_big + 0.05 * torch.randn(b * s, device=dev, generator=g)
    adv = torch.randn(b, 1, device=dev, generator=g).expand(b, s)
    log("policy routes: fused_policy_loss's log-prob / entropy against fused_logprobs alone "
        f"({R} tokens among {b} x {s} rows)")
    for route, settings in POLICY_ROUTES.items():
        try:
            grads = []
            for _ in range(2):
                h = bh.detach().clone().view(b, s, H).requires_grad_(True)
                w = weight.detach().clone().requires_grad_(True)
                out = fused_policy_loss(h, w, by.view(b, s), adv, old.view(b, s), backend="triton", **settings)
                out.loss.backward()
                grads.append((h.grad, w.grad))
            compare(f"policy: {route}", out.logprobs.reshape(-1)[where], out.entropy.reshape(-1)[where],
                    lp0, ent0)
            same = [torch.equal(x, y) for x, y in zip(grads[0], grads[1], strict=True)]
            RESULTS["inv"].append({"case": f"policy: {route}: gradients run to run", "d_hidden_equal": same[0],
                                   "d_weight_equal": same[1]})
            log(f"    gradients run to run: d_hidden bit-equal {same[0]}, d_weight bit-equal {same[1]}")
            del out, h, w, grads
        except Exception as exc:  # noqa: BLE001 - report and go on
            log(f"  policy: {route} failed:", repr(exc)[:300])
    lp1, ent1 = score(hidden, weight, labels, temperature=1.1)
    lp, ent = score(hidden, weight, labels, temperature=torch.full((R,), 1.1, dtype=torch.float64, device=dev))
    compare("temperature 1.1: float64 tensor against the scalar", lp, ent, lp1, ent1)
    lp, ent = score(hidden, weight, labels, temperature=torch.full((R,), 1.1, device=dev))
    compare("temperature 1.1: float32 tensor (1.10000002) against the scalar (no promise)", lp, ent, lp1, ent1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="inv,time",
                   help="inv, policy, chunked (+ chunked_parts), chunked_parts, chunked_time, time")
    p.add_argument("--label", default="this")
    p.add_argument("--out", default=".")
    p.add_argument("--million", action="store_true")
    p.add_argument("--shapes", default="A,B")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--variants", default="default,triton_fwd_kernel")
    p.add_argument("--columns", default="batch,fixed", help="chunked sections: LOGITLESS_CHUNKED_COLUMNS rules")
    p.add_argument("--chunked-shapes", default="A,B,S")
    p.add_argument("--small", action="store_true", help="CPU dry run under TRITON_INTERPRET=1: tiny shapes")
    args = p.parse_args()
    global H, V, R
    if args.small:
        H, V, R = 96, 1031, 24
        SHAPES.update(A=(64, 96, 1031), B=(40, 96, 1024), S=(8, 96, 1031))
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import triton
    RESULTS["env"] = {"torch": torch.__version__, "triton": triton.__version__, "python": sys.version.split()[0],
                      "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "label": args.label}
    log("env", RESULTS["env"])
    t0 = time.time()
    sections = args.sections.split(",")
    if "inv" in sections:
        invariance(dev, args.million)
        log(f"invariance section: {time.time() - t0:.0f} s")
    if "policy" in sections:
        policy_routes(dev)
        log(f"policy section: {time.time() - t0:.0f} s")
    rules = args.columns.split(",")
    if "chunked" in sections:
        for rule in rules:
            chunked_cases(dev, rule)
        log(f"chunked section: {time.time() - t0:.0f} s")
    if "chunked" in sections or "chunked_parts" in sections:
        chunked_parts(dev)
        log(f"chunked_parts section: {time.time() - t0:.0f} s")
    if "chunked_time" in sections:
        for tag in args.chunked_shapes.split(","):
            chunked_time(dev, tag, args.rounds, rules)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        log(f"chunked_time section: {time.time() - t0:.0f} s")
    chunked_summary(rules)
    if "time" in sections:
        for tag in args.shapes.split(","):
            time_shape(dev, tag, args.rounds, args.variants.split(","))
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"gpu_invariance-{args.label}.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    log(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
