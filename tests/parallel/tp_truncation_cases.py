"""Truncated log-probs (fused_logprobs(truncation=...)) with the LM head sharded by vocabulary rows, run in every
rank of a gloo group by tp_harness: the kept sets are global (every rank the same, the same sizes as the unsharded
call wherever float32 rounding cannot move a boundary: tests/truncation64.py), and the values and gradients equal
the unsharded call's to float32 rounding and float64 to the plain op's bounds."""
from __future__ import annotations

import torch

from logitless import Truncation, fused_logprobs
from tp_cases import (  # noqa: F401
    LEAD,
    Checks,
    V,
    configure_process,
    even_sizes,
    make_inputs,
    same_on_every_rank,
    shard,
    uneven_sizes,
)
from truncation64 import on_op_count64, replayed64, truncated64

# float32 rounding between the sharded and the unsharded call (a global log-sum-exp summed in another order),
# and the plain op's bounds against float64 (logprob / entropy max abs, gradient relative norm)
SAME, TOL = (2e-6, 2e-6, 1e-5), (2e-5, 2e-5, 1e-4)


def _settings(truncation):
    return {k: v for k, v in (("top_k", truncation.top_k), ("top_p", truncation.top_p),
                              ("min_p", truncation.min_p)) if v is not None}


def _compare(ctx, truncation, *, backend, sizes, tag, temperature=0.8, softcap=None, logit_std=4.0, salt=0,
             min_decided=0.5):
    ck = Checks()
    tag = f"[{backend} {tag} {sizes}]"
    hidden, weight, labels = make_inputs(ctx, sizes, logit_std=logit_std, salt=salt)
    g = ctx.gen(salt + 1)
    a, b = torch.randn(LEAD, generator=g), torch.randn(LEAD, generator=g)
    off, w_local = shard(ctx, weight, sizes)
    h_in, w_in = hidden.clone().requires_grad_(), w_local.requires_grad_()
    got = fused_logprobs(h_in, w_in, labels, temperature=temperature, softcap=softcap, backend=backend,
                         tp_group=ctx.group, truncation=truncation)
    ((got.logprobs * a).sum() + (got.entropy * b).sum()).backward()
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = fused_logprobs(h1, w1, labels, temperature=temperature, softcap=softcap, backend=backend,
                          truncation=truncation)
    ((want.logprobs * a).sum() + (want.entropy * b).sum()).backward()

    replay = truncation.kept_ids is not None
    common = dict(temperature=temperature, softcap=softcap)
    ref = (replayed64(hidden, weight, labels, truncation.kept_ids, **common) if replay
           else truncated64(hidden, weight, labels, **common, **_settings(truncation)))
    valid = labels != -100
    decided = ref.decided & valid
    ck.true(f"{tag} decided rows", bool(decided.sum() >= min_decided * valid.sum()), f"{int(decided.sum())}")
    ck.true(f"{tag} settings bite", bool((ref.kept_count[valid] < V).all()), f"{ref.kept_count}")
    # the kept sets: the unsharded call's sizes and membership wherever float64 decides them beyond rounding,
    # float64's on those rows, within the sizes float32 may choose elsewhere; the same on every rank
    for name in ("kept_count", "inside"):
        mine, theirs = getattr(got, name), getattr(want, name)
        ck.true(f"{tag} {name} = unsharded", torch.equal(mine[decided], theirs[decided]), f"{mine} vs {theirs}")
        ck.true(f"{tag} {name} = float64", torch.equal(mine[decided], getattr(ref, name)[decided]))
        same_on_every_rank(ctx, ck, f"{tag} {name}", mine)
    in_range = (got.kept_count >= ref.count_lo) & (got.kept_count <= ref.count_hi)
    ck.true(f"{tag} kept_count in float32's range", bool(in_range.all()), f"{got.kept_count} {ref.count_lo}")
    same_rows = got.kept_count == want.kept_count
    ck.abs_le(f"{tag} logprobs = unsharded", got.logprobs[same_rows], want.logprobs[same_rows].detach(), SAME[0])
    ck.abs_le(f"{tag} entropy = unsharded", got.entropy[same_rows], want.entropy[same_rows].detach(), SAME[1])
    if replay:
        ck.true(f"{tag} kept_logprob", got.kept_logprob is None, "is not None in the replay form")
    else:
        ck.abs_le(f"{tag} kept_logprob = unsharded", got.kept_logprob[same_rows], want.kept_logprob[same_rows],
                  SAME[0])
    same_on_every_rank(ctx, ck, f"{tag} logprobs", got.logprobs.detach())
    if bool(same_rows.all()):
        ck.rel_le(f"{tag} d_hidden = unsharded", h_in.grad, h1.grad, SAME[2])
        ck.rel_le(f"{tag} d_weight = unsharded (this shard's rows)", w_in.grad, w1.grad[off: off + sizes[ctx.rank]],
                  SAME[2])
    # float64 over the sharded call's own kept-set sizes: values and gradients
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    truth = (replayed64(h64, w64, labels, truncation.kept_ids, **common) if replay
             else on_op_count64(h64, w64, labels, got.kept_count, **common))
    ((truth.logprobs * a.double()).sum() + (truth.entropy * b.double()).sum()).backward()
    ck.abs_le(f"{tag} logprobs = float64", got.logprobs, truth.logprobs, TOL[0])
    ck.abs_le(f"{tag} entropy = float64", got.entropy, truth.entropy, TOL[1])
    ck.rel_le(f"{tag} d_hidden = float64", h_in.grad, h64.grad, TOL[2])
    ck.rel_le(f"{tag} d_weight = float64 (this shard's rows)", w_in.grad, w64.grad[off: off + sizes[ctx.rank]],
              TOL[2])
    ck.done()


def case_settings_chunked_uneven(ctx):
    per_token_k = torch.randint(5, 60, LEAD, generator=ctx.gen(7))
    _compare(ctx, Truncation(top_k=per_token_k, top_p=0.9, min_p=0.01), backend="chunked",
             sizes=uneven_sizes(V, ctx.world), tag="top_k per token, top_p, min_p")


def case_settings_reference_softcap(ctx):
    per_seq_p = torch.tensor([[0.8], [0.95]], dtype=torch.float64)
    _compare(ctx, Truncation(top_p=per_seq_p, min_p=0.001), backend="reference", sizes=even_sizes(V, ctx.world),
             tag="top_p per sequence, softcap", softcap=5.0, temperature=1.2, logit_std=8.0, salt=10)


def case_kept_sets_past_the_first_candidates(ctx):
    # flat logits: nuclei of hundreds of ids (past the first 128 candidates merged over the ranks)
    _compare(ctx, Truncation(top_p=0.7), backend="chunked", sizes=even_sizes(V, ctx.world), tag="wide nucleus",
             logit_std=1.0, temperature=1.0, salt=20, min_decided=0.3)


def case_replay(ctx):
    g = ctx.gen(30)
    n = LEAD[0] * LEAD[1]
    sizes = uneven_sizes(V, ctx.world)
    ids = torch.full((n, 40), -1)
    for i in range(n):
        k = int(torch.randint(1, 40, (1,), generator=g))
        ids[i, :k] = torch.randperm(V, generator=g)[:k]
    edges = torch.tensor([sizes[0] - 1, sizes[0]])          # both sides of the first shard boundary, in row 0
    others = ids[0][(ids[0] >= 0) & (ids[0] != edges[0]) & (ids[0] != edges[1])]
    ids[0] = -1
    ids[0, :2] = edges
    ids[0, 2: 2 + others.numel()] = others[:38]
    _compare(ctx, Truncation(kept_ids=ids.view(*LEAD, 40)), backend="chunked", sizes=sizes, tag="replay", salt=30)


def case_settings_off_equal_the_plain_op(ctx):
    ck = Checks()
    sizes = uneven_sizes(V, ctx.world)
    hidden, weight, labels = make_inputs(ctx, sizes, salt=40)
    _, w_local = shard(ctx, weight, sizes)
    plain = fused_logprobs(hidden, w_local, labels, tp_group=ctx.group, backend="chunked")
    out = fused_logprobs(hidden, w_local, labels, tp_group=ctx.group, backend="chunked",
                         truncation=Truncation(top_k=-1, top_p=1.0, min_p=0.0))
    ck.true("[off] logprobs bit for bit", torch.equal(out.logprobs, plain.logprobs))
    ck.true("[off] entropy bit for bit", torch.equal(out.entropy, plain.entropy))
    valid = labels != -100
    ck.true("[off] kept_count", torch.equal(out.kept_count, torch.where(valid, V, 0)), f"{out.kept_count}")
    ck.true("[off] inside", torch.equal(out.inside, valid))
    ck.done()


CASES = [case_settings_chunked_uneven, case_settings_reference_softcap, case_kept_sets_past_the_first_candidates,
         case_replay, case_settings_off_equal_the_plain_op]


def _named(fns):
    return [(fn.__name__[len("case_"):], fn) for fn in fns]


def pre_init_cases():
    return []


def cases_for(world: int):
    return _named(CASES)


def names(world: int):
    return [name for name, _ in cases_for(world)]
