"""The tensor-parallel cases, run inside every rank of a gloo group by tp_harness.

Each case builds the same full inputs on every rank (same seed), gives each rank its shard of the
vocabulary rows (or of the sequence), runs logitless forward and backward across the group and
compares with float64 ground truth computed on the *full* weight (tests/reference64.py).
Checks never stop a case half-way: a rank that failed an early check must still take part in the
collectives that follow, so failures are collected and raised at the end of the case.
"""
from __future__ import annotations

import gc
import os
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from logitless import fused_logprobs, last_backend, last_precision, parallel
from logitless.losses import fused_policy_loss
from logitless.parallel import (
    VocabParallel,
    gather_sequence,
    next_token_labels,
    next_token_labels_sharded,
    scatter_sequence,
)
from reference64 import logprobs_entropy64, rel_err

TOL = {torch.float32: (2e-5, 2e-5, 1e-4), torch.bfloat16: (1e-3, 2e-3, 1e-2)}  # logprob, entropy, grads
CPU_BACKENDS = ("chunked", "reference")
# the bf16x3 split's log-prob / entropy error at logits of std 8 (tempered 0.9), 14 tokens of V 1031: over 300
# seeds median 1.1e-4, largest 2.5e-4, 3.7% above 2e-4 (the split drops lo*lo, of relative size 2^-16 of each
# product, so it grows with the logits); tf32 operands miss this bound 5x (2e-3), bfloat16 ones by far
BF16X3_STATS = 4e-4
V = 1031          # prime: no two ranks get the same number of rows
H = 48
LEAD = (2, 7)     # 14 tokens as [batch, seq]
CHUNK_ROWS = 97   # chunked backend: several ragged chunks per shard


def configure_process() -> None:
    torch.set_num_threads(1)   # the ranks share the machine's cores
    os.environ["LOGITLESS_CHUNK_ELEMENTS"] = str(LEAD[0] * LEAD[1] * CHUNK_ROWS)


@dataclass
class Ctx:
    rank: int
    world: int
    group: object
    seed: int

    def gen(self, salt: int = 0) -> torch.Generator:
        """The same random stream on every rank."""
        return torch.Generator().manual_seed(self.seed + salt)


class Checks:
    def __init__(self):
        self.failures = []

    def true(self, what: str, cond: bool, detail: str = "") -> None:
        if not cond:
            self.failures.append(f"{what} {detail}")

    def abs_le(self, what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
        if got.shape != want.shape:
            return self.true(what, False, f"shape {tuple(got.shape)} != {tuple(want.shape)}")
        if not bool(torch.isfinite(got).all()):
            return self.true(what, False, "has non-finite values")
        err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        self.true(what, err <= tol, f"max abs err {err:.3g} > {tol}")

    def rel_le(self, what: str, got: Optional[torch.Tensor], want: torch.Tensor, tol: float) -> None:
        if got is None:
            return self.true(what, False, "is None")
        if got.shape != want.shape or not bool(torch.isfinite(got).all()):
            return self.true(what, False, f"shape {tuple(got.shape)} vs {tuple(want.shape)} or non-finite")
        err = rel_err(got, want)
        self.true(what, err <= tol, f"relative err {err:.3g} > {tol}")

    def raises(self, what: str, exc_type, match: str, fn: Callable) -> None:
        try:
            fn()
        except exc_type as exc:
            self.true(what, match in str(exc), f"raised {exc_type.__name__} without {match!r}: {exc}")
        except Exception as exc:
            self.true(what, False, f"raised {type(exc).__name__} instead of {exc_type.__name__}: {exc}")
        else:
            self.true(what, False, f"did not raise {exc_type.__name__}")

    def done(self) -> None:
        if self.failures:
            raise AssertionError("\n".join(self.failures))


def even_sizes(v: int, world: int) -> list:
    return [v // world + (r < v % world) for r in range(world)]


def uneven_sizes(v: int, world: int) -> list:
    """Very unequal shards, one of a single row."""
    return {2: [v - 1, 1], 3: [700, 1, v - 701]}[world]


def make_inputs(ctx: Ctx, sizes, *, lead=LEAD, h=H, dtype=torch.float32, n_ignored=3, ignore_index=-100,
                logit_std=4.0, salt=0):
    """hidden [*lead, h], full weight [sum(sizes), h], labels [*lead]: identical on every rank. Labels
    include the first and last row of every shard, and n_ignored positions hold ignore_index."""
    g = ctx.gen(salt)
    v = sum(sizes)
    hidden = torch.randn(*lead, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (logit_std / h ** 0.5)
    labels = torch.randint(0, v, lead, generator=g)
    flat = labels.view(-1)
    edges = []
    for r in range(len(sizes)):
        start = sum(sizes[:r])
        edges += [start, start + sizes[r] - 1]
    for i, e in enumerate(edges[: max(0, flat.numel() - n_ignored)]):
        flat[i] = e
    if n_ignored:
        flat[torch.randperm(flat.numel(), generator=g)[:n_ignored]] = ignore_index
    return hidden.to(dtype), weight.to(dtype), labels


def shard(ctx: Ctx, weight: torch.Tensor, sizes) -> tuple[int, torch.Tensor]:
    off = sum(sizes[: ctx.rank])
    return off, weight[off: off + sizes[ctx.rank]].clone()


def reference(hidden, weight, labels, temperature, ignore_index, a, b, with_entropy, softcap=None):
    """float64 logprobs, entropy, d_hidden, d_weight of loss = sum(a*logprob) + sum(b*entropy)."""
    h64 = hidden.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    lp, ent = logprobs_entropy64(h64, w64, labels, temperature, ignore_index, softcap)
    loss = (lp * a).sum() + ((ent * b).sum() if with_entropy else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), h64.grad, w64.grad


def partial_grad_hidden64(hidden, weight, labels, temperature, ignore_index, a, b, with_entropy, softcap, off, n):
    """float64 d_hidden through the logits of weight rows [off, off + n) only: a rank's partial sum.

    The hidden states enter twice, as [h, h] against a weight [V, 2H] whose rows are [w, 0] outside the
    block and [0, w] inside it: the logits are unchanged (adding zeros is exact) and the gradient of the
    second copy is the block's share."""
    h64 = hidden.detach().double()
    w64 = weight.detach().double()
    inside = torch.zeros(w64.shape[0], 1, dtype=torch.float64)
    inside[off: off + n] = 1.0
    outside, mine = h64.clone().requires_grad_(True), h64.clone().requires_grad_(True)
    lp, ent = logprobs_entropy64(torch.cat([outside, mine], -1), torch.cat([w64 * (1 - inside), w64 * inside], 1),
                                 labels, temperature, ignore_index, softcap)
    ((lp * a).sum() + ((ent * b).sum() if with_entropy else 0.0)).backward()
    return mine.grad


def same_on_every_rank(ctx: Ctx, ck: Checks, what: str, t: torch.Tensor) -> None:
    every = [torch.empty_like(t) for _ in range(ctx.world)]
    dist.all_gather(every, t.contiguous(), group=ctx.group)
    ck.true(what, all(torch.equal(e, every[0]) for e in every), "differs between ranks")


def check_sharded(ctx: Ctx, ck: Checks, *, backend: str, sizes=None, lead=LEAD, h=H, dtype=torch.float32,
                  temperature=1.0, ignore_index=-100, n_ignored=3, with_entropy=True,
                  reduce_grad_hidden=True, grad_hidden=True, grad_weight=True, tag="", salt=0,
                  softcap=None, logit_std=4.0, precision=None, grad_precision=None, tol=None, exact=None,
                  ran_mode=None):
    """One forward + backward across the group against the float64 unsharded ground truth. exact: None, or
    (hidden, weight, sizes) -> (hidden, weight), the full inputs changed alike on every rank (values that
    bfloat16 represents); ran_mode: the statistics' products ``last_precision()`` must name (default
    ``precision``)."""
    sizes = sizes or even_sizes(V, ctx.world)
    tag = f"[{backend}{' ' + tag if tag else ''}]"
    tol = tol or TOL[dtype]
    hidden, weight, labels = make_inputs(ctx, sizes, lead=lead, h=h, dtype=dtype, n_ignored=n_ignored,
                                         ignore_index=ignore_index, salt=salt, logit_std=logit_std)
    if exact is not None:
        hidden, weight = exact(hidden, weight, sizes)
    g = ctx.gen(salt + 1)
    a = torch.randn(labels.shape, generator=g, dtype=torch.float64)
    b = torch.randn(labels.shape, generator=g, dtype=torch.float64)
    if callable(temperature):
        temperature = temperature(g, labels.shape)
    off, w_local = shard(ctx, weight, sizes)
    h_in = hidden.clone().requires_grad_(grad_hidden)
    w_in = w_local.requires_grad_(grad_weight)
    out = fused_logprobs(h_in, w_in, labels, temperature=temperature, with_entropy=with_entropy,
                         ignore_index=ignore_index, tp_group=ctx.group, reduce_grad_hidden=reduce_grad_hidden,
                         backend=backend, softcap=softcap, precision=precision, grad_precision=grad_precision)
    ck.true(f"{tag} last_backend", last_backend() == backend, f"is {last_backend()}")
    if precision is not None:
        ran = tuple(last_precision())
        ck.true(f"{tag} last_precision", ran[0] == (ran_mode or precision) and ran[1] == (grad_precision or "bf16"),
                f"is {ran}")
    loss = (out.logprobs * a.float()).sum()
    if with_entropy:
        loss = loss + (out.entropy * b.float()).sum()
    else:
        ck.true(f"{tag} entropy", out.entropy is None, "is not None with with_entropy=False")
    if grad_hidden or grad_weight:
        loss.backward()
    lp64, ent64, dh64, dw64 = reference(hidden, weight, labels, temperature, ignore_index, a, b, with_entropy,
                                        softcap)
    if softcap is not None:
        # the inputs must make the cap matter, or a rank that ignored it would pass too
        plain, _ = logprobs_entropy64(hidden, weight, labels, temperature, ignore_index)
        ck.true(f"{tag} cap active", bool((plain - lp64).abs().max() > 0.5), "inputs barely reach the cap")

    ck.true(f"{tag} logprobs dtype", out.logprobs.dtype == torch.float32)
    ck.abs_le(f"{tag} logprobs", out.logprobs, lp64, tol[0])
    same_on_every_rank(ctx, ck, f"{tag} logprobs", out.logprobs.detach())
    if with_entropy:
        ck.abs_le(f"{tag} entropy", out.entropy, ent64, tol[1])
        same_on_every_rank(ctx, ck, f"{tag} entropy", out.entropy.detach())
    if grad_weight:
        ck.true(f"{tag} d_weight dtype", w_in.grad is not None and w_in.grad.dtype == dtype)
        ck.rel_le(f"{tag} d_weight (local shard)", w_in.grad, dw64[off: off + sizes[ctx.rank]], tol[2])
    else:
        ck.true(f"{tag} d_weight", w_in.grad is None, "exists though weight does not require grad")
    if grad_hidden:
        dh = h_in.grad
        ck.true(f"{tag} d_hidden dtype", dh is not None and dh.dtype == dtype)
        if reduce_grad_hidden:
            ck.rel_le(f"{tag} d_hidden (full)", dh, dh64, tol[2])
        elif dh is not None:
            # partial on each rank; one all-reduce by the caller gives the full gradient (a d_hidden
            # already reduced inside would come out world times too large here)
            full = dh.float().clone()
            dist.all_reduce(full, group=ctx.group)
            ck.rel_le(f"{tag} all-reduced partial d_hidden", full, dh64, tol[2])
            want = partial_grad_hidden64(hidden, weight, labels, temperature, ignore_index, a, b, with_entropy,
                                         softcap, off, sizes[ctx.rank])
            ck.rel_le(f"{tag} this rank's partial d_hidden", dh, want, tol[2])
    else:
        ck.true(f"{tag} d_hidden", h_in.grad is None, "exists though hidden does not require grad")
    return out


# ----------------------------------------------------------------------------- vocab-parallel cases

def case_scalar_temperature(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, temperature=0.7)
    ck.done()


def case_per_token_temperature(ctx):
    ck = Checks()
    per_token = lambda g, shape: torch.rand(shape, generator=g) * 1.5 + 0.5          # noqa: E731
    per_sequence = lambda g, shape: torch.rand(shape[0], 1, generator=g) * 1.5 + 0.5  # noqa: E731
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, temperature=per_token, tag="per token")
        check_sharded(ctx, ck, backend=backend, temperature=per_sequence, tag="per sequence", salt=7)
    ck.done()


def case_without_entropy(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, with_entropy=False, temperature=1.3)
    ck.done()


def case_unequal_shards(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, sizes=uneven_sizes(V, ctx.world), temperature=0.9)
    ck.done()


def case_partial_grad_hidden(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, reduce_grad_hidden=False, sizes=uneven_sizes(V, ctx.world))
        check_sharded(ctx, ck, backend=backend, reduce_grad_hidden=False, with_entropy=False, tag="no entropy")
    ck.done()


def case_ignore_index(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, ignore_index=-1, n_ignored=5, tag="ignore -1")
        # a valid token id as ignore_index: those labels are ignored, not looked up
        check_sharded(ctx, ck, backend=backend, ignore_index=3, n_ignored=4, tag="ignore 3")
        out = check_sharded(ctx, ck, backend=backend, n_ignored=LEAD[0] * LEAD[1], tag="all ignored")
        ck.true(f"[{backend}] all ignored", bool((out.logprobs == 0).all() and (out.entropy == 0).all()),
                "outputs are not all zero")
    ck.done()


def case_grad_subsets(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, grad_weight=False, tag="hidden only")
        check_sharded(ctx, ck, backend=backend, grad_hidden=False, tag="weight only")
    ck.done()


def case_bfloat16(ctx):
    ck = Checks()
    check_sharded(ctx, ck, backend="chunked", dtype=torch.bfloat16, temperature=0.8)
    check_sharded(ctx, ck, backend="chunked", dtype=torch.bfloat16, reduce_grad_hidden=False, tag="partial")
    ck.done()


def case_float32_split_precision(ctx):
    """A float32 head by the three-product bfloat16 split, each rank splitting its own shard: the combined
    statistics within the split's bound of float64 (logits of std 8, where bfloat16 operands miss it by far),
    bfloat16 gradient products by default, float32-exact ones with grad_precision="bf16x3"."""
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, precision="bf16x3", logit_std=8.0, temperature=0.9,
                      tol=(BF16X3_STATS, BF16X3_STATS, 3e-2), tag="bf16x3")
        check_sharded(ctx, ck, backend=backend, precision="bf16x3", grad_precision="bf16x3", logit_std=8.0,
                      reduce_grad_hidden=False, sizes=uneven_sizes(V, ctx.world),
                      tol=(BF16X3_STATS, BF16X3_STATS, 1e-4),
                      tag="bf16x3 split grads, partial d_hidden")
    ck.done()


def first_shard_exact(hidden_too: bool):
    """(hidden, weight, sizes) -> the first rank's weight shard rounded to bfloat16 values (the others' not), and
    hidden too with ``hidden_too``: the ground truth is of these values."""
    def change(hidden, weight, sizes):
        weight = weight.clone()
        weight[:sizes[0]] = weight[:sizes[0]].bfloat16().float()
        return (hidden.bfloat16().float() if hidden_too else hidden), weight
    return change


def case_float32_split_flags_all_reduced(ctx):
    """The adaptive split under tensor parallelism: the first rank's shard holds bfloat16 values only (alone it
    would run one product with bfloat16-exact hidden states, two without), the others' not. The ranks' flags
    are all-reduced, so every rank runs the products the whole head needs: "bf16x2" with bfloat16-exact hidden
    states, "bf16x3" without; results against float64 of the operands."""
    from logitless.ops.precision import bf16_exact_all
    ck = Checks()
    sizes = even_sizes(V, ctx.world)
    _, w_check = shard(ctx, first_shard_exact(False)(None, make_inputs(ctx, sizes)[1], sizes)[1], sizes)
    ck.true("the first shard alone is bfloat16-exact, the others not",
            bool(bf16_exact_all(w_check)) == (ctx.rank == 0))
    for backend in CPU_BACKENDS:
        for hidden_too, mode in ((True, "bf16x2"), (False, "bf16x3")):
            check_sharded(ctx, ck, backend=backend, precision="split", ran_mode=mode, logit_std=8.0,
                          temperature=0.9, exact=first_shard_exact(hidden_too), tol=(BF16X3_STATS, BF16X3_STATS, 3e-2),
                          tag=f"split, first shard exact, hidden exact {hidden_too}")
    ck.done()


def case_three_dims_odd_hidden(ctx):
    ck = Checks()
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, lead=(3, 2, 5), h=96, temperature=1.1)
    ck.done()


def case_empty_tokens(ctx):
    ck = Checks()
    sizes = even_sizes(V, ctx.world)
    _, weight, _ = make_inputs(ctx, sizes)
    _, w = shard(ctx, weight, sizes)
    w.requires_grad_(True)
    h = torch.randn(2, 0, H, requires_grad=True)
    out = fused_logprobs(h, w, torch.zeros(2, 0, dtype=torch.long), tp_group=ctx.group, backend="chunked")
    ck.true("empty logprobs", out.logprobs.shape == (2, 0) and out.entropy.shape == (2, 0))
    (out.logprobs.sum() + out.entropy.sum()).backward()
    ck.true("empty d_weight", w.grad is not None and bool((w.grad == 0).all()))
    ck.true("empty d_hidden", h.grad is not None and h.grad.shape == h.shape)
    ck.done()


def case_softcap(ctx):
    """Gemma-style logits c * tanh(raw / c) / T across the group: the cap is per logit, so the shards'
    statistics combine as without it; raw logits of std 12 against c = 8 bend most of them."""
    ck = Checks()
    per_token = lambda g, shape: torch.rand(shape, generator=g) * 1.5 + 0.5  # noqa: E731
    for backend in CPU_BACKENDS:
        check_sharded(ctx, ck, backend=backend, softcap=8.0, logit_std=12.0, temperature=per_token)
        check_sharded(ctx, ck, backend=backend, softcap=8.0, logit_std=12.0, temperature=0.8,
                      sizes=uneven_sizes(V, ctx.world), reduce_grad_hidden=False, tag="unequal, partial", salt=5)
    check_sharded(ctx, ck, backend="chunked", softcap=8.0, logit_std=12.0, dtype=torch.bfloat16, with_entropy=False,
                  tag="bf16, no entropy", salt=9)
    ck.done()


def case_layout(ctx):
    ck = Checks()
    sizes = uneven_sizes(V, ctx.world)
    _, weight, _ = make_inputs(ctx, sizes)
    off, w = shard(ctx, weight, sizes)
    tp = VocabParallel.for_group(ctx.group, w)
    ck.true("vocab_offset", tp.vocab_offset == off, f"{tp.vocab_offset} != {off}")
    ck.true("vocab_size", tp.vocab_size == V, f"{tp.vocab_size} != {V}")
    ck.true("sizes", list(tp.sizes) == sizes, f"{tp.sizes} != {sizes}")
    ck.true("rank/world", (tp.rank, tp.world_size) == (ctx.rank, ctx.world))
    exchanges = []
    real = parallel._exchange_sizes
    parallel._exchange_sizes = lambda *args: exchanges.append(1) or real(*args)   # counts, then runs it
    try:
        again = VocabParallel.for_group(ctx.group, w.clone())
    finally:
        parallel._exchange_sizes = real
    ck.true("cached", again == tp and not exchanges, "a second look-up exchanged the sizes again")
    ck.true("with_reduce(True)", tp.with_reduce(True) is tp and tp.reduce)
    partial = tp.with_reduce(False)
    ck.true("with_reduce(False)", not partial.reduce and tp.reduce and partial.vocab_offset == off)
    x = torch.full((3, 2), float(ctx.rank + 1))
    ck.true("no reduce", torch.equal(partial.reduce_grad_hidden(x.clone()), x))
    total = float(sum(range(1, ctx.world + 1)))
    ck.true("reduce", bool((tp.reduce_grad_hidden(x.clone()) == total).all()))
    ck.done()


def case_layout_releases_group(ctx):
    """The layout cache must not keep a destroyed group alive: its threads would outlive
    destroy_process_group and can abort the process at exit."""
    ck = Checks()
    sub = dist.new_group(list(range(ctx.world)))
    hidden, weight, labels = make_inputs(ctx, even_sizes(V, ctx.world), lead=(3,), n_ignored=0)
    _, w = shard(ctx, weight, even_sizes(V, ctx.world))
    fused_logprobs(hidden, w, labels, tp_group=sub, backend="chunked")
    alive = weakref.ref(sub)
    dist.destroy_process_group(sub)
    del sub
    gc.collect()
    ck.true("group released", alive() is None, "a destroyed group is still referenced")
    ck.done()


def case_single_rank_subgroup(ctx):
    """A group of one rank (built with new_group on every rank): the unsharded result; the other
    ranks, not members, get a clear error."""
    ck = Checks()
    sub = dist.new_group([0])
    if ctx.rank == 0:
        hidden, weight, labels = make_inputs(ctx, [V])
        out = fused_logprobs(hidden, weight, labels, tp_group=sub, backend="chunked")
        lp64, ent64 = logprobs_entropy64(hidden, weight, labels)
        ck.abs_le("world of one logprobs", out.logprobs, lp64, TOL[torch.float32][0])
        ck.abs_le("world of one entropy", out.entropy, ent64, TOL[torch.float32][1])
    else:
        h, w, labels = torch.randn(3, H), torch.randn(5, H), torch.zeros(3, dtype=torch.long)
        ck.raises("non-member", ValueError, "not a member",
                  lambda: fused_logprobs(h, w, labels, tp_group=sub, backend="chunked"))
    ck.done()


def case_triton_interpreted(ctx):
    """The triton backend across 2 ranks on tiny shapes, kernels run by triton's interpreter."""
    ck = Checks()
    sizes = even_sizes(97, ctx.world)
    per_token = lambda g, shape: torch.rand(shape, generator=g) * 1.5 + 0.5  # noqa: E731
    check_sharded(ctx, ck, backend="triton", sizes=sizes, lead=(5,), h=32, temperature=per_token, n_ignored=1)
    check_sharded(ctx, ck, backend="triton", sizes=[60, 37], lead=(5,), h=32, with_entropy=False,
                  reduce_grad_hidden=False, n_ignored=1, tag="unequal, partial, no entropy", salt=3)
    check_sharded(ctx, ck, backend="triton", sizes=sizes, lead=(5,), h=32, temperature=0.9, n_ignored=1,
                  softcap=8.0, logit_std=12.0, tag="softcap", salt=11)
    ck.done()


def case_triton_batch_invariance(ctx):
    """Tensor parallel degree 2 or 3, triton backend (interpreter): a token's log-prob and entropy are the same bits
    alone, in a larger batch with ignored rows, permuted and from fused_policy_loss, with shards on vocabulary-tile
    boundaries (64 columns under the interpreter) and off them. Against the unsharded call (degree 1) they are not
    bit-equal (the tiles are combined per shard and the shards across ranks, where one rank combines all tiles in
    one pass): the bound, measured here as at most a few float32 ulps, is held at TP_BOUND."""
    ck = Checks()
    g = ctx.gen(21)
    r_tokens, n_total = 9, 31
    aligned = {2: [128, 64], 3: [64, 128, 64]}[ctx.world]
    # a new H per layout: a rank's shard shape may change only when every rank's does (VocabParallel.for_group)
    for sizes, tag, h in ((aligned, "shards on tile boundaries", 32), (even_sizes(193, ctx.world), "shards off them",
                                                                        40)):
        v = sum(sizes)
        hidden = torch.randn(r_tokens, h, generator=g).bfloat16()
        weight = (torch.randn(v, h, generator=g) * (3 / h ** 0.5)).bfloat16()
        labels = torch.randint(0, v, (r_tokens,), generator=g)
        _, w_local = shard(ctx, weight, sizes)

        def score(hh, yy, group=ctx.group, w=w_local):
            with torch.no_grad():
                out = fused_logprobs(hh, w, yy, tp_group=group, backend="triton", with_entropy=True)
            return out.logprobs, out.entropy

        lp0, ent0 = score(hidden, labels)
        where = torch.randperm(n_total, generator=g)[:r_tokens]
        big_h = torch.randn(n_total, h, generator=g).bfloat16()
        big_y = torch.full((n_total,), -100, dtype=torch.long)
        big_y[::4] = torch.randint(0, v, big_y[::4].shape, generator=g)
        big_h[where], big_y[where] = hidden, labels
        lp, ent = score(big_h, big_y)
        ck.true(f"{tag}: in a batch with ignored rows", torch.equal(lp[where], lp0) and torch.equal(ent[where], ent0))
        lp, ent = score(hidden[:1], labels[:1])
        ck.true(f"{tag}: one token", torch.equal(lp, lp0[:1]) and torch.equal(ent, ent0[:1]))
        perm = torch.randperm(r_tokens, generator=g)
        lp, ent = score(hidden[perm], labels[perm])
        ck.true(f"{tag}: permuted", torch.equal(lp, lp0[perm]) and torch.equal(ent, ent0[perm]))
        # fused_policy_loss's pass (with gradients) gives the same bits as fused_logprobs at this degree
        adv = torch.randn(r_tokens, generator=g)
        out = fused_policy_loss(hidden.clone().requires_grad_(True), w_local, labels, adv, entropy_coef=0.01,
                                tp_group=ctx.group, backend="triton")
        ck.true(f"{tag}: fused_policy_loss", torch.equal(out.logprobs, lp0) and torch.equal(out.entropy, ent0))
        lp1, ent1 = score(hidden, labels, group=None, w=weight)
        every = _gathered(ctx, torch.stack([lp0, ent0]))
        ck.true(f"{tag}: same bits on every rank", all(torch.equal(x, every[0]) for x in every))
        ck.abs_le(f"{tag}: log-prob against one rank", lp0, lp1, TP_BOUND * max(1.0, lp1.abs().max().item()))
        ck.abs_le(f"{tag}: entropy against one rank", ent0, ent1, TP_BOUND * max(1.0, ent1.abs().max().item()))
    ck.done()


# Tensor parallel against one rank, relative to the largest |value|: a few float32 ulps (2^-23 = 1.2e-7)
TP_BOUND = 8 * 2.0 ** -23


def _gathered(ctx, t: torch.Tensor) -> list:
    every = [torch.empty_like(t) for _ in range(ctx.world)]
    dist.all_gather(every, t.contiguous(), group=ctx.group)
    return every


# --------------------------------------------------------------------------------- error cases

def case_error_not_initialised(ctx):
    """Runs before init_process_group."""
    ck = Checks()
    h, w, labels = torch.randn(3, H), torch.randn(5, H), torch.zeros(3, dtype=torch.long)
    ck.raises("fused_logprobs", RuntimeError, "not initialised",
              lambda: fused_logprobs(h, w, labels, tp_group=object(), backend="chunked"))
    ck.raises("gather_sequence", RuntimeError, "not initialised", lambda: gather_sequence(h, object()))
    ck.raises("scatter_sequence", RuntimeError, "not initialised", lambda: scatter_sequence(h, object()))
    ck.raises("next_token_labels_sharded", RuntimeError, "not initialised",
              lambda: next_token_labels_sharded(labels, object(), dim=0))
    ck.done()


def case_error_hidden_size_differs(ctx):
    ck = Checks()
    h_dim = H + ctx.rank           # a different H on every rank
    h, w, labels = torch.randn(3, h_dim), torch.randn(5, h_dim), torch.zeros(3, dtype=torch.long)
    ck.raises("H per rank", ValueError, "hidden size",
              lambda: fused_logprobs(h, w, labels, tp_group=ctx.group, backend="chunked"))
    ck.done()


def case_error_dtype_differs(ctx):
    ck = Checks()
    dtype = torch.float32 if ctx.rank == 0 else torch.bfloat16
    h, w, labels = torch.randn(3, H, dtype=dtype), torch.randn(5, H, dtype=dtype), torch.zeros(3, dtype=torch.long)
    ck.raises("dtype per rank", ValueError, "dtype",
              lambda: fused_logprobs(h, w, labels, tp_group=ctx.group, backend="chunked"))
    ck.done()


def case_error_labels_outside_global_vocab(ctx):
    ck = Checks()
    sizes = even_sizes(V, ctx.world)
    hidden, weight, labels = make_inputs(ctx, sizes, lead=(4,), n_ignored=0)
    _, w = shard(ctx, weight, sizes)
    for bad in (V, V + 50, -5):
        lab = labels.clone()
        lab[2] = bad
        ck.raises(f"label {bad}", ValueError, f"[0, {V})",
                  lambda lab=lab: fused_logprobs(hidden, w, lab, tp_group=ctx.group, backend="chunked"))
    # the last global id lies outside rank 0's shard but inside the vocabulary: fine
    lab = labels.clone()
    lab[:] = V - 1
    out = fused_logprobs(hidden, w, lab, tp_group=ctx.group, backend="chunked")
    lp64, _ = logprobs_entropy64(hidden, weight, lab)
    ck.abs_le("label V-1", out.logprobs, lp64, TOL[torch.float32][0])
    ck.done()


def case_error_group_type(ctx):
    ck = Checks()
    h, w, labels = torch.randn(3, H), torch.randn(5, H), torch.zeros(3, dtype=torch.long)
    ck.raises("tp_group str", TypeError, "tp_group",
              lambda: fused_logprobs(h, w, labels, tp_group="world", backend="chunked"))
    ck.raises("gather group", TypeError, "group", lambda: gather_sequence(h, 3))
    ck.raises("gather dim", ValueError, "dim", lambda: gather_sequence(h, ctx.group, dim=2))
    ck.raises("gather dim type", TypeError, "dim", lambda: gather_sequence(h, ctx.group, dim=0.0))
    ck.raises("gather x", TypeError, "x", lambda: gather_sequence([1.0], ctx.group))
    odd = torch.randn(ctx.world * 2 + 1, 3)
    ck.raises("scatter size", ValueError, "divisible", lambda: scatter_sequence(odd, ctx.group))
    ck.raises("ids dtype", TypeError, "local_ids", lambda: next_token_labels_sharded(h, ctx.group, dim=0))
    ck.done()


# ---------------------------------------------------------------------------- sequence-parallel cases

def case_gather_sequence_grads(ctx):
    ck = Checks()
    g = ctx.gen()
    n = 3
    for dim in (0, 1, -2):
        d = dim % 3
        full = torch.randn(ctx.world * n, 2, 5, generator=g).movedim(0, d).contiguous()
        coefs = [torch.randn(full.shape, generator=g) for _ in range(ctx.world)]   # each rank's loss weights
        local = full.narrow(d, ctx.rank * n, n).clone().requires_grad_(True)
        out = gather_sequence(local, ctx.group, dim=dim)
        ck.true(f"gather dim={dim} values", torch.equal(out.detach(), full), "differ from the full tensor")
        (out * coefs[ctx.rank]).sum().backward()
        want = sum(coefs).narrow(d, ctx.rank * n, n)
        ck.abs_le(f"gather dim={dim} grad (reduce-scatter)", local.grad, want, 1e-5)
    ck.done()


def case_scatter_sequence_grads(ctx):
    ck = Checks()
    g = ctx.gen()
    n = 2
    for dim in (0, 1):
        shape = [3, 4]
        shape[dim] = ctx.world * n
        full = torch.randn(*shape, 5, generator=g)
        coefs = [torch.randn(full.narrow(dim, 0, n).shape, generator=g) for _ in range(ctx.world)]
        x = full.clone().requires_grad_(True)
        out = scatter_sequence(x, ctx.group, dim=dim)
        ck.true(f"scatter dim={dim} values", torch.equal(out.detach(), full.narrow(dim, ctx.rank * n, n)))
        (out * coefs[ctx.rank]).sum().backward()
        ck.abs_le(f"scatter dim={dim} grad (all-gather)", x.grad, torch.cat(coefs, dim=dim), 0.0)
    ck.done()


def case_sequence_parallel_end_to_end(ctx):
    """Megatron's layout: hidden [s, b, h] sharded along s, LM head sharded along the vocabulary.
    gather_sequence -> fused_logprobs(reduce_grad_hidden=False) -> loss; each rank's gradient of its
    sequence shard and of its vocab shard must match the unsharded float64 run."""
    ck = Checks()
    n_local, batch = 3, 2
    seq = n_local * ctx.world
    for backend in CPU_BACKENDS:
        sizes = uneven_sizes(V, ctx.world)
        hidden, weight, labels = make_inputs(ctx, sizes, lead=(seq, batch), n_ignored=2)
        g = ctx.gen(5)
        a = torch.randn(labels.shape, generator=g, dtype=torch.float64)
        b = torch.randn(labels.shape, generator=g, dtype=torch.float64)
        off, w = shard(ctx, weight, sizes)
        w.requires_grad_(True)
        local = hidden[ctx.rank * n_local: (ctx.rank + 1) * n_local].clone().requires_grad_(True)
        full = gather_sequence(local, ctx.group, dim=0)
        out = fused_logprobs(full, w, labels, temperature=0.9, tp_group=ctx.group, reduce_grad_hidden=False,
                             backend=backend)
        ((out.logprobs * a.float()).sum() + (out.entropy * b.float()).sum()).backward()
        lp64, ent64, dh64, dw64 = reference(hidden, weight, labels, 0.9, -100, a, b, True)
        ck.abs_le(f"[{backend}] SP logprobs", out.logprobs, lp64, TOL[torch.float32][0])
        ck.abs_le(f"[{backend}] SP entropy", out.entropy, ent64, TOL[torch.float32][1])
        ck.rel_le(f"[{backend}] SP d_hidden shard", local.grad, dh64[ctx.rank * n_local: (ctx.rank + 1) * n_local],
                  TOL[torch.float32][2])
        ck.rel_le(f"[{backend}] SP d_weight shard", w.grad, dw64[off: off + sizes[ctx.rank]], TOL[torch.float32][2])
    ck.done()


def case_next_token_labels_sharded(ctx):
    ck = Checks()
    g = ctx.gen()
    lengths = {2: [[5, 8], [1, 6]], 3: [[4, 0, 9], [3, 3, 1], [0, 2, 0]]}[ctx.world]
    for lens in lengths:
        total = sum(lens)
        start = sum(lens[: ctx.rank])
        for dim, ids in ((-1, torch.randint(0, 50000, (2, total), generator=g, dtype=torch.int32)),
                         (0, torch.randint(0, 50000, (total, 3), generator=g))):
            want = next_token_labels(ids, dim=dim, ignore_index=-7).narrow(dim, start, lens[ctx.rank])
            got = next_token_labels_sharded(ids.narrow(dim, start, lens[ctx.rank]).clone(), ctx.group, dim=dim,
                                            ignore_index=-7)
            ck.true(f"lens={lens} dim={dim}", got.dtype == ids.dtype and torch.equal(got, want),
                    f"\n got {got.tolist()}\nwant {want.tolist()}")
    ck.done()


VOCAB_CASES = [case_scalar_temperature, case_per_token_temperature, case_without_entropy, case_unequal_shards,
               case_partial_grad_hidden, case_ignore_index, case_grad_subsets, case_bfloat16,
               case_three_dims_odd_hidden, case_softcap, case_empty_tokens, case_layout, case_layout_releases_group,
               case_float32_split_precision, case_float32_split_flags_all_reduced,
               case_single_rank_subgroup]
ERROR_CASES = [case_error_hidden_size_differs, case_error_dtype_differs, case_error_labels_outside_global_vocab,
               case_error_group_type]
SEQUENCE_CASES = [case_gather_sequence_grads, case_scatter_sequence_grads, case_sequence_parallel_end_to_end,
                  case_next_token_labels_sharded]


def _named(fns):
    return [(fn.__name__[len("case_"):], fn) for fn in fns]


def pre_init_cases():
    """Cases that run in the rank processes before torch.distributed is initialised."""
    return _named([case_error_not_initialised])


def cases_for(world: int):
    """(name, function) of every case run after init, in the order every rank runs them."""
    extra = ([case_triton_interpreted] if world == 2 else []) + [case_triton_batch_invariance]
    return _named(VOCAB_CASES + extra + ERROR_CASES + SEQUENCE_CASES)


def names(fns, world: int):
    """Names of ``fns`` that run at ``world`` ranks (for the pytest parametrisation)."""
    run = {name for name, _ in pre_init_cases() + cases_for(world)}
    return [name for name, _ in _named(fns) if name in run]
