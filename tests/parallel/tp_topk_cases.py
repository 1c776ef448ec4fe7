"""k ids per token under vocabulary parallelism, run in every rank of a gloo group by tp_harness: fused_logprobs
with labels [..., k], fused_topk (a global top-k: every rank's candidates merged, ties to the lower global id)
and the top-k divergences, each against float64 on the full weight or the unsharded call."""
from __future__ import annotations

import torch

from logitless import fused_logprobs, fused_topk
from logitless.losses.distill_topk import topk_divergence
from tp_cases import Checks, V, configure_process, even_sizes, same_on_every_rank, shard, uneven_sizes  # noqa: F401

H, LEAD, K = 48, (2, 7), 5


def _inputs(ctx, salt=0):
    g = ctx.gen(salt)
    hidden = torch.randn(*LEAD, H, generator=g)
    weight = torch.randn(V, H, generator=g) * (4.0 / H ** 0.5)
    return hidden, weight, g


def _logp64(hidden, weight, temperature=1.0, softcap=None):
    z = hidden.double() @ weight.double().t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return torch.log_softmax(z / temperature, -1)


def _grads_ok(ck, tag, h_in, w_in, h64, w64, off, n, tol=1e-4):
    ck.rel_le(f"{tag} d_hidden", h_in.grad, h64.grad, tol)
    ck.rel_le(f"{tag} d_weight (this shard's rows)", w_in.grad, w64.grad[off: off + n], tol)


def _k_labels(ctx, backend, sizes, softcap=None):
    ck = Checks()
    tag = f"[{backend} k labels {sizes} softcap={softcap}]"
    hidden, weight, g = _inputs(ctx)
    n = LEAD[0] * LEAD[1]
    ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)]).view(*LEAD, K)
    edges = sorted({0, V - 1, sizes[0] - 1, sizes[0]})                # both ends of the shards
    edges += [i for i in range(2, 2 + K) if i not in edges][:K - len(edges)]
    ids[0, 0] = torch.tensor(edges)
    ids[1, 3] = -100
    a = torch.randn(ids.shape, generator=g)
    b = torch.randn(LEAD, generator=g)
    off, w_local = shard(ctx, weight, sizes)
    h_in, w_in = hidden.clone().requires_grad_(), w_local.requires_grad_()
    out = fused_logprobs(h_in, w_in, ids, tp_group=ctx.group, backend=backend, softcap=softcap, temperature=0.8)
    ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp = _logp64(h64, w64, 0.8, softcap)
    valid = (ids != -100).all(-1)
    lp = logp.gather(-1, ids.clamp(min=0)) * valid.unsqueeze(-1)
    ent = -(logp.exp() * logp).sum(-1) * valid
    ((lp * a.double()).sum() + (ent * b.double()).sum()).backward()
    ck.abs_le(f"{tag} logprobs", out.logprobs, lp, 2e-5)
    ck.abs_le(f"{tag} entropy", out.entropy, ent, 2e-5)
    _grads_ok(ck, tag, h_in, w_in, h64, w64, off, sizes[ctx.rank])
    same_on_every_rank(ctx, ck, f"{tag} logprobs", out.logprobs.detach())
    ck.done()


def case_k_labels_chunked(ctx):
    _k_labels(ctx, "chunked", uneven_sizes(V, ctx.world))


def case_k_labels_reference_softcap(ctx):
    _k_labels(ctx, "reference", even_sizes(V, ctx.world), softcap=3.0)


def case_k_labels_triton_interpreted(ctx):
    _k_labels(ctx, "triton", even_sizes(V, ctx.world))


def case_topk(ctx):
    ck = Checks()
    # triton: the selection kernels on each shard, k candidates a rank merged
    for backend, sizes in (("chunked", uneven_sizes(V, ctx.world)), ("reference", even_sizes(V, ctx.world)),
                           ("triton", uneven_sizes(V, ctx.world))):
        tag = f"[{backend} topk {sizes}]"
        hidden, weight, g = _inputs(ctx, salt=1)
        mask = torch.ones(LEAD, dtype=torch.bool)
        mask[1, 1] = False
        off, w_local = shard(ctx, weight, sizes)
        h_in, w_in = hidden.clone().requires_grad_(), w_local.requires_grad_()
        out = fused_topk(h_in, w_in, K, mask=mask, tp_group=ctx.group, backend=backend)
        a, b = torch.randn(*LEAD, K, generator=g), torch.randn(LEAD, generator=g)
        ((out.logprobs * a).sum() + (out.tail_logprob * b).sum()).backward()
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        logp = _logp64(h64, w64)
        ids = torch.sort(logp.detach(), dim=-1, descending=True, stable=True).indices[..., :K]
        lp = logp.gather(-1, ids) * mask.unsqueeze(-1)
        tail = torch.logsumexp(logp.scatter(-1, ids, float("-inf")), -1) * mask
        ((lp * a.double()).sum() + (tail * b.double()).sum()).backward()
        ck.true(f"{tag} ids", torch.equal(out.ids[mask], ids[mask]), f"{out.ids[mask]} vs {ids[mask]}")
        ck.true(f"{tag} masked ids", bool((out.ids[~mask] == -1).all()))
        ck.abs_le(f"{tag} logprobs", out.logprobs, lp, 2e-5)
        ck.abs_le(f"{tag} tail", out.tail_logprob, tail, 2e-5)
        _grads_ok(ck, tag, h_in, w_in, h64, w64, off, sizes[ctx.rank])
        same_on_every_rank(ctx, ck, f"{tag} ids", out.ids)
    ck.done()


def case_topk_ties_across_ranks(ctx):
    """Integer hidden states and weights: exact, equal logits on several ranks; the lower global id wins."""
    ck = Checks()
    g = ctx.gen(2)
    hidden = torch.randint(-2, 3, (9, H), generator=g).float()
    weight = torch.randint(-2, 3, (V, H), generator=g).float()
    sizes = even_sizes(V, ctx.world)
    _, w_local = shard(ctx, weight, sizes)
    z = hidden @ weight.t()
    want = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :K]
    ck.true("[ties] the cut falls in a run of equal logits", bool((z.gather(1, want[:, -1:]) == z).sum(-1).max() > 1))
    for backend in ("chunked", "triton"):
        out = fused_topk(hidden, w_local, K, tp_group=ctx.group, backend=backend)
        ck.true(f"[ties {backend}] ids", torch.equal(out.ids, want), f"{out.ids} vs {want}")
    ck.done()


def case_topk_divergences(ctx):
    """Both divergences with the head sharded equal the unsharded call (values, metrics, gradients)."""
    ck = Checks()
    hidden, weight, g = _inputs(ctx, salt=3)
    z = hidden.double() @ weight.double().t()
    t_lp, t_ids = torch.log_softmax(1.5 * z + torch.randn(z.shape, generator=g, dtype=torch.float64), -1).topk(K)
    labels = torch.randint(0, V, LEAD, generator=g)
    labels[0, :3] = -100
    sizes = uneven_sizes(V, ctx.world)
    off, w_local = shard(ctx, weight, sizes)
    # the tail variant on triton: its dlogits kernel on each shard (the ids another rank holds never match)
    for divergence, backend in (("forward_kl_topk", "chunked"), ("forward_kl_topk_tail", "chunked"),
                                ("forward_kl_topk", "triton"), ("forward_kl_topk_tail", "triton")):
        tag = f"[{divergence} {backend}]"
        h_in, w_in = hidden.clone().requires_grad_(), w_local.requires_grad_()
        got = topk_divergence(h_in, w_in, labels, t_ids, t_lp.float(), divergence=divergence, tp_group=ctx.group,
                              backend=backend, log_prob_min_clamp=-6.0)
        got.divergence.sum().backward()
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        want = topk_divergence(h1, w1, labels, t_ids, t_lp.float(), divergence=divergence, backend=backend,
                               log_prob_min_clamp=-6.0)
        want.divergence.sum().backward()
        ck.abs_le(f"{tag} divergence", got.divergence, want.divergence.detach(), 2e-5)
        for name, value in want.metrics.items():
            ck.abs_le(f"{tag} {name}", got.metrics[name], value, 2e-5)
        ck.rel_le(f"{tag} d_hidden", h_in.grad, h1.grad, 1e-4)
        ck.rel_le(f"{tag} d_weight", w_in.grad, w1.grad[off: off + sizes[ctx.rank]], 1e-4)
        w_local = w_local.detach()
    ck.done()


CASES = [case_k_labels_chunked, case_k_labels_reference_softcap, case_topk, case_topk_ties_across_ranks,
         case_topk_divergences]


def _named(fns):
    return [(fn.__name__[len("case_"):], fn) for fn in fns]


def pre_init_cases():
    return []


def cases_for(world: int):
    return _named(CASES + ([case_k_labels_triton_interpreted] if world == 2 else []))


def names(world: int):
    return [name for name, _ in cases_for(world)]
