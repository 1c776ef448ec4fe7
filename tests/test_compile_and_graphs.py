"""fused_logprobs inside trainer runtimes: torch.compile(fullgraph=True), check_inputs=False, CUDA graphs.

The op is a torch.library custom op (logitless.ops.function): a compiled function that calls it has no
graph break and gets the eager values and gradients. check_inputs=False computes the same numbers on valid
input with no host synchronisation, which CUDA-graph capture requires (the capture test needs a GPU).
"""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

from cuda_graph import capture, replay_poisoned
from logitless import fused_logprobs, last_backend
from reference64 import TOL, logprobs_entropy64, make_inputs, rel_err

CUDA = torch.cuda.is_available()


def loss_of(hidden, weight, labels, temperature, a, b, **kw):
    out = fused_logprobs(hidden, weight, labels, temperature=temperature, **kw)
    return (out.logprobs * a).sum() + (out.entropy * b).sum(), out


def step(hidden, weight, labels, temperature, a, b, **kw):
    """One training step's worth: the loss and the outputs, as a trainer's compiled region holds them."""
    loss, out = loss_of(hidden, weight, labels, temperature, a, b, **kw)
    return loss, out.logprobs, out.entropy


def run(fn, hidden, weight, *args, **kw):
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss, lp, ent = fn(h, w, *args, **kw)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def inputs(device="cpu", dtype=torch.float32):
    hidden, weight, labels = make_inputs(lead=(3, 5), h=96, v=4099, dtype=dtype, device=device)
    labels[0, :2] = -100                      # a prompt: ignored rows
    temperature = torch.rand(3, 1, device=device) + 0.5
    a, b = torch.randn(3, 5, device=device), torch.randn(3, 5, device=device)
    return hidden, weight, labels, temperature, a, b


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_compiled_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    hidden, weight, labels, temperature, a, b = inputs()
    explained = torch._dynamo.explain(step)(hidden, weight, labels, temperature, a, b, backend=backend)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    got = run(compiled, hidden, weight, labels, temperature, a, b, backend=backend)
    assert last_backend() == backend
    want = run(step, hidden, weight, labels, temperature, a, b, backend=backend)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), (g - w).abs().max()
    assert (got[0][0, :2] == 0).all() and (got[2][0, :2] == 0).all()
    # and against float64, so that "equal to eager" is not "equally wrong"
    lp64, ent64 = logprobs_entropy64(hidden, weight, labels, temperature)
    assert (got[0] - lp64).abs().max() <= TOL[torch.float32][0]
    assert (got[1] - ent64).abs().max() <= TOL[torch.float32][1]


def test_compiled_call_still_checks_inputs():
    # the checks run inside the op, so the compiled function raises the same ValueError as eager
    torch._dynamo.reset()
    hidden, weight, labels, temperature, a, b = inputs()
    compiled = torch.compile(step, fullgraph=True)
    labels[1, 3] = 4099
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4099\)"):
        compiled(hidden, weight, labels, temperature, a, b, backend="chunked")
    labels[1, 3] = 7
    temperature[2, 0] = 0.0
    with pytest.raises(ValueError, match="temperature must be finite and >= 1e-30"):
        compiled(hidden, weight, labels, temperature, a, b, backend="chunked")


BACKENDS = ["reference", "chunked", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unchecked_call_matches_the_checked_one(backend, dtype):
    device = "cuda" if CUDA else "cpu"
    hidden, weight, labels, temperature, a, b = inputs(device, dtype)
    checked = run(step, hidden, weight, labels, temperature, a, b, backend=backend)
    unchecked = run(step, hidden, weight, labels, temperature, a, b, backend=backend, check_inputs=False)
    assert torch.allclose(unchecked[0], checked[0], atol=1e-5) and torch.allclose(unchecked[1], checked[1], atol=1e-5)
    assert (unchecked[0][0, :2] == 0).all() and (unchecked[1][0, :2] == 0).all()
    assert (unchecked[2][0, :2] == 0).all()          # ignored rows: zero d_hidden
    tol = TOL[dtype][2]
    assert rel_err(unchecked[2], checked[2]) <= tol and rel_err(unchecked[3], checked[3]) <= tol


def test_unchecked_call_does_not_validate():
    # documented: out-of-range labels are not caught; such a row gets no label (logprob = -lse), no crash
    hidden, weight, labels, temperature, _, _ = inputs()
    labels[2, 4] = 5000
    out = fused_logprobs(hidden, weight, labels, temperature=temperature, check_inputs=False)
    assert torch.isfinite(out.logprobs).all() and out.logprobs[2, 4] < 0
    with pytest.raises(ValueError, match="labels must lie"):
        fused_logprobs(hidden, weight, labels, temperature=temperature)


def test_unchecked_call_with_a_non_finite_ignored_row():
    # documented: the row's outputs are still 0 and other rows' values are unaffected; only the isolation of
    # its gradient is lost (it is computed, with a zero coefficient, and 0 * nan is nan)
    hidden, weight, labels, temperature, _, _ = inputs()
    hidden[0, 1] = float("nan")
    out = fused_logprobs(hidden, weight, labels, temperature=temperature, check_inputs=False)
    ref = fused_logprobs(hidden, weight, labels, temperature=temperature)
    assert out.logprobs[0, 1] == 0 and out.entropy[0, 1] == 0
    assert torch.allclose(out.logprobs, ref.logprobs, atol=1e-5) and torch.allclose(out.entropy, ref.entropy, atol=1e-5)


def test_check_inputs_must_be_a_bool():
    hidden, weight, labels, _, _, _ = inputs()
    with pytest.raises(TypeError, match="check_inputs"):
        fused_logprobs(hidden, weight, labels, check_inputs=1)


@pytest.mark.skipif(not CUDA, reason="torch.compile of the triton backend needs a CUDA GPU")
def test_compiled_fullgraph_on_cuda():
    torch._dynamo.reset()
    hidden, weight, labels, temperature, a, b = inputs("cuda", torch.bfloat16)
    compiled = torch.compile(step, fullgraph=True)
    got = run(compiled, hidden, weight, labels, temperature, a, b)
    assert last_backend() == "triton"
    want = run(step, hidden, weight, labels, temperature, a, b)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and rel_err(g, w) <= 1e-5, rel_err(g, w)


@pytest.mark.skipif(not CUDA, reason="CUDA-graph capture needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "chunked"])
def test_cuda_graph_capture_and_replay(backend):
    # a whole step (forward, loss, backward) captured once with check_inputs=False, replayed on new inputs
    # copied into the captured buffers; every replayed output is compared with an eager call on those inputs
    hidden, weight, labels, temperature, a, b = inputs("cuda", torch.bfloat16)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    static = dict(labels=labels.clone(), temperature=temperature.clone(), a=a.clone(), b=b.clone())

    def captured_step():
        loss, out = loss_of(h, w, static["labels"], static["temperature"], static["a"], static["b"],
                            backend=backend, check_inputs=False)
        loss.backward()
        return out.logprobs, out.entropy

    graph, (lp, ent) = capture(captured_step, (h, w))

    for _ in range(2):
        new = inputs("cuda", torch.bfloat16)
        with torch.no_grad():
            h.copy_(new[0])
            w.copy_(new[1])
        for key, value in zip(("labels", "temperature", "a", "b"), new[2:], strict=True):
            static[key].copy_(value)
        replay_poisoned(graph, (lp, ent, h.grad, w.grad))
        want = run(step, *new, backend=backend)
        assert (lp - want[0]).abs().max() <= 1e-4 and (ent - want[1]).abs().max() <= 1e-4
        assert (h.grad[0, :2] == 0).all()
        assert rel_err(h.grad, want[2]) <= 2e-3 and rel_err(w.grad, want[3]) <= 2e-3
