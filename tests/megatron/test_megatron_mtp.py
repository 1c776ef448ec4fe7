"""Multi-token prediction (MTP) losses from the fused op (logitless.megatron.mtp), against
megatron-core's own ``process_mtp_loss`` on the same model and batch: the main output, every
parameter gradient (MTP layers included) and the MTP tracker (logged loss per depth, acceptance
counts); and the output layer is called for no MTP depth (no [tokens x vocab] logits)."""
import warnings

import pytest
import torch

from logitless.megatron import last_path, patch_fused_forward, unpatch_fused_forward
from logitless.megatron.mtp import fused_mtp_enabled
from mcore_env import ENT_TOL, GRAD_TOL, LP_TOL


def build(env, kind, seed, **kw):
    if kind.startswith("hybrid"):
        return env.build_hybrid(pattern="*-*-/*-/*-", seed=seed, tied="tied" in kind, **kw)
    mup = dict(use_mup=True, mup_base_hidden_size=24) if "mup" in kind else {}
    model = env.build_gpt(mtp=2, seed=seed, tied="tied" in kind, **mup, **kw)
    if "legacy" in kind:
        model.__class__ = env.old_signature_gpt_class()
    return model


def run(env, model, fused, ids, pos, mask, labels, loss_mask, weights, processor=False):
    """One training forward + backward; returns (output, grads, tracker, output-layer calls)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from logitless.megatron.mtp import disable_fused_mtp, enable_fused_mtp
    (enable_fused_mtp if fused else disable_fused_mtp)(model)
    MTPLossLoggingHelper.tracker.clear()
    calls = []
    handle = model.output_layer.register_forward_hook(lambda *_: calls.append(1))   # logits made
    model.zero_grad(set_to_none=True)
    try:
        if processor:
            out = env.run_fused(model, ids, pos, mask, labels, 1.0)
            loss = (weights[0] * out.logprobs).sum() + (weights[1] * out.entropy).sum()
        else:
            out = model(ids, pos, mask, labels=labels, loss_mask=loss_mask)
            loss = (weights[0][..., None] * out).sum() if labels is None else (weights[0] * out).sum()
        loss.backward()
    finally:
        handle.remove()
    tracker = {k: v.clone() for k, v in MTPLossLoggingHelper.tracker.items() if torch.is_tensor(v)}
    return out, env.param_grads(model), tracker, len(calls)


def check_grads(env, got, want):
    mtp = [n for n in want if n.startswith("mtp.")]
    assert mtp and all(want[n] is not None and want[n].norm() > 0 for n in mtp)
    for name, g in want.items():
        assert (g is None) == (got[name] is None), name
        if g is not None and g.norm() > 0:
            assert env.rel_err(got[name], g) <= GRAD_TOL, (name, env.rel_err(got[name], g))


@pytest.mark.parametrize("kind", ["gpt", "gpt-tied-mup", "hybrid", "hybrid-tied", "gpt-legacy"])
def test_fused_mtp_equals_megatrons_mtp_loss(megatron_tp1, seed, kind):
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = build(env, kind, seed).train()
    b, s = 2, 11
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    loss_mask = (torch.rand(b, s, generator=gen) > 0.25).float()
    w = (torch.randn(b, s, generator=gen),)
    assert patch_fused_forward(model) == ("legacy" if kind.startswith("hybrid") or "legacy" in kind else "hook")
    assert fused_mtp_enabled(model)
    # make some depth-1 predictions right, so the acceptance counts are not all 0: Megatron's MTP
    # logits of depth 1 at position t score labels[t + 1]
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from logitless.megatron.mtp import disable_fused_mtp
    disable_fused_mtp(model)
    MTPLossLoggingHelper.tracker.clear()              # sized by the first model that logs (other tests: 1 depth)
    seen = []
    handle = model.output_layer.register_forward_hook(lambda m, i, o: seen.append(o[0].detach()))
    with torch.no_grad():
        model(ids, pos, mask, labels=labels, loss_mask=loss_mask)
    handle.remove()
    preds = seen[0].argmax(-1).t()                     # [b, s], depth 1
    labels[:, 1::2] = preds[:, 0:s - 1:2]
    labels[0, 4] = -100                                # out of range, loss mask 1: megatron-core's lse - max
    loss_mask[0, 3] = loss_mask[0, 4] = 1.0
    want, g_want, t_want, n_want = run(env, model, False, ids, pos, mask, labels, loss_mask, w)
    got, g_got, t_got, n_got = run(env, model, True, ids, pos, mask, labels, loss_mask, w)
    assert n_want == 3 and n_got == 1          # Megatron: 2 MTP depths + main; fused: main only
    assert (got - want).abs().max() <= LP_TOL   # the main loss (Megatron's own, unchanged)
    check_grads(env, g_got, g_want)
    assert set(t_got) == set(t_want) and t_want["loss_values"].abs().min() > 0
    assert torch.allclose(t_got["loss_values"], t_want["loss_values"], rtol=1e-5, atol=0)
    assert torch.equal(t_got["correct_values"], t_want["correct_values"]) and t_want["correct_values"][0] > 0
    assert torch.equal(t_got["total_values"], t_want["total_values"])
    unpatch_fused_forward(model)
    assert not fused_mtp_enabled(model)


@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
def test_fused_mtp_with_the_processor_and_without_labels(megatron_tp1, seed, kind):
    """With logitless' processor: no output-layer call at all; values and gradients equal to the
    model's own logits with Megatron's MTP losses. labels=None (RL): MTP labels derived from the
    input ids, the same on both paths."""
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = build(env, kind, seed).train()
    patch_fused_forward(model)
    b, s = 2, 9
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    w = (torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen))
    out, g_got, t_got, calls = run(env, model, True, ids, pos, mask, labels, None, w, processor=True)
    assert calls == 0 and last_path().backend is not None
    from logitless.megatron.mtp import disable_fused_mtp
    disable_fused_mtp(model)
    model.zero_grad(set_to_none=True)
    lp, ent = env.reference_from_logits(env.unfused_logits_with_labels(model, ids, pos, mask, labels), labels)
    ((w[0] * lp).sum() + (w[1] * ent).sum()).backward()
    assert (out.logprobs.double() - lp).abs().max() <= LP_TOL and (out.entropy.double() - ent).abs().max() <= ENT_TOL
    check_grads(env, g_got, env.param_grads(model))

    wl = (torch.randn(b, s, generator=gen),)
    want, g_want, _, _ = run(env, model, False, ids, pos, mask, None, None, wl)
    got, g_got, _, calls = run(env, model, True, ids, pos, mask, None, None, wl)
    assert calls == 1 and torch.equal(got, want) and got.shape == (b, s, model.vocab_size)
    check_grads(env, g_got, g_want)


def test_blockwise_argmax_equals_argmax_of_the_logits(monkeypatch, seed):
    from logitless.megatron import mtp
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(7, 3, 24, generator=gen)
    weight = torch.randn(263, 24, generator=gen)
    weight[17] *= 10                                  # a row no other can outscore at hidden = that row
    weight[200] = weight[17]                          # a tie: the lowest id wins, as torch.argmax
    hidden[2, 1] = weight[17]
    monkeypatch.setattr(mtp, "_ARGMAX_BLOCK", 263 * 4)  # 4 tokens per block
    got = mtp.blockwise_argmax(hidden, weight, None)
    assert torch.equal(got, (hidden @ weight.t()).argmax(-1)) and got[2, 1] == 17


def test_fused_mtp_through_forward_packed(megatron_tp1, seed, monkeypatch):
    """THD packing (forward_packed): megatron-core rolls the MTP labels within each packed sequence, and
    the rolled labels hold -100 at each sequence's end (loss mask 1 there: megatron-core scores them with
    the log-sum-exp); the fused MTP losses give megatron-core's gradients there too."""
    from logitless.megatron import forward_packed, patch
    from logitless.megatron.mtp import disable_fused_mtp
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = env.build_gpt(mtp=1, packed_attention=True, seed=seed).train()
    seqs = [torch.randint(0, 262, (n,), generator=gen) for n in (7, 12, 5)]
    w = [torch.randn(q.numel(), generator=gen) for q in seqs]
    results = []
    for fused in (True, False):
        if not fused:                                 # the reference: megatron-core's own MTP loss
            disable_fused_mtp(model)
            monkeypatch.setattr(patch, "enable_fused_mtp", lambda m: False)
        model.zero_grad(set_to_none=True)
        out = forward_packed(model, seqs, temperature=0.9, with_entropy=False, strict=True)
        sum((a * lp).sum() for a, lp in zip(w, out.logprobs, strict=True)).backward()
        results.append((out, env.param_grads(model)))
    (got, g_got), (want, g_want) = results
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert (a - b).abs().max() <= LP_TOL
    check_grads(env, g_got, g_want)


class LargestTensors:
    """While open, records the shape of every tensor an aten op returns (forward and backward) whose number of
    elements reaches ``limit``: what a [tokens x vocab] logits tensor of any MTP depth would be caught by."""

    def __init__(self, limit: int):
        from torch.utils._python_dispatch import TorchDispatchMode
        seen = self.seen = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.numel() >= limit:
                        seen.append((str(func), tuple(t.shape)))
                return out
        self.mode = Mode()

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


@pytest.mark.parametrize("kind", ["gpt", "hybrid-tied"])
def test_no_tokens_by_vocab_tensor_at_any_depth(megatron_tp1, seed, kind, monkeypatch):
    """A training step (forward and backward, MTP tracker on) of a model with two MTP depths through
    logitless' processor creates no tensor as large as one depth's [tokens x vocab] logits, anywhere (the
    fused op's tiles and the acceptance argmax's blocks made small here); megatron-core's own step does."""
    from logitless.megatron import mtp
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = build(env, kind, seed).train()
    patch_fused_forward(model)
    b, s = 2, 40                                       # tokens per depth (80) above the hidden size (48)
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    w = (torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen))
    limit = b * s * model.vocab_size
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", "4096")        # tiles of 4 tokens x 262
    monkeypatch.setattr(mtp, "_ARGMAX_BLOCK", 4 * model.vocab_size)
    with LargestTensors(limit) as fused:
        out, _, tracker, calls = run(env, model, True, ids, pos, mask, labels, None, w, processor=True)
    assert calls == 0 and fused.seen == [], fused.seen[:5]
    assert tracker["loss_values"].abs().min() > 0      # both depths' losses were computed (and logged)
    with LargestTensors(limit) as megatron:            # the detector sees the logits of megatron-core's step
        run(env, model, False, ids, pos, mask, labels, None, (w[0],))
    assert len(megatron.seen) >= 3, megatron.seen      # main + 2 MTP depths' logits at least


def test_unknown_process_mtp_loss_arguments_warn_or_refuse_in_strict_mode(megatron_tp1, seed, monkeypatch):
    """A newer megatron-core calling process_mtp_loss with an argument the fused MTP losses do not know: the
    opted-in model gets megatron-core's own (unfused) MTP losses with a RuntimeWarning naming it, not a silent
    fallback; strict mode refuses with FusedPathUnavailable."""
    from logitless.megatron import FusedPathUnavailable, mtp
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    model = build(env, "gpt", seed).train()
    patch_fused_forward(model)
    b, s = 2, 9
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    w = (torch.randn(b, s, generator=gen),)
    want, g_want, _, n_want = run(env, model, False, ids, pos, mask, labels, None, w)     # megatron-core's own

    # a release whose caller passes an argument this version does not know: here, input_ids made unknown
    monkeypatch.setattr(mtp, "_KNOWN_ARGS", mtp._KNOWN_ARGS - {"input_ids"})
    with pytest.warns(RuntimeWarning, match="input_ids"):
        got, g_got, _, n_got = run(env, model, True, ids, pos, mask, labels, None, w)
    assert n_got == n_want == 3 and torch.equal(got, want)     # megatron-core's MTP losses, its numbers
    check_grads(env, g_got, g_want)
    monkeypatch.setenv("LOGITLESS_STRICT", "1")
    with pytest.raises(FusedPathUnavailable, match="input_ids"):
        run(env, model, True, ids, pos, mask, labels, None, w)


def test_processor_without_patch_warns_then_fuses_or_refuses_in_strict_mode(megatron_tp1, seed, monkeypatch):
    """The processor passed straight to an MTP model's forward (hook mode, no patch_fused_forward): megatron-core
    computed that forward's MTP losses from full logits before the processor ran, so the processor says so (a
    RuntimeWarning) and opts the model in: the next forward makes no output-layer call at all. Strict mode
    refuses instead. The numbers are the same either way."""
    from logitless.megatron import FusedPathUnavailable
    env = megatron_tp1
    gen = torch.Generator().manual_seed(seed)
    b, s = 2, 9
    model = build(env, "gpt", seed).train()
    ids, pos, labels = env.random_batch(b, s, model.vocab_size, gen)
    mask = env.causal_mask(s)
    w = (torch.randn(b, s, generator=gen), torch.randn(b, s, generator=gen))
    monkeypatch.setenv("LOGITLESS_STRICT", "1")
    with pytest.raises(FusedPathUnavailable, match="patch_fused_forward"):
        with torch.no_grad():
            env.run_fused(model, ids, pos, mask, labels, 1.0)
    assert not fused_mtp_enabled(model)
    monkeypatch.delenv("LOGITLESS_STRICT")

    calls = []
    handle = model.output_layer.register_forward_hook(lambda *_: calls.append(1))
    outs = []
    try:
        for expect_warning in (True, False):
            calls.clear()
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = env.run_fused(model, ids, pos, mask, labels, 1.0)
            ours = [c for c in caught if "patch_fused_forward" in str(c.message)]
            assert len(ours) == int(expect_warning) and all(c.category is RuntimeWarning for c in ours)
            ((w[0] * out.logprobs).sum() + (w[1] * out.entropy).sum()).backward()
            outs.append((out, env.param_grads(model), len(calls)))
    finally:
        handle.remove()
    (first, g_first, n_first), (second, g_second, n_second) = outs
    assert n_first == 2 and n_second == 0 and fused_mtp_enabled(model)   # 2 MTP depths' logits, then none
    assert (first.logprobs - second.logprobs).abs().max() <= LP_TOL
    check_grads(env, g_second, g_first)
