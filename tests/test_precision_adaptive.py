"""The adaptive split (precision "split", the CUDA default for float32 operands): one, two or three bfloat16
products as the operands allow, against float64 of the float32 operands, on odd shapes (N 7 + ignored rows,
H 96, V 4099), with temperature and softcap; the detection (one low bit set in one element selects three
products), the caller's claim (``bf16_exact``: verified with checks, NaN without), no host read under
check_inputs=False, and bitwise the bfloat16 path's statistics when both operands are bfloat16 values."""
from __future__ import annotations

import pytest
import torch

from host_reads import host_reads
from logitless import fused_logprobs, last_precision
from logitless.losses import fused_policy_loss
from logitless.ops.precision import bf16_exact_all, choose
from reference64 import device_for, logprobs_entropy64, make_inputs, on_cpu, rel_err

BACKENDS = ["reference", "chunked", "triton"]
BOUND = 1.2e-4     # log-prob and entropy error of every mode here (logit std 8, H 96; CPU: ~5e-5)


def _inputs(kind: str, n=7, ignored=2, seed=0):
    torch.manual_seed(seed)
    hidden, weight, labels = make_inputs(lead=(n + ignored,), logit_std=8.0)
    labels[torch.randperm(n + ignored)[:ignored]] = -100
    if kind in ("hidden", "both"):
        hidden = hidden.bfloat16().float()
    if kind in ("weight", "both"):
        weight = weight.bfloat16().float()
    return hidden, weight, labels


MODES = {"neither": "bf16x3", "hidden": "bf16x2", "weight": "bf16x2", "both": "bf16x1"}


def _counted(monkeypatch, module, name: str) -> list:
    """A list that gets one entry per call of ``module.name`` (patched for the test)."""
    made = []
    real = getattr(module, name)

    def counted(*args, **kw):
        made.append(1)
        return real(*args, **kw)
    monkeypatch.setattr(module, name, counted)
    return made


def _one_low_bit(x: torch.Tensor) -> torch.Tensor:
    """x with the lowest mantissa bit of one element set: no longer a bfloat16 value there."""
    bits = x.clone().view(torch.int32)
    bits.view(-1)[x.numel() // 3] |= 1
    return bits.view(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", list(MODES))
@pytest.mark.parametrize("softcap,temperature", [(None, 1.0), (20.0, 0.7)])
def test_modes_against_float64(backend, kind, softcap, temperature):
    hidden, weight, labels = _inputs(kind)
    dev = device_for(backend)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fused_logprobs(h.to(dev), w.to(dev), labels.to(dev), backend=backend, precision="split",
                         softcap=softcap, temperature=temperature)
    assert last_precision() == (MODES[kind], "bf16")
    lp64, ent64 = logprobs_entropy64(hidden, weight, labels, temperature=temperature, softcap=softcap)
    lp, ent = on_cpu(out)
    assert (lp.double() - lp64).abs().max() < BOUND
    assert (ent.double() - ent64).abs().max() < BOUND
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0


@pytest.mark.parametrize("operand", ["hidden", "weight"])
def test_one_low_bit_selects_three_products(operand):
    hidden, weight, labels = _inputs("both")
    if operand == "hidden":
        hidden = _one_low_bit(hidden)
    else:
        weight = _one_low_bit(weight)
    assert not bool(bf16_exact_all(hidden if operand == "hidden" else weight))
    fused_logprobs(hidden, weight, labels, backend="chunked", precision="split")
    assert last_precision().statistics == "bf16x2"
    hidden, weight, labels = _inputs(operand)      # that operand bfloat16-exact, the other not
    if operand == "hidden":
        hidden = _one_low_bit(hidden)
    else:
        weight = _one_low_bit(weight)
    fused_logprobs(hidden, weight, labels, backend="chunked", precision="split")
    assert last_precision().statistics == "bf16x3"


def test_detection_kernel_under_the_interpreter():
    """The detection kernel (compiled on a GPU, else under the interpreter)."""
    from logitless.ops.triton.exact import bf16_exact_all as kernel
    x = torch.randn(13, 67).bfloat16().float().to(device_for("triton"))
    assert bool(kernel(x)) and bool(kernel(x.t())) and bool(kernel(x[:, 5:]))
    for i in (0, 13 * 67 - 1, 400):
        y = x.clone()
        y.view(-1)[i] = torch.nextafter(y.view(-1)[i], torch.tensor(float("inf"), device=y.device))
        assert not bool(kernel(y)) and not bool(kernel(y.t()))
    assert bool(kernel(torch.empty(0, 5, device=x.device)))


def test_both_exact_is_the_bf16_path_bit_for_bit():
    hidden, weight, labels = (t.to(device_for("triton")) for t in _inputs("both"))
    a = fused_logprobs(hidden, weight, labels, backend="triton", precision="split")
    b = fused_logprobs(hidden.bfloat16(), weight.bfloat16(), labels, backend="triton")
    assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.entropy, b.entropy)


def test_an_explicit_precision_is_forced():
    hidden, weight, labels = _inputs("both")
    fused_logprobs(hidden, weight, labels, backend="chunked", precision="bf16x3")
    assert last_precision().statistics == "bf16x3"
    with pytest.raises(ValueError, match="bf16_exact='both' has no effect with precision='bf16x3'"):
        fused_logprobs(hidden, weight, labels, precision="bf16x3", bf16_exact="both")
    with pytest.raises(ValueError, match="has no effect on torch.bfloat16"):
        fused_logprobs(hidden.bfloat16(), weight.bfloat16(), labels, bf16_exact="hidden")
    with pytest.raises(ValueError, match="bf16_exact must be one of"):
        fused_logprobs(hidden, weight, labels, bf16_exact="yes")


@pytest.mark.parametrize("precision", ["split", None])
def test_a_false_claim_is_a_value_error_with_checks(precision):
    hidden, weight, labels = _inputs("hidden")
    with pytest.raises(ValueError, match="bf16_exact='both': weight holds float32 values"):
        fused_logprobs(hidden, weight, labels, backend="chunked", precision=precision, bf16_exact="both")
    with pytest.raises(ValueError, match="bf16_exact='weight'"):
        fused_policy_loss(hidden, weight, labels, torch.randn(labels.shape), backend="chunked",
                          precision=precision, bf16_exact="weight")
    fused_logprobs(hidden, weight, labels, backend="chunked", precision="split", bf16_exact="hidden")
    assert last_precision().statistics == "bf16x2"


def test_unchecked_calls_read_nothing_and_trust_only_true_claims():
    backend = "chunked"     # host_reads cannot watch triton's interpreter (it reads tensors through numpy)
    hidden, weight, labels = _inputs("hidden")
    labels[labels < 0] = 0
    # no claim: the general three products, no detection
    with host_reads() as seen:
        h = hidden.clone().requires_grad_(True)
        out = fused_logprobs(h, weight, labels, backend=backend, precision="split", check_inputs=False)
        out.logprobs.sum().backward()
    assert seen == [] and last_precision().statistics == "bf16x3"
    # a true claim: two products, the same numbers as the checked call's
    with host_reads() as seen:
        claimed = fused_logprobs(hidden, weight, labels, backend=backend, precision="split", check_inputs=False,
                                 bf16_exact="hidden")
    assert seen == [] and last_precision().statistics == "bf16x2"
    checked = fused_logprobs(hidden, weight, labels, backend=backend, precision="split")
    assert torch.equal(claimed.logprobs, checked.logprobs)
    # a false claim: NaN outputs and gradients, never a wrong number
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = fused_logprobs(h, w, labels, backend=backend, precision="split", check_inputs=False, bf16_exact="both")
    assert torch.isnan(out.logprobs).all() and torch.isnan(out.entropy).all()
    (out.logprobs.nan_to_num().sum() + out.entropy.nan_to_num().sum()).backward()
    assert torch.isnan(h.grad).all() and torch.isnan(w.grad).all()


def test_policy_loss_modes_and_false_unchecked_claim():
    hidden, weight, labels = _inputs("hidden")
    adv = torch.randn(labels.shape)
    ref = fused_policy_loss(hidden, weight, labels, adv, backend="chunked", precision="ieee")
    dev = device_for("triton")
    out = fused_policy_loss(hidden.to(dev), weight.to(dev), labels.to(dev), adv.to(dev), backend="triton",
                            precision="split")
    assert last_precision().statistics == "bf16x2"
    assert (out.loss.cpu() - ref.loss).abs() < 1e-4
    labels[labels < 0] = 0
    w = weight.clone().requires_grad_(True)
    bad = fused_policy_loss(hidden, w, labels, adv, backend="chunked", precision="split", check_inputs=False,
                            bf16_exact="both")
    assert torch.isnan(bad.loss)
    bad.loss.backward()
    assert torch.isnan(w.grad).all()


@pytest.mark.parametrize("kind", ["neither", "hidden", "weight"])
def test_policy_loss_splits_in_the_kernel(kind, monkeypatch):
    """The fused policy loss on the triton backend: the statistics kernel splits float32 tiles in registers and
    the gradient products take the weight's bfloat16 part block by block: no concatenated split is made (its
    maker raises here). Against float64 (loss, log-probs, entropies, both gradients), and the weight cut into
    several row blocks gives the one-block gradients to float32 rounding (every row block summed once)."""
    import logitless.ops.precision as precision_module
    from policy64 import loss64
    hidden, weight, labels = _inputs(kind, n=20, ignored=3)
    adv = torch.randn(labels.shape)
    lp_now, _ = logprobs_entropy64(hidden, weight, labels.clamp(min=0))
    # old log-probs near the current ones: no token sits where a 1e-5 change flips its clipping
    old = (lp_now + 0.03 * torch.randn(labels.shape, dtype=torch.float64)).clamp(max=0.0).float()

    def refused(*args, **kw):
        raise AssertionError("the concatenated split was made")
    monkeypatch.setattr(precision_module, "split_concat", refused)
    dev = device_for("triton")

    def run():
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        out = fused_policy_loss(h.to(dev), w.to(dev), labels.to(dev), adv.to(dev), old.to(dev), backend="triton",
                                entropy_coef=0.01, precision="split")
        assert last_precision() == (MODES[kind], "bf16")
        out.loss.backward()
        return on_cpu(out), h.grad, w.grad

    out, dh, dw = run()
    monkeypatch.setattr(precision_module, "WEIGHT_BLOCK_BYTES", 2 * 96 * 1000)    # five row blocks of V 4099
    blocked, dh_b, dw_b = run()
    want, lp64, ent64, _, _, dh64, dw64 = loss64(hidden, weight, labels, adv, old, entropy_coef=0.01)
    valid = labels != -100
    # the products fused_logprobs' kernels split alike: its log-probs to float32 rounding
    same = fused_logprobs(hidden.to(dev), weight.to(dev), labels.to(dev), backend="triton", precision="split")
    assert (out.logprobs - on_cpu(same.logprobs)).abs().max().item() <= 1e-6
    assert (out.logprobs - lp64)[valid].abs().max().item() <= BOUND
    assert (out.entropy - ent64)[valid].abs().max().item() <= BOUND
    assert abs(out.loss.item() - want.item()) <= BOUND
    # "bf16" gradient products: a bfloat16 head's gradient error (GRAD_BOUND["bf16"] of reference64: 3e-2)
    assert rel_err(dh, dh64) <= 3e-2 and rel_err(dw, dw64) <= 3e-2
    assert torch.equal(blocked.loss, out.loss) and torch.equal(dw_b, dw)
    # (on a GPU cuBLAS sums the blocks' products in its own order per shape: 1.0e-6 measured on an H100)
    assert rel_err(dh_b, dh) <= 4e-6, rel_err(dh_b, dh)


def test_choose_leaves_fixed_precisions_alone():
    hidden, weight, _ = _inputs("both")
    for p in ("bf16x3", "bf16x6", "tf32", "ieee", "native"):
        assert choose(p, hidden, weight, True) == (p, None)
    assert choose("ieee:both", hidden, weight, True) == ("ieee", None)
    with pytest.raises(ValueError, match="hidden holds"):
        choose("ieee:hidden", _inputs("weight")[0], weight, True)


@pytest.mark.parametrize("kind", ["neither", "hidden"])
def test_the_copies_path_of_the_knob(kind, monkeypatch):
    """LOGITLESS_SPLIT_IN_KERNEL=0: the triton backend runs the split precisions from the concatenated copies (the
    bfloat16 kernels at k times the depth; for benchmarks) instead of splitting in registers: the maker of the
    copies runs, the products and their numbers are the in-register path's to float32 rounding, forward and
    backward, fused_logprobs and the fused policy loss."""
    import logitless.ops.precision as precision_module
    hidden, weight, labels = _inputs(kind, n=9, ignored=2)
    adv, old = torch.randn(labels.shape), torch.full(labels.shape, -3.0)
    dev = device_for("triton")
    made = _counted(monkeypatch, precision_module, "split_concat")

    def run(copies):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        made.clear()
        out = fused_logprobs(h.to(dev), w.to(dev), labels.to(dev), backend="triton", precision="split")
        assert last_precision().statistics == MODES[kind]
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert bool(made) == copies                      # each op on its own
        made.clear()
        loss = fused_policy_loss(h.to(dev), w.to(dev), labels.to(dev), adv.to(dev), old.to(dev), backend="triton",
                                 precision="split")
        loss.loss.backward()
        assert bool(made) == copies
        return on_cpu(out.logprobs), on_cpu(out.entropy), loss.loss.item(), h.grad, w.grad

    in_kernel = run(False)
    monkeypatch.setenv("LOGITLESS_SPLIT_IN_KERNEL", "0")
    copies = run(True)
    for a, b in zip(in_kernel[:2], copies[:2], strict=True):
        # float32 rounding at the values' size (the tensor cores sum the two paths' products in their own orders:
        # 3.8e-6 at log-probs of -3.9 on an H100)
        assert (a - b).abs().max().item() <= 2e-6 * max(1.0, b.abs().max().item())
    assert abs(in_kernel[2] - copies[2]) <= 2e-6
    for a, b in zip(in_kernel[3:], copies[3:], strict=True):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("kind", ["neither", "hidden", "both"])
def test_the_accumulator_flush(kind, monkeypatch):
    """The split kernels flush their accumulator onto a float32 sum every LOGITLESS_SPLIT_FLUSH_K of the depth
    (``tile._flush``; default 128): at H 300 (ten K tiles of 32, a ragged last one) flushed every tile, every
    fourth (the default) and never, the same numbers against float64, forward and backward; the flush changes the
    summation order of bf16x3 / bf16x2 (it reached the kernels) and leaves bf16x1 (both operands bfloat16 values:
    the bfloat16 head's accumulation) bit for bit."""
    torch.manual_seed(5)
    hidden, weight, labels = make_inputs(lead=(9,), h=300, v=1031, logit_std=8.0)
    if kind in ("hidden", "both"):
        hidden = hidden.bfloat16().float()
    if kind == "both":
        weight = weight.bfloat16().float()
    dev = device_for("triton")
    lp64, ent64 = logprobs_entropy64(hidden, weight, labels)
    runs = {}
    for flush in ("32", "128", "0"):
        monkeypatch.setenv("LOGITLESS_SPLIT_FLUSH_K", flush)
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = fused_logprobs(h.to(dev), w.to(dev), labels.to(dev), backend="triton", precision="split")
        assert last_precision().statistics == MODES[kind]
        lp, ent = on_cpu(out)
        assert (lp.double() - lp64).abs().max() < BOUND
        assert (ent.double() - ent64).abs().max() < BOUND
        (out.logprobs.sum() + out.entropy.sum()).backward()
        runs[flush] = (lp, ent, h.grad, w.grad)
    for flush in ("32", "128"):
        for a, b in zip(runs[flush][2:], runs["0"][2:], strict=True):
            assert rel_err(a, b) < 1e-3    # the gradients' bfloat16 products
        same = all(torch.equal(a, b) for a, b in zip(runs[flush][:2], runs["0"][:2], strict=True))
        assert same == (kind == "both")


def test_the_backward_splits_hidden_once(monkeypatch):
    """The backward's vocabulary chunks read one copy of hidden's parts, made once per call (not per chunk)."""
    import logitless.ops.triton.operands as operands_module
    hidden, weight, labels = _inputs("neither")
    dev = device_for("triton")
    made = _counted(monkeypatch, operands_module, "split_operands")
    monkeypatch.setenv("LOGITLESS_TRITON_DLOGITS_ELEMENTS", str(9 * 1024))      # five chunks of V 4099
    h = hidden.to(dev).requires_grad_(True)
    out = fused_logprobs(h, weight.to(dev), labels.to(dev), backend="triton", precision="split")
    forward_made = len(made)
    assert forward_made >= 1
    out.logprobs.sum().backward()
    assert len(made) == forward_made + 1
