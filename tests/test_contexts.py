"""fused_logprobs and fused_policy_loss in the contexts trainers run them in: torch.autocast, no_grad,
inference_mode, torch.compile(fullgraph=True), check_inputs=False and CUDA-graph capture.

Under autocast the ops take their operands as F.linear would (cast to the autocast dtype) and compute on
those exactly: float32 logits, never rounded. So the truth here is float64 of the cast operands.
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import logitless.ops.policy_chunked as policy_chunked
from cuda_graph import capture, replay_poisoned
from logitless import fused_logprobs, last_backend, last_precision
from logitless.losses import fused_policy_loss
from policy64 import loss64, policy_inputs
from reference64 import TOL, logprobs_entropy64, rel_err, tol_for

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
LEAD, H, V = (3, 5), 48, 517          # small odd shapes: the triton backend runs in the interpreter on CPU
LP_TOL = 2e-4                          # the promise under autocast: log-prob error against float64
# gradients (relative norm): they come back in the cast operands' dtype (as F.linear's do under autocast),
# and on CUDA the backward's dlogits are rounded to it too (tensor-core GEMMs)
GRAD_TOL = {torch.bfloat16: TOL[torch.bfloat16][2], torch.float16: TOL[torch.float16][2]}


def as_used(t, dtype):
    """What autocast makes of an operand: float32 / bfloat16 / float16 cast to its dtype."""
    return t.detach().to(dtype).double()


# ------------------------------------------------------------------------------------------ autocast

@pytest.mark.parametrize("backend", ["chunked", "reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("operands", ["float32", "bf16 hidden, fp32 weight"])
def test_fused_logprobs_under_autocast(backend, dtype, operands, seed):
    torch.manual_seed(seed)
    hidden, weight, labels = policy_inputs(LEAD, H, V, device=DEVICE)[:3]
    hidden = torch.where(labels.unsqueeze(-1) == -100, 0.0, hidden)      # finite everywhere
    if operands != "float32":
        hidden = hidden.bfloat16()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    a, b = torch.randn(LEAD, device=DEVICE), torch.randn(LEAD, device=DEVICE)
    temperature = torch.rand(LEAD[0], 1, device=DEVICE) + 0.5
    with torch.autocast(DEVICE, dtype=dtype):
        out = fused_logprobs(h, w, labels, temperature=temperature, backend=backend)
        loss = (out.logprobs * a).sum() + (out.entropy * b).sum()
    loss.backward()
    assert last_backend() == backend
    assert out.logprobs.dtype == out.entropy.dtype == torch.float32
    assert h.grad.dtype == h.dtype and w.grad.dtype == torch.float32      # as F.linear's: the leaves' dtypes

    h64, w64 = as_used(hidden, dtype).requires_grad_(True), as_used(weight, dtype).requires_grad_(True)
    lp64, ent64 = logprobs_entropy64(h64, w64, labels, temperature)
    ((lp64 * a).sum() + (ent64 * b).sum()).backward()
    assert (out.logprobs - lp64).abs().max() <= LP_TOL
    assert (out.entropy - ent64).abs().max() <= LP_TOL
    # the gradient reaches each leaf through the cast, as through F.linear's
    assert rel_err(h.grad, h64.grad) <= GRAD_TOL[dtype] and rel_err(w.grad, w64.grad) <= GRAD_TOL[dtype]


@pytest.fixture
def autocast_of_the_other_device_type():
    """Autocast switched on for the device type the tensors are not on (its state is per device type; set
    directly, as torch.autocast("cuda") refuses to switch on where CUDA is missing)."""
    other = "cpu" if DEVICE == "cuda" else "cuda"
    torch.set_autocast_enabled(other, True)
    try:
        yield other
    finally:
        torch.set_autocast_enabled(other, False)


def test_autocast_of_another_device_type_changes_nothing(autocast_of_the_other_device_type):
    hidden, weight, labels = policy_inputs(LEAD, H, V, device=DEVICE)[:3]
    hidden = torch.where(labels.unsqueeze(-1) == -100, 0.0, hidden)
    torch.set_autocast_enabled(autocast_of_the_other_device_type, False)
    plain = fused_logprobs(hidden, weight, labels, backend="chunked")
    torch.set_autocast_enabled(autocast_of_the_other_device_type, True)
    assert torch.is_autocast_enabled(autocast_of_the_other_device_type)
    got = fused_logprobs(hidden, weight, labels, backend="chunked")
    assert torch.equal(got.logprobs, plain.logprobs) and torch.equal(got.entropy, plain.entropy)
    with pytest.raises(TypeError, match="under torch.autocast only"):
        fused_logprobs(hidden.bfloat16(), weight, labels)


# (hidden's dtype, weight's dtype): float32 operands; the model's bf16 hidden states with a float32 head; and the
# two half types crossed (F.linear under autocast casts both to the autocast dtype whatever they were)
POLICY_OPERANDS = {"float32": (torch.float32, torch.float32),
                   "bf16 hidden, fp32 weight": (torch.bfloat16, torch.float32),
                   "bf16 hidden, fp16 weight": (torch.bfloat16, torch.float16)}


@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("operands", list(POLICY_OPERANDS))
def test_fused_policy_loss_under_autocast(backend, dtype, operands, seed):
    torch.manual_seed(seed)
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, device=DEVICE)
    hidden_dtype, weight_dtype = POLICY_OPERANDS[operands]
    hidden, weight = hidden.to(hidden_dtype), weight.to(weight_dtype)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    spec = dict(ref_logprobs=ref, kl_coef=0.05, entropy_coef=0.01)
    with torch.autocast(DEVICE, dtype=dtype):
        out = fused_policy_loss(h, w, labels, adv, old, backend=backend, **spec)
    out.loss.backward()
    assert out.loss.dtype == out.logprobs.dtype == torch.float32
    assert h.grad.dtype == hidden_dtype and w.grad.dtype == weight_dtype     # as F.linear's: the leaves' dtypes
    want = loss64(as_used(hidden, dtype), as_used(weight, dtype), labels, adv, old, ref=ref, kl_coef=0.05,
                  entropy_coef=0.01)
    valid = labels != -100
    assert (out.logprobs - want[1])[valid].abs().max() <= LP_TOL
    assert (out.entropy - want[2])[valid].abs().max() <= LP_TOL
    assert abs(float(out.loss) - float(want[0])) <= LP_TOL
    assert abs(float(out.kl) - float(want[4])) <= LP_TOL
    tol = GRAD_TOL[dtype]
    assert rel_err(h.grad[valid], want[5][valid]) <= tol and rel_err(w.grad, want[6]) <= tol
    assert (h.grad[~valid] == 0).all()


# ------------------------------------------------------------------------------------------ no_grad

def count_calls(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def counted(*args, **kw):
        calls.append(name)
        return original(*args, **kw)
    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no input requires grad"])
def test_policy_loss_without_grad_gives_the_same_numbers(backend, mode, monkeypatch, seed):
    torch.manual_seed(seed)
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, device=DEVICE)
    kw = dict(ref_logprobs=ref, kl_coef=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-mean", backend=backend)
    with_grad = fused_policy_loss(hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True),
                                  labels, adv, old, **kw)
    if backend == "triton":
        import logitless.ops.triton.policy_backend as module
    else:
        module = policy_chunked
    # the gradient stage and every gradient product the pass's module calls, by whichever names it imports (the
    # chunked pass: dlogits in row blocks, all its products through accumulate_product; the triton pass: its
    # dlogits kernel, products through both)
    gradient_stage = [count_calls(monkeypatch, module, name) for name in
                      ("dlogits_in_place", "dlogits_in_blocks", "dlogits_from_logits") if hasattr(module, name)]
    products = [count_calls(monkeypatch, module, name) for name in ("product_into", "accumulate_product")
                if hasattr(module, name)]
    if mode == "no_grad":
        with torch.no_grad():
            got = fused_policy_loss(hidden.requires_grad_(True), weight, labels, adv, old, **kw)
    elif mode == "inference_mode":
        with torch.inference_mode():
            got = fused_policy_loss(hidden, weight, labels, adv, old, **kw)
    else:
        got = fused_policy_loss(hidden, weight, labels, adv, old, **kw)
    assert not got.loss.requires_grad
    assert gradient_stage and products         # the statistics only: no gradient stage, no gradient GEMM
    assert all(c == [] for c in gradient_stage + products), (gradient_stage, products)
    for g, w in zip(got, with_grad, strict=True):
        assert torch.allclose(g, w.detach(), rtol=1e-6, atol=1e-7), (g, w)
    want = loss64(*(t.cpu() for t in (hidden, weight, labels, adv, old)), ref=ref.cpu(), kl_coef=0.1,
                  entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    assert abs(float(got.loss) - float(want[0])) <= 1e-5


@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_policy_loss_under_autocast_without_grad(backend, mode, seed):
    # the statistics-only pass takes the cast operands too (it once returned the loss of the uncast ones)
    torch.manual_seed(seed)
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, device=DEVICE)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context(), torch.autocast(DEVICE, dtype=torch.bfloat16):
        out = fused_policy_loss(hidden, weight, labels, adv, old, ref_logprobs=ref, kl_coef=0.05, backend=backend)
    want = loss64(as_used(hidden, torch.bfloat16), as_used(weight, torch.bfloat16), labels, adv, old, ref=ref,
                  kl_coef=0.05)
    valid = labels != -100
    assert out.loss.dtype == torch.float32 and not out.loss.requires_grad
    assert abs(float(out.loss) - float(want[0])) <= LP_TOL and abs(float(out.kl) - float(want[4])) <= LP_TOL
    assert (out.logprobs - want[1])[valid].abs().max() <= LP_TOL


# ------------------------------------------------------------------------------------------ compile

def policy_step(hidden, weight, labels, adv, old, ref, **kw):
    out = fused_policy_loss(hidden, weight, labels, adv, old, ref_logprobs=ref, kl_coef=0.05, entropy_coef=0.01,
                            **kw)
    return out.loss * 2.0, out.logprobs, out.entropy, out.clip_fraction, out.kl


def run_step(fn, hidden, weight, *args, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss, *metrics = fn(h, w, *args, **kw)
    loss.backward()
    return [loss.detach(), *(m.detach() for m in metrics), h.grad, w.grad]


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_compiled_policy_loss_matches_eager(backend, seed):
    torch.manual_seed(seed)
    torch._dynamo.reset()
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V)
    explained = torch._dynamo.explain(policy_step)(hidden, weight, labels, adv, old, ref, backend=backend)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(policy_step, fullgraph=True)
    got = run_step(compiled, hidden, weight, labels, adv, old, ref, backend=backend)
    assert last_backend() == backend
    eager = run_step(policy_step, hidden, weight, labels, adv, old, ref, backend=backend)
    for g, e in zip(got, eager, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert torch.allclose(g, e, rtol=1e-5, atol=1e-7), (g - e).abs().max()
    want = loss64(hidden, weight, labels, adv, old, ref=ref, kl_coef=0.05, entropy_coef=0.01)
    valid = labels != -100
    assert abs(float(got[0]) / 2 - float(want[0])) <= 1e-5
    assert rel_err(got[5][valid], want[5][valid] * 2) <= 1e-4 and rel_err(got[6], want[6] * 2) <= 1e-4


def test_compiled_under_autocast_matches_eager(seed):
    # autocast entered inside the compiled region: the ops see it while tracing and cast as in eager
    torch.manual_seed(seed)
    torch._dynamo.reset()
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V)

    def step(h, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fused_policy_loss(h, w, labels, adv, old, backend="chunked")
            lp = fused_logprobs(h, w, labels, backend="chunked").logprobs
        return out.loss + lp.sum(), out.logprobs, lp

    got = run_step(torch.compile(step, fullgraph=True), hidden, weight)
    eager = run_step(step, hidden, weight)
    for g, e in zip(got, eager, strict=True):
        assert torch.allclose(g, e, rtol=1e-6, atol=1e-7)
    lp64, _ = logprobs_entropy64(as_used(hidden, torch.bfloat16), as_used(weight, torch.bfloat16), labels)
    valid = labels != -100
    assert (got[2] - lp64)[valid].abs().max() <= LP_TOL


DYNAMIC_BACKEND = "triton" if CUDA else "chunked"      # the triton backend is opaque to the compiler either way


def float_step(hidden, weight, labels, adv, old, ref, temperature, kl_coef, clip_low):
    out = fused_policy_loss(hidden, weight, labels, adv, old, ref_logprobs=ref, kl_coef=kl_coef, clip_low=clip_low,
                            temperature=temperature, backend=DYNAMIC_BACKEND)
    lp = fused_logprobs(hidden, weight, labels, backend=DYNAMIC_BACKEND)     # its default temperature: a float too
    return out.loss + 1e-2 * lp.logprobs.sum(), out.logprobs, out.kl, lp.entropy


def test_compiled_with_dynamic_shapes_and_float_arguments(seed):
    # dynamic=True makes the float arguments (and the ops' float defaults) symbolic: the ops' number checks must
    # trace them (math.isfinite cannot), and the values must still be those of eager for every shape and setting
    torch.manual_seed(seed)
    torch._dynamo.reset()
    compiled = torch.compile(float_step, fullgraph=True, dynamic=True)
    for lead, settings in (((3, 5), (0.7, 0.05, 0.2)), ((2, 9), (1.3, 0.1, 0.3))):
        hidden, weight, labels, adv, old, ref = policy_inputs(lead, H, V, device=DEVICE)
        got = run_step(compiled, hidden, weight, labels, adv, old, ref, *settings)
        eager = run_step(float_step, hidden, weight, labels, adv, old, ref, *settings)
        for g, e in zip(got, eager, strict=True):
            assert g.shape == e.shape and torch.allclose(g, e, rtol=1e-5, atol=1e-6), (lead, (g - e).abs().max())
        # and the settings reached the op: the log-probs at this temperature, the KL at this coefficient
        want = loss64(hidden, weight, labels, adv, old, ref=ref, kl_coef=settings[1], clip_low=settings[2],
                      temperature=settings[0])
        valid = labels != -100
        # float32 operands: the bounds of the precision that ran (the bf16x3 split on CUDA, IEEE on the CPU)
        assert last_precision().statistics == ("bf16x3" if CUDA else "ieee")
        tol = tol_for(torch.float32, last_precision())[0]
        assert (got[1] - want[1])[valid].abs().max() <= tol and abs(float(got[2]) - float(want[4])) <= tol
    # a number refused while tracing: under fullgraph=True torch reports it as its own Unsupported error whose
    # text carries the op's ValueError (the argument named, its value shown); how torch links the two (its
    # __cause__) differs between torch releases
    with pytest.raises(Exception, match="clip_low must lie in"):
        compiled(hidden, weight, labels, adv, old, ref, 0.7, 0.05, 1.5)


def test_compiled_policy_loss_still_checks_inputs():
    torch._dynamo.reset()
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V)
    compiled = torch.compile(policy_step, fullgraph=True)
    labels[1, 3] = V
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 517\)"):
        compiled(hidden, weight, labels, adv, old, ref, backend="chunked")


def test_a_second_backward_is_refused():
    hidden, weight, labels, adv, old, _ = policy_inputs(LEAD, H, V)
    h = hidden.clone().requires_grad_(True)
    loss = fused_policy_loss(h, weight, labels, adv, old).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


# ------------------------------------------------------------------------------------------ unchecked

@pytest.mark.parametrize("backend", ["chunked", "triton"])
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_unchecked_policy_loss_matches_the_checked_one(backend, loss_agg, seed):
    # check_inputs=False computes every row; padding's NaN per-token inputs must reach nothing (the hidden
    # rows there must be finite: an unchecked call does not isolate them)
    torch.manual_seed(seed)
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, device=DEVICE)
    hidden = torch.where(labels.unsqueeze(-1) == -100, 0.5, hidden)
    kw = dict(backend=backend, loss_agg=loss_agg, temperature=torch.rand(LEAD[0], 1, device=DEVICE) + 0.5)
    checked = run_step(policy_step, hidden, weight, labels, adv, old, ref, **kw)
    unchecked = run_step(policy_step, hidden, weight, labels, adv, old, ref, check_inputs=False, **kw)
    # the two calls cut the rows into different chunks: per-token values differ by float32 rounding of
    # logit - logsumexp, a few ulps of the row's largest |logit / T| (not of the log-prob itself)
    z = hidden.double() @ weight.double().T / kw["temperature"].double()[..., None]
    row_atol = 1e-6 + 8 * 2.0 ** -24 * z.abs().amax(-1).float()
    for i, (g, c) in enumerate(zip(unchecked[:5], checked[:5], strict=True)):
        atol = row_atol if g.shape == labels.shape else 1e-6
        assert torch.isfinite(g).all() and ((g - c).abs() <= atol + 1e-5 * c.abs()).all(), (i, g, c)
    assert (unchecked[1][labels == -100] == 0).all() and (unchecked[5][labels == -100] == 0).all()
    tol = 1e-2 if CUDA else 1e-5
    assert rel_err(unchecked[5], checked[5]) <= tol and rel_err(unchecked[6], checked[6]) <= tol


def test_unchecked_policy_loss_checks_nothing():
    hidden, weight, labels, adv, old, _ = policy_inputs(LEAD, H, V)
    hidden = torch.where(labels.unsqueeze(-1) == -100, 0.5, hidden)
    b, s = (labels != -100).nonzero()[0].tolist()      # a scored token (its inputs are finite)
    labels[b, s] = V + 3                      # out of range: no label, no error, no crash
    out = fused_policy_loss(hidden, weight, labels, adv, old, check_inputs=False)
    assert torch.isfinite(out.loss) and out.logprobs[b, s] < 0
    with pytest.raises(ValueError, match="labels must lie"):
        fused_policy_loss(hidden, weight, labels, adv, old)


# ------------------------------------------------------------------------------------------ CUDA graphs

@pytest.mark.skipif(not CUDA, reason="CUDA-graph capture needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_cuda_graph_capture_of_a_policy_loss_step(backend):
    # a whole step (forward, loss, backward) captured once with check_inputs=False, replayed on new inputs
    # copied into the captured buffers; every replayed output is compared with an eager call on those inputs
    hidden, weight, labels, adv, old, ref = policy_inputs(LEAD, H, V, torch.bfloat16, device="cuda")
    fix = labels.unsqueeze(-1) == -100
    hidden = torch.where(fix, 0.5, hidden.float()).bfloat16()
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    static = dict(labels=labels.clone(), adv=adv.clone(), old=old.clone(), ref=ref.clone())

    def captured_step():
        loss, *metrics = policy_step(h, w, static["labels"], static["adv"], static["old"], static["ref"],
                                     backend=backend, check_inputs=False)
        loss.backward()
        return metrics

    graph, metrics = capture(captured_step, (h, w))

    for _ in range(2):
        new = policy_inputs(LEAD, H, V, torch.bfloat16, device="cuda")
        new_h = torch.where(new[2].unsqueeze(-1) == -100, 0.5, new[0].float()).bfloat16()
        with torch.no_grad():
            h.copy_(new_h)
            w.copy_(new[1])
        for key, value in zip(("labels", "adv", "old", "ref"), new[2:], strict=True):
            static[key].copy_(value)
        replay_poisoned(graph, (*metrics, h.grad, w.grad))
        want = run_step(policy_step, new_h, new[1], *new[2:], backend=backend)
        for g, e in zip(metrics, want[1:5], strict=True):
            assert torch.allclose(g, e, rtol=1e-4, atol=1e-4), (g, e)
        assert (h.grad[new[2] == -100] == 0).all()
        assert rel_err(h.grad, want[5]) <= 2e-3 and rel_err(w.grad, want[6]) <= 2e-3
