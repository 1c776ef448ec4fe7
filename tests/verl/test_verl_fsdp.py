"""verl's FSDP-side fused forward (verl.models.transformers.dense_common: forward_with_torch_backend
for the "torch" / "liger" backends, forward_with_triton_backend for "triton") on a tiny transformers
Qwen2 with logitless installed, against verl's own unfused path (the model's logits, divided by the
temperature, through verl.utils.torch_functional's logprobs_from_logits / entropy_from_logits) and
against verl's own FusedLinearForPPO: values and every parameter gradient."""
import pytest
import torch

from required import import_or_skip

import_or_skip("verl.models.transformers.dense_common", "make setup installs verl (--no-deps) and its import deps")

from verl.models.transformers import dense_common  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402

import logitless.verl as lv  # noqa: E402
from logitless.record import serial_now  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

V = 301
LP_TOL = ENT_TOL = 2e-5
GRAD_TOL = 1e-4


@pytest.fixture(autouse=True)
def uninstalled_after():
    yield
    lv.uninstall()


def tiny_qwen2(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=V, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
                      attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)         # spread the logits so log-probs and entropies vary
    return model


def batch(gen, b=3, s=9):
    ids = torch.randint(0, V, (b, s), generator=gen)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, 6:] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, pos


def verl_unfused(model, ids, mask, pos, temperature, shift_labels=None):
    """verl's engine without fused kernels: logits / temperature, then its log-prob and entropy functions."""
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits / temperature
    labels = shift_labels if shift_labels is not None else torch.roll(ids, -1, dims=-1)
    return verl_F.logprobs_from_logits(logits, labels), verl_F.entropy_from_logits(logits)


def run_and_grads(model, fn, a, c):
    model.zero_grad(set_to_none=True)
    lp, ent = fn()
    ((a * lp).sum() + (c * ent.float()).sum()).backward()
    return lp, ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(fused, ref):
    lp, ent, g = fused
    lp_r, ent_r, g_r = ref
    assert lp.dtype == torch.float32 and lp.shape == lp_r.shape and ent.shape == ent_r.shape
    assert float((lp - lp_r).abs().max()) <= LP_TOL
    assert float((ent.float() - ent_r.float()).abs().max()) <= ENT_TOL
    assert g.keys() == g_r.keys() and g_r
    for name, gr in g_r.items():
        assert float((g[name] - gr).norm() / gr.norm().clamp_min(1e-30)) <= GRAD_TOL, name


def _grad_fn_names(t):
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        names.add(type(f).__name__)
        todo.extend(n for n, _ in f.next_functions)
    return names


@pytest.mark.parametrize("entry", ["torch", "triton"])
def test_fused_forward_matches_verl_unfused(seed, entry):
    gen = torch.Generator().manual_seed(seed)
    model = tiny_qwen2(seed)
    ids, mask, pos = batch(gen)
    a, c = torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)
    forward = dense_common.forward_with_torch_backend if entry == "torch" else dense_common.forward_with_triton_backend

    def fused():
        out = forward(model, input_ids=ids, attention_mask=mask, position_ids=pos, temperature=0.8, return_dict=True)
        # verl's Triton-backend forward returns its kernel's flat [b * s] outputs, the torch one [b, s]
        assert out.log_probs.shape == (ids.shape if entry == "torch" else (ids.numel(),))
        return out.log_probs.view(ids.shape), out.entropy.view(ids.shape)

    lv.install()
    got = run_and_grads(model, fused, a, c)
    names = _grad_fn_names(got[0])
    assert not any("FusedLinearForPPO" in n or "LinearCrossEntropy" in n for n in names), names
    ref = run_and_grads(model, lambda: verl_unfused(model, ids, mask, pos, 0.8), a, c)
    assert_close(got, ref)
    if entry == "torch":   # verl's own fused torch implementation (runs on CPU) agrees too
        lv.uninstall()
        own = run_and_grads(model, fused, a, c)
        assert any("FusedLinearForPPO" in n for n in _grad_fn_names(own[0]))
        assert_close(got, own)


def test_remove_padding_shift_labels(seed):
    """The engine's remove-padding call: one packed row [1, nnz], positions restarting per sequence,
    labels rolled on the global sequence and passed as shift_labels."""
    gen = torch.Generator().manual_seed(seed)
    model = tiny_qwen2(seed)
    lens = [5, 3, 6]
    ids = torch.randint(0, V, (1, sum(lens)), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    shift = torch.roll(ids, -1, dims=-1)
    a, c = torch.randn(ids.shape, generator=gen), torch.randn(ids.shape, generator=gen)

    def fused():
        out = dense_common.forward_with_torch_backend(model, input_ids=ids, position_ids=pos, temperature=1.1,
                                                      return_dict=True, shift_labels=shift)
        return out.log_probs, out.entropy

    lv.install()
    got = run_and_grads(model, fused, a, c)
    ref = run_and_grads(model, lambda: verl_unfused(model, ids, None, pos, 1.1, shift_labels=shift), a, c)
    assert_close(got, ref)


def test_through_verl_monkey_patch(seed):
    """verl's own patch_forward_with_backends (what apply_monkey_patch runs for use_fused_kernels=True):
    model(..., temperature=, return_dict=True) returns verl's CausalLMOutputForPPO from logitless."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    gen = torch.Generator().manual_seed(seed)
    model = tiny_qwen2(seed)
    ids, mask, pos = batch(gen)
    cls_forward = Qwen2ForCausalLM.forward
    lv.install()
    since = serial_now()
    try:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, temperature=0.6, return_dict=True)
    finally:
        Qwen2ForCausalLM.forward = cls_forward        # verl patches the class; give it back to the other tests
    assert type(out).__name__ == "CausalLMOutputForPPO" and out.logits is None
    with torch.no_grad():
        lp, ent = verl_unfused(model, ids, mask, pos, 0.6)
    assert float((out.log_probs - lp).abs().max()) <= LP_TOL
    assert float((out.entropy - ent).abs().max()) <= ENT_TOL
    assert lv.last_backend() in ("chunked", "triton")
    rec = lv.last_path()         # the fused-kernel head's record, written during that forward
    assert rec.serial > since and (rec.path, rec.entry) == ("fused", "verl.fused_kernels"), rec
    assert rec.backend == lv.last_backend() and rec.precision is not None


def test_dtypes_follow_verl(seed):
    """bf16: log-probs float32; the entropy in the hidden dtype for the "torch" backend (as verl's kernel
    returns it), float32 for "liger" and for the triton-backend function (verl's kernel returns float32)."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 5, 16, generator=gen).bfloat16()
    w = torch.randn(V, 16, generator=gen).bfloat16()
    y = torch.randint(0, V, (2, 5), generator=gen)
    lv.install()
    lp, ent = FusedLinearForPPO(impl_backend="torch")(h, w, y, 0.9)
    assert lp.dtype == torch.float32 and ent.dtype == torch.bfloat16 and lp.shape == ent.shape == (2, 5)
    lp2, ent2 = FusedLinearForPPO(impl_backend="liger")(h, w, y, 0.9)
    assert ent2.dtype == torch.float32 and torch.equal(lp, lp2)
    lp_flat, ent_flat = FusedLinearForPPO()(h[0], w, y[0], 0.9)
    lp_one, _ = FusedLinearForPPO()(h[:1], w, y[:1], 0.9)
    # bitwise against the same 5 rows batched; against rows of a 10-row batch only to rounding (the CPU's
    # bf16 product of 5 rows may round differently from that of 10)
    assert lp_flat.shape == (5,) and torch.equal(lp_flat, lp_one[0])
    assert torch.allclose(lp_flat, lp[0], rtol=0, atol=1e-5)
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    lp3, ent3 = linear_cross_entropy(h, w, y, 0.9, "none")
    assert lp3.shape == (10,) and ent3.dtype == torch.float32 and torch.equal(lp3, lp.reshape(-1))
    s, m = linear_cross_entropy(h, w, y, 0.9, "sum")[0], linear_cross_entropy(h, w, y, 0.9, "mean")[0]
    assert s.dim() == 0 and torch.allclose(s, lp.sum()) and torch.allclose(m, lp.mean())


def test_bad_input_names_the_argument(seed):
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    h, w, y = torch.randn(4, 8), torch.randn(V, 8), torch.randint(0, V, (4,))
    lv.install()
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy  # the module attribute, now logitless'
    f = FusedLinearForPPO()
    with pytest.raises(ValueError, match="hidden_states"):
        f(torch.randn(1, 2, 4, 8), w, torch.zeros(1, 2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        f(h, w, y[:3])
    with pytest.raises(TypeError, match="input_ids"):
        f(h, w, y.float())
    with pytest.raises(ValueError, match="temperature"):
        f(h, w, y, 0.0)
    with pytest.raises(TypeError, match="temperature"):
        linear_cross_entropy(h, w, y, torch.tensor(1.0), "none")
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, w, y, 1.0, "avg")
    with pytest.raises(ValueError, match="labels"):
        linear_cross_entropy(h, w, y[:3], 1.0, "none")
