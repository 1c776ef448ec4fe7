"""fused_logprobs(..., truncation=Truncation(...)) against float64 (tests/truncation64.py): the kept sets of vLLM's
min_p / top_k / top_p (identical wherever float32 rounding cannot move a token across a boundary, and within the
sizes float32 may choose elsewhere), the log-probs, entropy, log kept mass and gradients with the kept set fixed to
the plain op's bounds, the replay form, settings per token and per sequence, and the refusals. The reference itself
is held to a transcription of vLLM's own sampler code (and to vLLM where it is installed)."""
from __future__ import annotations

import pytest
import torch

from logitless import Truncation, fused_logprobs, last_backend, last_precision
from reference64 import device_for, logits64, make_inputs, on_cpu, rel_err, tol_for
from truncation64 import (
    float32_eps,
    ids_of,
    kept_mask64,
    on_op_count64,
    order64,
    per_row,
    prefix_kept64,
    replayed64,
    truncated64,
    z_gap64,
)

CPU_BACKENDS = ["reference", "chunked"]
LEAD = (3, 7)
T = 0.7


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # many small [tokens x V] operations (sorts, masks, gathers): with intra-op threads on a busy machine their
    # start-up and spinning cost several times the work itself (this file took 9x longer with 2 threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # several vocab chunks with a ragged last one on the chunked backend (4099 = 9 * 433 + 202 at 21 tokens)
    monkeypatch.setenv("LOGITLESS_CHUNK_ELEMENTS", str(21 * 433))


def settings_of(truncation: Truncation) -> dict:
    """The reference's keyword settings of a settings-form Truncation (None: off)."""
    return {k: v for k, v in (("top_k", truncation.top_k), ("top_p", truncation.top_p),
                              ("min_p", truncation.min_p)) if v is not None}


def check(hidden, weight, labels, backend, truncation, *, temperature=T, softcap=None, ignore_index=-100,
          with_entropy=True, grad_hidden=True, grad_weight=True, min_decided=0.5):
    """The op forward and backward on sum(a * logprobs) + sum(b * entropy) (random a, b) against float64:
    kept_count and inside equal to the reference's on every decided row (at least ``min_decided`` of the scored
    ones), kept_count within the sizes float32 may choose on every row, and the values and gradients equal to
    float64 over the op's own kept-set size (the reference's set wherever the sizes agree), to the plain op's
    bounds. Returns (op outputs, float64 reference)."""
    dev = device_for(backend)
    h = hidden.detach().to(dev).clone().requires_grad_(grad_hidden)
    w = weight.detach().to(dev).clone().requires_grad_(grad_weight)
    on_dev = (lambda t: t.to(dev) if torch.is_tensor(t) else t)  # noqa: E731
    if truncation.kept_ids is not None:
        truncation_dev = Truncation(kept_ids=truncation.kept_ids.to(dev))
    else:
        truncation_dev = Truncation(**{k: on_dev(v) for k, v in settings_of(truncation).items()})
    out = on_cpu(fused_logprobs(h, w, labels.to(dev), temperature=on_dev(temperature), softcap=softcap,
                                ignore_index=ignore_index, with_entropy=with_entropy, backend=backend,
                                truncation=truncation_dev))
    # triton: selections past its kernels' 128 candidates run the chunked backend's torch pass (fused_topk's docs);
    # the replay form's record: test_last_backend_after_the_replay_form
    replay = truncation.kept_ids is not None
    assert replay or last_backend() == backend or (backend == "triton" and last_backend() == "chunked")
    tol = tol_for(hidden.dtype, last_precision())
    for name, dtype in (("logprobs", torch.float32), ("inside", torch.bool), ("kept_count", torch.int64)) + (
            (("entropy", torch.float32),) if with_entropy else ()) + (
            (("kept_logprob", torch.float32),) if not replay else ()):
        t = getattr(out, name)
        assert t.dtype == dtype and t.shape == labels.shape, (name, t.dtype, t.shape)
    assert with_entropy or out.entropy is None
    assert not replay or out.kept_logprob is None

    common = dict(temperature=temperature, softcap=softcap, ignore_index=ignore_index)
    if replay:
        ref = replayed64(hidden, weight, labels, truncation.kept_ids, **common)
    else:
        ref = truncated64(hidden, weight, labels, **common, **settings_of(truncation))
    valid = labels != ignore_index
    decided = ref.decided & valid
    assert decided.sum() >= min_decided * valid.sum(), "inputs too close to a boundary to test the kept sets"
    assert torch.equal(out.kept_count[decided], ref.kept_count[decided]), (out.kept_count, ref.kept_count)
    assert torch.equal(out.inside[decided], ref.inside[decided])
    assert ((out.kept_count >= ref.count_lo) & (out.kept_count <= ref.count_hi)).all(), (
        out.kept_count, ref.count_lo, ref.count_hi)
    assert (out.kept_count[~valid] == 0).all() and not out.inside[~valid].any()

    h64 = hidden.detach().double().requires_grad_(grad_hidden)
    w64 = weight.detach().double().requires_grad_(grad_weight)
    if replay:
        truth = replayed64(h64, w64, labels, truncation.kept_ids, **common)
    else:
        truth = on_op_count64(h64, w64, labels, out.kept_count, **common)
    # inside on every row whose label float32 cannot move across the op's boundary (decided rows: all; replayed
    # sets: every row)
    clear = (torch.ones_like(valid) if replay
             else clear_of_boundary(truth, hidden, weight, labels, temperature, softcap))
    assert torch.equal(out.inside[clear], truth.inside[clear])
    assert torch.isfinite(out.logprobs).all()
    # a kept set chosen by the settings is a prefix by value: no label outside it is more probable than any inside
    assert replay or (out.logprobs <= 1e-6).all()
    assert (out.logprobs - truth.logprobs).abs().max() <= tol[0]
    if not replay:
        assert (out.kept_logprob - truth.kept_logprob).abs().max() <= tol[0] and (out.kept_logprob <= 0).all()
        assert (out.kept_logprob[~valid] == 0).all()
    # gradients where the op's kept set is float64's prefix of its size: no near tie across its boundary, which
    # float32 may order the other way (the values barely move then, the gradients do: other weight rows)
    z = logits64(hidden, weight, labels.shape, temperature, softcap).detach().reshape(-1, weight.shape[0])
    exact = ((z_gap64(z, truth.kept.reshape(z.shape)) > float32_eps(z)).reshape(labels.shape) | ~valid | replay)
    assert exact.sum() >= min_decided * labels.numel()
    a = torch.randn(labels.shape, dtype=torch.float64) * exact
    b = torch.randn(labels.shape, dtype=torch.float64) * exact
    loss, loss64 = (out.logprobs * a.float()).sum(), (truth.logprobs * a).sum()
    if with_entropy:
        assert torch.isfinite(out.entropy).all() and (out.entropy >= 0).all()
        assert (out.entropy - truth.entropy).abs().max() <= tol[1]
        loss, loss64 = loss + (out.entropy * b.float()).sum(), loss64 + (truth.entropy * b).sum()
    if grad_hidden or grad_weight:
        loss.backward()
        loss64.backward()
    for mine, want, required, like in ((h, h64, grad_hidden, hidden), (w, w64, grad_weight, weight)):
        if not required:
            assert mine.grad is None
            continue
        assert mine.grad.dtype == like.dtype and mine.grad.shape == like.shape
        assert rel_err(mine.grad.cpu(), want.grad) <= tol[2], rel_err(mine.grad.cpu(), want.grad)
    return out, ref


def clear_of_boundary(truth, hidden, weight, labels, temperature, softcap):
    """Tokens whose label's z lies farther than float32 rounding from the other side of the kept set's boundary
    (a kept label above every dropped id, a dropped one below every kept id), or that are ignored."""
    v = truth.kept.shape[-1]
    z = logits64(hidden, weight, labels.shape, temperature, softcap).detach().reshape(-1, v)
    kept = truth.kept.reshape(-1, v)
    y = torch.where(truth.kept_count.reshape(-1) > 0, labels.reshape(-1), 0).unsqueeze(-1)
    zy = z.gather(-1, y).squeeze(-1)
    lowest_kept = z.masked_fill(~kept, float("inf")).amin(-1)
    highest_dropped = z.masked_fill(kept, float("-inf")).amax(-1)
    clear = torch.where(truth.inside.reshape(-1), zy - highest_dropped, lowest_kept - zy) > float32_eps(z)
    return (clear | ~kept.any(-1)).reshape(labels.shape)


def bites(ref, labels, most=4099, some_above=0):
    """The settings truncate: every scored row keeps fewer than ``most`` ids, some more than ``some_above``."""
    counts = ref.kept_count[labels != -100]
    assert (counts < most).all() and (counts > some_above).any(), counts


# ------------------------------------------------------------------- the reference, held to vLLM's text

def vllm_kept_transcribed(z, k, p, min_p):
    """The kept mask of float64 logits z [N, V] by the steps of vLLM v1's code, as written there (k = V and p = 1
    where off): the min-p logits processor (probabilities below min_p times the row's largest set to -inf), then
    apply_top_k_top_p_pytorch: sort ascending; drop values below the one at index V - k; softmax of the sorted
    row, cumulative sum, drop where it is <= 1 - p, never the last (largest); scatter back."""
    z = z.clone()
    probs = torch.softmax(z, dim=-1)
    z[probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)] = float("-inf")
    ascending, index = z.sort(dim=-1)
    kth = ascending.gather(1, (z.shape[1] - k).unsqueeze(1))
    ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.isfinite(torch.empty_like(z).scatter(1, index, ascending))


def random_rows(n=48, v=4099):
    """Float64 logits without ties, each row its own scale (flat to peaked)."""
    return torch.randn(n, v, dtype=torch.float64) * (torch.rand(n, 1, dtype=torch.float64) * 6 + 0.5)


def random_settings(n, v, which):
    k = torch.where(torch.rand(n) < 0.8, torch.randint(1, 300, (n,)), -1) if "k" in which else torch.full((n,), -1)
    p = (torch.rand(n, dtype=torch.float64) * 0.98 + 0.01) if "p" in which else torch.ones(n, dtype=torch.float64)
    m = (torch.rand(n, dtype=torch.float64) * 0.2) if "m" in which else torch.zeros(n, dtype=torch.float64)
    return k, p, m


@pytest.mark.parametrize("which", ["k", "p", "m", "kp", "km", "pm", "kpm"])
def test_reference_follows_vllm_text(which):
    z = random_rows()
    n, v = z.shape
    k, p, m = random_settings(n, v, which)
    mine = kept_mask64(z, k, p, m)
    theirs = vllm_kept_transcribed(z, torch.where(k > 0, k, v), p, m)
    assert torch.equal(mine, theirs)
    counts = mine.sum(-1)
    assert (counts < v).sum() > n // 2 and (counts > 1).sum() > n // 4   # they bite, and not to one id only
    # every kept set is a prefix of the order (z descending, id ascending): what the tests' size checks rely on
    assert torch.equal(prefix_kept64(z, counts), mine)


def test_reference_matches_vllm_itself():
    ops = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler",
                              reason="vLLM is not installed here (the transcription above stands in for it)")
    z = random_rows()
    n, v = z.shape
    k, p, _ = random_settings(n, v, "kp")
    out = ops.apply_top_k_top_p_pytorch(z.clone(), torch.where(k > 0, k, v), p)
    assert torch.equal(torch.isfinite(out), kept_mask64(z, k, p, torch.zeros(n, dtype=torch.float64)))


def test_reference_replay_and_settings_forms_agree():
    hidden, weight, labels = make_inputs(lead=LEAD)
    ref = truncated64(hidden, weight, labels, temperature=T, top_p=0.9, min_p=0.01)
    replay = replayed64(hidden, weight, labels, ids_of(ref.kept, shuffle=True), temperature=T)
    for name in ("kept", "inside", "kept_count"):
        assert torch.equal(getattr(ref, name), getattr(replay, name))
    for name in ("logprobs", "entropy", "kept_logprob"):
        assert torch.allclose(getattr(ref, name), getattr(replay, name), rtol=0, atol=1e-12)
    # with nothing truncated: the plain log-softmax
    full = truncated64(hidden, weight, labels, temperature=T)
    want = torch.log_softmax(logits64(hidden, weight, labels.shape, T), -1).gather(-1, labels.unsqueeze(-1))
    assert torch.allclose(full.logprobs, want.squeeze(-1), rtol=0, atol=1e-12)
    assert (full.kept_count == 4099).all() and (full.kept_logprob == 0).all()


# ------------------------------------------------------------------------------- the settings form

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_matches_float64(backend, dtype):
    hidden, weight, labels = make_inputs(lead=LEAD, dtype=dtype)
    _, ref = check(hidden, weight, labels, backend, Truncation(top_p=0.9))
    bites(ref, labels, most=400)
    assert (ref.kept_count > 1).any()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_k_matches_float64(backend, dtype):
    hidden, weight, labels = make_inputs(lead=LEAD, dtype=dtype, logit_std=2.0)
    _, ref = check(hidden, weight, labels, backend, Truncation(top_k=37))
    assert (ref.kept_count == 37).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_min_p_matches_float64(backend):
    hidden, weight, labels = make_inputs(lead=LEAD, logit_std=3.0)
    _, ref = check(hidden, weight, labels, backend, Truncation(min_p=0.02))
    bites(ref, labels, most=1000)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_combined_settings(backend):
    # each setting binds on some rows: min_p on the peaked ones, top_k on the flat ones, top_p in between
    hidden, weight, labels = make_inputs(lead=LEAD, logit_std=3.0)
    hidden = hidden * torch.linspace(0.4, 1.6, LEAD[1]).unsqueeze(-1)
    settings = dict(top_k=40, top_p=0.8, min_p=0.05)
    _, ref = check(hidden, weight, labels, backend, Truncation(**settings))
    bites(ref, labels, most=41)
    for name in settings:       # each setting binds: without it some row keeps another set
        without = truncated64(hidden, weight, labels, temperature=T,
                              **{k: v for k, v in settings.items() if k != name})
        assert not torch.equal(without.kept_count, ref.kept_count), name


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_per_token_and_per_sequence_settings(backend):
    hidden, weight, labels = make_inputs(lead=LEAD, logit_std=3.0)
    per_token_k = torch.randint(1, 60, LEAD)
    per_token_k[0, 2] = per_token_k[2, 5] = -1
    per_seq_p = torch.tensor([[0.6], [0.95], [1.0]], dtype=torch.float64)
    per_token_m = torch.rand(LEAD) * 0.05
    per_token_m[1, :3] = 0.0
    _, ref = check(hidden, weight, labels, backend,
                   Truncation(top_k=per_token_k.int(), top_p=per_seq_p.float(), min_p=per_token_m))
    assert ref.kept_count.unique().numel() > 3       # the rows' sets differ
    # a sequence whose settings are all off: the plain op's numbers there, the whole vocabulary kept
    out, _ = check(hidden, weight, labels, backend, Truncation(top_p=per_seq_p))
    plain = fused_logprobs(hidden, weight, labels, temperature=T, backend=backend)
    assert (out.kept_count[2] == 4099).all() and out.inside[2].all() and (out.kept_logprob[2] == 0).all()
    # the plain op on those rows alone: its numbers up to float32 rounding (other rows, other BLAS blocking)
    assert (out.logprobs[2] - plain.logprobs[2]).abs().max() <= 2e-5
    assert (out.entropy[2] - plain.entropy[2]).abs().max() <= 2e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_settings_off_equal_the_plain_op_bit_for_bit(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    labels[1, 3] = -100
    plain_h, plain_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    plain = fused_logprobs(plain_h, plain_w, labels, temperature=T, backend=backend)
    a, b = torch.randn(LEAD), torch.randn(LEAD)
    ((plain.logprobs * a).sum() + (plain.entropy * b).sum()).backward()
    off_tensors = dict(top_k=torch.full(LEAD, -1), top_p=torch.ones(LEAD), min_p=torch.zeros(LEAD))
    for truncation in (Truncation(), Truncation(top_k=-1, top_p=1.0, min_p=0.0), Truncation(**off_tensors),
                       Truncation(top_k=4099), Truncation(top_k=10 ** 6)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_logprobs(h, w, labels, temperature=T, backend=backend, truncation=truncation)
        ((out.logprobs * a).sum() + (out.entropy * b).sum()).backward()
        assert torch.equal(out.logprobs, plain.logprobs) and torch.equal(out.entropy, plain.entropy)
        assert torch.equal(h.grad, plain_h.grad) and torch.equal(w.grad, plain_w.grad)
        valid = labels != -100
        assert torch.equal(out.inside, valid)
        assert torch.equal(out.kept_count, torch.where(valid, 4099, 0))
        assert (out.kept_logprob == 0).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_label_outside_the_kept_set(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    z = logits64(hidden, weight, labels.shape, T)
    labels[0] = z[0].argmin(-1)                                      # the least likely id of each token
    labels[1] = order64(z[1])[:, 50]                                 # just outside a small nucleus
    out, ref = check(hidden, weight, labels, backend, Truncation(top_p=0.5))
    assert not out.inside[0].any() and not out.inside[1].any()
    assert (out.logprobs[0] < -20).all()
    # below the log-prob of the least probable kept id (z_y < z of every kept id)
    least_kept = (z.reshape(-1, 4099).masked_fill(~ref.kept.reshape(-1, 4099), float("inf")).amin(-1)
                  - torch.logsumexp(z.reshape(-1, 4099).masked_fill(~ref.kept.reshape(-1, 4099), float("-inf")),
                                    -1)).reshape(LEAD)
    assert (out.logprobs[:2] <= least_kept[:2] + 1e-5).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_nucleus_of_one_token(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    z = logits64(hidden, weight, labels.shape, T)
    top = z.argmax(-1)
    labels[:2] = top[:2]
    labels[2] = order64(z[2])[:, 1]                                  # the runner-up: outside
    out, ref = check(hidden, weight, labels, backend, Truncation(top_p=1e-6))
    assert (out.kept_count == 1).all()
    assert (out.logprobs[:2] == 0).all() and out.inside[:2].all()
    assert (out.entropy == 0).all()
    assert not out.inside[2].any()
    gap = (z.gather(-1, labels.unsqueeze(-1)) - z.amax(-1, keepdim=True)).squeeze(-1)
    assert (out.logprobs[2].double() - gap[2]).abs().max() <= 2e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_kept_sets_past_the_first_candidates(backend):
    # flat distributions: nuclei of hundreds to thousands of ids, past the first 128 candidates and past 16 x 128
    hidden, weight, labels = make_inputs(lead=(2, 4), logit_std=1.0)
    # (nuclei of thousands of ids have boundary ids of mass ~1e-4: float32 may move a third of them by one id,
    # which the size range [count_lo, count_hi] bounds; few rows are decided there)
    for truncation, some_above, min_decided in ((Truncation(top_p=0.6), 128, 0.25),
                                           (Truncation(top_p=0.999), 2048, 0.0),
                                           (Truncation(min_p=0.1), 128, 0.5),
                                           (Truncation(top_k=3000, min_p=0.02), 2048, 0.5)):
        _, ref = check(hidden, weight, labels, backend, truncation, temperature=1.0, min_decided=min_decided)
        bites(ref, labels, some_above=some_above)


def repeated(truncation, rows):
    """The settings of tokens ``rows`` of a batch (per-token tensors indexed, numbers as they are)."""
    return Truncation(**{k: v[rows] if torch.is_tensor(v) else v for k, v in settings_of(truncation).items()})


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_kept_set_members_at_the_boundary(backend):
    """The kept set itself, not only its size: each of 3 tokens repeated with the labels ranked around its
    boundary (float64's order); ``inside`` must say which of them are kept."""
    base_h, weight, _ = make_inputs(lead=(3,), logit_std=3.0)
    z = logits64(base_h, weight, (3,), T)
    for truncation in (Truncation(top_p=0.85), Truncation(top_k=25), Truncation(min_p=0.01),
                       Truncation(top_k=60, top_p=0.97, min_p=0.002)):
        ref = truncated64(base_h, weight, torch.zeros(3, dtype=torch.long), temperature=T,
                          **settings_of(truncation))
        rows, ids = [], []
        for r in range(3):
            c = int(ref.kept_count[r])
            ranked = order64(z[r : r + 1])[0]
            window = ranked[max(0, c - 8): c + 8]
            rows += [r] * window.numel()
            ids.append(window)
        rows, labels = torch.tensor(rows), torch.cat(ids)
        out, ref_rep = check(base_h[rows], weight, labels, backend, truncation, min_decided=0.3)
        decided = ref_rep.decided
        assert torch.equal(out.inside[decided], ref.kept[rows, labels][decided])
        assert out.inside.any() and not out.inside.all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_exact_ties(backend):
    """Integer logits (exact in float32 and float64), many equal: top_k keeps every id tied at the k-th value;
    top_p cuts inside a run of equal values by ascending id."""
    rows_n = 6
    g_h = torch.randint(-2, 3, (rows_n, 96)).float()
    weight = torch.randint(-2, 3, (4099, 96)).float()
    temperature = 8.0                       # 1 / 8: exact, z = integer / 8 (std ~2.5)
    z = logits64(g_h, weight, (rows_n,), temperature)
    # (nuclei of a few hundred ids at most: a boundary id of small mass lies within float32 rounding of top_p too
    # often, and such rows are not decided)
    for truncation in (Truncation(top_k=torch.randint(30, 80, (rows_n,))), Truncation(top_p=0.6),
                       Truncation(top_p=0.8, top_k=300)):
        ref = truncated64(g_h, weight, torch.zeros(rows_n, dtype=torch.long), temperature=temperature,
                          **settings_of(truncation))
        # labels: a run of equal values at each boundary, and the ids around it
        rows, ids = [], []
        for r in range(rows_n):
            c = int(ref.kept_count[r])
            ranked = order64(z[r : r + 1])[0]
            # the run of values equal to the last kept one, in id order: up to 3 ids each side of the cut
            run = ranked[(z[r, ranked] == z[r, ranked[c - 1]]).nonzero().squeeze(1)]
            at = int((run == ranked[c - 1]).nonzero())
            window = torch.cat([run[max(0, at - 2): at + 4], ranked[max(0, c - 3): c + 3]]).unique()
            rows += [r] * window.numel()
            ids.append(window)
        rows, labels = torch.tensor(rows), torch.cat(ids)
        out, ref_rep = check(g_h[rows], weight, labels, backend, repeated(truncation, rows),
                             temperature=temperature, min_decided=0.5)
        decided = ref_rep.decided
        assert torch.equal(out.inside[decided], ref.kept[rows, labels][decided])
        if truncation.top_p is None:      # top_k: some row keeps more than k (a tie at the k-th value)
            assert (ref.kept_count > truncation.top_k).any()
        else:                             # top_p: some row's cut splits a run of equal values
            zk = z.masked_fill(~ref.kept, float("inf")).amin(-1)
            split = ((z == zk.unsqueeze(-1)) & ~ref.kept).any(-1)
            assert split.any()


# --------------------------------------------------------------------------------- the replay form

def random_kept_ids(labels, v=4099, most=300):
    """Kept sets of random sizes 1..most per token, as ids [..., most] in random order with -1 padding mixed in;
    each token's label inside its set on about half of the tokens."""
    n = labels.numel()
    kept = torch.zeros(n, v, dtype=torch.bool)
    sizes = torch.randint(1, most + 1, (n,))
    for i in range(n):
        kept[i, torch.randperm(v)[: int(sizes[i])]] = True
    flat = labels.reshape(-1)
    inside = (torch.rand(n) < 0.5) & (flat >= 0) & (flat < v)
    kept[torch.arange(n)[inside], flat[inside]] = True
    ids = ids_of(kept, shuffle=True)
    return torch.cat([ids, torch.full((n, 3), -1)], dim=1).reshape(*labels.shape, -1)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_matches_float64(backend, dtype):
    hidden, weight, labels = make_inputs(lead=LEAD, dtype=dtype)
    kept_ids = random_kept_ids(labels)
    out, ref = check(hidden, weight, labels, backend, Truncation(kept_ids=kept_ids))
    assert torch.equal(out.kept_count, (kept_ids >= 0).sum(-1))
    assert out.inside.any() and not out.inside.all()
    # int32 ids: the same numbers
    again = fused_logprobs(hidden, weight, labels, temperature=T, backend=backend,
                           truncation=Truncation(kept_ids=kept_ids.int()))
    assert torch.equal(again.logprobs, out.logprobs.detach()) and torch.equal(again.inside, out.inside)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replay_of_the_settings_kept_set(backend):
    """The kept ids the settings form chose (float64's order cut at the op's sizes), replayed: the same numbers."""
    hidden, weight, labels = make_inputs(lead=LEAD, logit_std=3.0)
    labels[2, 6] = -100
    truncation = Truncation(top_k=50, top_p=0.9, min_p=0.01)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    settings = fused_logprobs(h1, w1, labels, temperature=T, backend=backend, truncation=truncation)
    z = logits64(hidden, weight, labels.shape, T).reshape(-1, 4099)
    kept = prefix_kept64(z, settings.kept_count.reshape(-1)).reshape(*LEAD, 4099)
    kept_ids = ids_of(kept, shuffle=True)
    kept_ids[2, 6] = torch.where(torch.arange(kept_ids.shape[-1]) == 0, 7, -1)   # anything on an ignored token
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    replay = fused_logprobs(h2, w2, labels, temperature=T, backend=backend, truncation=Truncation(kept_ids=kept_ids))
    assert torch.equal(replay.kept_count, settings.kept_count) and torch.equal(replay.inside, settings.inside)
    # the settings form takes the kept pairs' logits from its selection pass (z - z_top from the candidates'
    # float32 log-probs), the replay form multiplies them: the two agree to a few float32 ulps of the logits
    tol = 2.0 ** -21 * (1.0 + float(z.abs().max()))
    assert (replay.logprobs - settings.logprobs).abs().max() <= tol
    assert (replay.entropy - settings.entropy).abs().max() <= tol
    a, b = torch.randn(LEAD), torch.randn(LEAD)
    ((settings.logprobs * a).sum() + (settings.entropy * b).sum()).backward()
    ((replay.logprobs * a).sum() + (replay.entropy * b).sum()).backward()
    assert rel_err(h2.grad, h1.grad) <= tol and rel_err(w2.grad, w1.grad) <= tol   # q moves with z


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_last_backend_after_the_replay_form(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    other = "chunked" if backend == "reference" else "reference"
    fused_logprobs(hidden, weight, labels, backend=other)
    fused_logprobs(hidden, weight, labels, backend=backend, truncation=Truncation(kept_ids=random_kept_ids(labels)))
    assert last_backend() == backend


# ----------------------------------------------------------- ignored rows, temperature, softcap, outputs

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ignore_index_rows(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    labels[0, [0, 4]] = -100
    labels[2, 6] = -100
    ignored = labels == -100
    for truncation in (Truncation(top_p=0.9, top_k=30), Truncation(kept_ids=random_kept_ids(labels))):
        out, _ = check(hidden, weight, labels, backend, truncation)
        assert (out.logprobs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
        assert (out.kept_count[ignored] == 0).all() and not out.inside[ignored].any()
        h = hidden.clone().requires_grad_()
        out = fused_logprobs(h, weight, labels, temperature=T, backend=backend, truncation=truncation)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert (h.grad[ignored] == 0).all() and (h.grad[~ignored] != 0).any()
    custom = labels.clone()
    custom[ignored] = 5000          # a custom ignore_index outside [0, V)
    check(hidden, weight, custom, backend, Truncation(min_p=0.01), ignore_index=5000)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_every_row_ignored_and_non_contiguous_inputs(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    ignored = torch.full(LEAD, -100)
    for truncation in (Truncation(top_p=0.9), Truncation(kept_ids=torch.full((*LEAD, 2), -1))):
        h = hidden.clone().requires_grad_()
        out = fused_logprobs(h, weight, ignored, backend=backend, truncation=truncation)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert (out.logprobs == 0).all() and (out.entropy == 0).all() and (out.kept_count == 0).all()
        assert not out.inside.any() and (h.grad == 0).all()
    # transposed views: neither hidden nor weight is contiguous
    hidden_t = hidden.transpose(0, 1).contiguous().transpose(0, 1)
    weight_t = weight.t().contiguous().t()
    assert not hidden_t.is_contiguous() and not weight_t.is_contiguous()
    check(hidden_t, weight_t, labels, backend, Truncation(top_p=0.9, top_k=30))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("form", ["settings", "replay"])
def test_empty_token_batch(backend, form):
    _, weight, _ = make_inputs()
    h = torch.randn(0, 96, requires_grad=True)
    w = weight.clone().requires_grad_()
    labels = torch.zeros(0, dtype=torch.long)
    truncation = Truncation(top_p=0.9) if form == "settings" else Truncation(kept_ids=torch.zeros(0, 3).long())
    out = fused_logprobs(h, w, labels, backend=backend, truncation=truncation)
    assert out.logprobs.shape == out.entropy.shape == out.inside.shape == out.kept_count.shape == (0,)
    (out.logprobs.sum() + out.entropy.sum()).backward()
    assert h.grad.shape == (0, 96) and (w.grad == 0).all()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_temperature_tensors(backend):
    hidden, weight, labels = make_inputs(lead=LEAD, logit_std=3.0)
    per_token = torch.rand(LEAD) * 1.5 + 0.4
    per_seq = torch.rand(LEAD[0], 1) * 1.5 + 0.4
    for temperature in (per_token, per_seq):
        check(hidden, weight, labels, backend, Truncation(top_p=0.9, top_k=40), temperature=temperature)
        check(hidden, weight, labels, backend, Truncation(min_p=0.03), temperature=temperature)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(backend, dtype):
    # raw logits of std 8 against a cap of 8: the cap bends the largest logits, and changes the kept sets (a
    # kept set of logits deep in the cap's saturation has gradients through 1 - tanh^2 of few float32 digits)
    hidden, weight, labels = make_inputs(lead=LEAD, dtype=dtype, logit_std=8.0)
    truncation = Truncation(top_p=0.95, top_k=80, min_p=0.001)
    out, ref = check(hidden, weight, labels, backend, truncation, softcap=8.0, temperature=1.3)
    uncapped = truncated64(hidden, weight, labels, temperature=1.3, **settings_of(truncation))
    assert not torch.equal(ref.kept_count, uncapped.kept_count)
    bites(ref, labels, most=81)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_without_entropy_and_gradient_subsets(backend):
    hidden, weight, labels = make_inputs(lead=LEAD)
    check(hidden, weight, labels, backend, Truncation(top_p=0.9), with_entropy=False)
    check(hidden, weight, labels, backend, Truncation(top_k=20), grad_weight=False)
    check(hidden, weight, labels, backend, Truncation(kept_ids=random_kept_ids(labels)), grad_hidden=False)
    out, _ = check(hidden, weight, labels, backend, Truncation(min_p=0.05), grad_hidden=False, grad_weight=False)
    assert not out.logprobs.requires_grad


def test_triton_backend():
    """The triton backend's selection kernels against float64: compiled on a GPU (the whole suite's shapes), else
    through the interpreter on the CPU on a smaller head (the replay form and the kept pairs' products run no
    backend kernel)."""
    shape = dict(lead=LEAD) if device_for("triton") == "cuda" else dict(lead=(2, 5), v=1031, h=48)
    hidden, weight, labels = make_inputs(**shape, logit_std=3.0)
    # kept sets within the kernels' 128 candidates (past them the chunked pass selects: tested above)
    check(hidden, weight, labels, "triton", Truncation(top_p=0.9, top_k=40, min_p=0.005), temperature=0.9)


@pytest.fixture
def wide_rounds(monkeypatch):
    """8 first candidates (most tokens' kept sets reach past them) and a record of the wide round: tokens it
    decided, the slots each emitting pass asked for."""
    from logitless.ops import truncation_wide
    from logitless.ops.triton import above_select
    monkeypatch.setenv("LOGITLESS_TRUNCATION_CANDIDATES", "8")
    seen = {"decided": 0, "direct": 0, "left": 0, "slots": [], "pruned": 0}
    real_round, real_above = truncation_wide.wide_round, above_select.above
    real_prefix = truncation_wide._nucleus_prefix

    def nucleus_prefix(*args, **kwargs):
        filled, pruned = real_prefix(*args, **kwargs)
        seen["pruned"] += int(pruned.sum())
        return filled, pruned
    monkeypatch.setattr(truncation_wide, "_nucleus_prefix", nucleus_prefix)

    def wide_round(*args, **kwargs):
        done, direct, left = real_round(*args, **kwargs)
        seen["decided"] += sum(int(p.pos.numel()) for p in done + direct)
        seen["direct"] += sum(int(p.pos.numel()) for p in direct)
        seen["left"] += int(left.numel())
        return done, direct, left

    def above(*args, **kwargs):
        seen["slots"].append(args[4])
        return real_above(*args, **kwargs)
    monkeypatch.setattr(truncation_wide, "wide_round", wide_round)
    monkeypatch.setattr(above_select, "above", above)
    return seen


def _wide_inputs():
    # one shape on every device: at V 4099 (the other tests' shape) a top_p of 0.95 keeps thousands of ids, most of
    # them too close to the bound for float64 to decide, and a nucleus of 0.99999 is past any slots a test can ask
    return make_inputs(lead=(2, 5), v=1031, h=48, dtype=torch.bfloat16, logit_std=2.0)


@pytest.mark.parametrize("nucleus", ["kernel", "sort"])
@pytest.mark.parametrize("truncation", [Truncation(top_p=0.95), Truncation(min_p=0.02),
                                        Truncation(top_p=0.9, min_p=0.005), Truncation(top_p=0.6)])
def test_triton_wide_kept_sets(truncation, nucleus, wide_rounds, monkeypatch):
    """Kept sets past the first candidates on the triton backend, decided by every logit above a bound
    (``ops/truncation_wide.py``) in one more pass, against float64: sets, values, gradients; the sets decided
    from the emitted logits as they lie (``triton/nucleus.py``), or sorted."""
    monkeypatch.setenv("LOGITLESS_TRUNCATION_NUCLEUS", nucleus)
    hidden, weight, labels = _wide_inputs()
    check(hidden, weight, labels, "triton", truncation, temperature=0.9)
    assert wide_rounds["decided"] > 0
    if nucleus == "kernel":
        assert wide_rounds["direct"] > 0
    else:
        # top_p alone: the emitted ids narrowed to the nucleus's histogram bins before the sort
        assert wide_rounds["direct"] == 0 and (wide_rounds["pruned"] > 0) == (truncation.min_p is None)


def test_triton_wide_round_leaves_top_k_and_grows_its_slots(wide_rounds, monkeypatch):
    """A token with more ids above its bound than the first slots is asked again with its exact count; one past
    MAX_SLOTS is left to more candidates; a top_k token beside them (never sent to the wide round: its candidates
    hold k + 1): every path against float64."""
    from logitless.ops import truncation_wide
    monkeypatch.setattr(truncation_wide, "FIRST_SLOTS", 16)
    monkeypatch.setattr(truncation_wide, "MAX_SLOTS", 900)
    hidden, weight, labels = _wide_inputs()
    top_k = torch.full(labels.shape, -1)
    top_k[0, 1] = 30
    top_p = torch.full(labels.shape, 0.9, dtype=torch.float64)
    top_p[1, :2] = 0.99999                                  # past 900 ids above the bound: more candidates
    check(hidden, weight, labels, "triton", Truncation(top_k=top_k, top_p=top_p), temperature=0.9)
    assert wide_rounds["decided"] > 0 and wide_rounds["left"] >= 2        # the two widest nuclei
    assert wide_rounds["slots"][0] == 16 and max(wide_rounds["slots"]) > 16


@pytest.fixture
def dense_calls(monkeypatch):
    """The tokens of each dense backward call (``ops/truncation_dense.py``), in call order."""
    from logitless.ops import truncation_dense
    seen = []
    real = truncation_dense.DenseBackward.backward

    def backward(ctx, *grads):
        seen.append(int(ctx.saved_tensors[2].numel()))
        return real(ctx, *grads)
    monkeypatch.setattr(truncation_dense.DenseBackward, "backward", staticmethod(backward))
    return seen


@pytest.mark.parametrize("truncation,kw", [
    (Truncation(top_p=0.9), {}), (Truncation(min_p=0.05), dict(with_entropy=False)),
    (Truncation(top_k=20), dict(softcap=4.0)), (Truncation(top_p=0.95, min_p=0.01), dict(grad_hidden=False)),
    (Truncation(top_p=0.8), dict(grad_weight=False))])
def test_triton_dense_backward(truncation, kw, dense_calls, monkeypatch):
    """Tokens whose kept sets take the dense backward (``ops/truncation_dense.py``: the plain op's dlogits kernel
    masked to the set, then cuBLAS): every token (LOGITLESS_TRUNCATION_DENSE_IDS=1) against float64, values and
    gradients, with and without entropy, softcap, one input's gradient only."""
    monkeypatch.setenv("LOGITLESS_TRUNCATION_DENSE_IDS", "1")
    hidden, weight, labels = _wide_inputs()
    check(hidden, weight, labels, "triton", truncation, temperature=0.9, **kw)
    assert dense_calls and dense_calls[0] >= labels.numel() // 2      # most tokens' boundaries are clear


def test_triton_dense_and_pair_backwards_in_one_batch(dense_calls, monkeypatch):
    """Kept sets of 30 ids and more take the dense backward, the rest the pairs' (top_p per sequence): one call
    against float64."""
    monkeypatch.setenv("LOGITLESS_TRUNCATION_DENSE_IDS", "30")
    hidden, weight, labels = _wide_inputs()
    top_p = torch.tensor([[0.97], [0.3]], dtype=torch.float64)[: labels.shape[0]]
    if labels.shape[0] > 2:
        top_p = torch.tensor([[0.97], [0.3], [0.9]], dtype=torch.float64)
    out, _ = check(hidden, weight, labels, "triton", Truncation(top_p=top_p), temperature=0.9)
    assert dense_calls and 0 < dense_calls[0] < labels.numel()
    assert int((out.kept_count >= 30).sum()) >= dense_calls[0]


# ------------------------------------------------------------------------------------------ refusals

BAD_SETTINGS = [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=-0.1), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"), (dict(min_p=float("nan")), "min_p"),
    (dict(top_p=torch.tensor([[0.9], [0.0], [0.5]])), "top_p"),
    (dict(top_k=torch.tensor([[5], [0], [7]])), "top_k"),
    (dict(min_p=torch.full(LEAD, 0.1).index_put((torch.tensor([1]), torch.tensor([2])), torch.tensor(2.0))),
     "min_p"),
    (dict(top_p=torch.full((5,), 0.9)), "top_p"),                  # does not broadcast to (3, 7)
    (dict(top_k=torch.full((2, 7), 5)), "top_k"),
    (dict(min_p=torch.full((3, 7, 1), 0.1)), "min_p"),
    (dict(top_p=torch.full((7,), 0.9)), "top_p"),                  # [s] for [b, s]: ambiguous
]


@pytest.mark.parametrize("settings,field", BAD_SETTINGS)
def test_bad_settings_are_refused_by_name(settings, field):
    hidden, weight, labels = make_inputs(lead=LEAD)
    with pytest.raises(ValueError, match=field):
        fused_logprobs(hidden, weight, labels, truncation=Truncation(**settings))


@pytest.mark.parametrize("settings,field", [
    (dict(top_k=5.0), "top_k"), (dict(top_k=True), "top_k"), (dict(top_k=torch.full(LEAD, 5.0)), "top_k"),
    (dict(top_p="0.9"), "top_p"), (dict(top_p=torch.ones(LEAD, dtype=torch.int64)), "top_p"),
    (dict(min_p=torch.zeros(LEAD, dtype=torch.int32)), "min_p"), (dict(kept_ids=[[1, 2]]), "kept_ids"),
    (dict(kept_ids=torch.zeros(*LEAD, 4)), "kept_ids"),
])
def test_settings_of_the_wrong_kind_are_refused_by_name(settings, field):
    hidden, weight, labels = make_inputs(lead=LEAD)
    with pytest.raises((TypeError, ValueError), match=field):
        fused_logprobs(hidden, weight, labels, truncation=Truncation(**settings))


def test_bad_kept_ids_are_refused():
    hidden, weight, labels = make_inputs(lead=LEAD)
    good = random_kept_ids(labels, most=20)

    def refused(kept_ids, needle, **settings):
        with pytest.raises(ValueError, match=needle):
            fused_logprobs(hidden, weight, labels, truncation=Truncation(kept_ids=kept_ids, **settings))

    for settings in (dict(top_p=0.9), dict(top_k=5), dict(min_p=0.1), dict(top_p=1.0)):
        refused(good, "kept_ids", **settings)
    for bad_id in (4099, 10 ** 6, -2):
        ids = good.clone()
        ids[1, 2, 0] = bad_id
        refused(ids, "kept_ids")
    ids = good.clone()
    ids[2, 3, :2] = torch.tensor([11, 11])                           # an id repeated within a token
    refused(ids, "kept_ids")
    ids = good.clone()
    ids[0, 0] = -1                                                   # no id at all for a scored token
    refused(ids, "kept_ids")
    refused(good[:2], "kept_ids")                                    # not labels.shape + (K,)
    refused(good[..., 0], "kept_ids")
    refused(good.reshape(3, 7, 1, -1), "kept_ids")


def test_check_inputs_false_is_refused():
    hidden, weight, labels = make_inputs(lead=LEAD)
    for truncation in (Truncation(top_p=0.9), Truncation(kept_ids=random_kept_ids(labels, most=5))):
        with pytest.raises(ValueError, match="check_inputs"):
            fused_logprobs(hidden, weight, labels, truncation=truncation, check_inputs=False)


def test_other_refusals():
    hidden, weight, labels = make_inputs(lead=LEAD)
    with pytest.raises(TypeError, match="truncation"):
        fused_logprobs(hidden, weight, labels, truncation={"top_p": 0.9})
    with pytest.raises(ValueError, match="truncation"):                # k labels per token
        fused_logprobs(hidden, weight, torch.randint(0, 4099, (*LEAD, 3)), truncation=Truncation(top_p=0.9))
    labels[0, 0] = 4099                                                # a label outside the vocabulary
    with pytest.raises(ValueError, match="label"):
        fused_logprobs(hidden, weight, labels, truncation=Truncation(top_p=0.9))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_the_order_is_min_p_then_top_k_then_top_p(backend):
    """Rows where the order matters: top_p over top_k's survivors renormalised keeps fewer ids than either alone;
    min_p before top_k leaves fewer than k survivors, all kept."""
    hidden, weight, labels = make_inputs(lead=(1, 7), logit_std=2.0)
    z = logits64(hidden, weight, labels.shape, 1.0).reshape(-1, 4099)
    n = z.shape[0]

    def alone(k=-1, p=1.0, m=0.0):
        return kept_mask64(z, *(per_row(x, (n,), d) for x, d in ((k, torch.int64), (p, torch.float64),
                                                                  (m, torch.float64)))).sum(-1)

    _, ref = check(hidden, weight, labels, backend, Truncation(top_k=20, top_p=0.5), temperature=1.0)
    either = torch.minimum(alone(p=0.5), alone(k=20))
    assert (ref.kept_count.reshape(-1) <= either).all() and (ref.kept_count.reshape(-1) < either).any()
    _, ref = check(hidden, weight, labels, backend, Truncation(top_k=2000, min_p=0.02), temperature=1.0)
    assert (ref.kept_count < 2000).all() and torch.equal(ref.kept_count.reshape(-1), alone(m=0.02))


def test_triton_wide_round_whole_vocabulary_beside_a_nucleus(wide_rounds, monkeypatch):
    """A token with every id above its bound (top_p within 1e-7 of 1) asked again in the same emitting pass as
    tokens whose nuclei end inside the vocabulary: the pass is as wide as the vocabulary, yet only the first token
    has seen all of it (the others' nuclei are of the whole mass, not of what was emitted), against float64."""
    from logitless.ops import truncation_wide
    monkeypatch.setattr(truncation_wide, "FIRST_SLOTS", 16)
    hidden, weight, labels = _wide_inputs()
    top_p = torch.full(labels.shape, 0.9, dtype=torch.float64)
    top_p[0, 0] = 1.0 - 1e-7
    check(hidden, weight, labels, "triton", Truncation(top_p=top_p), temperature=0.9)
    assert wide_rounds["decided"] > 0 and max(wide_rounds["slots"]) > weight.shape[0]


def test_wide_nucleus_prefix_keeps_the_first_id_left_out():
    """A top_p-alone token's emitted ids narrowed to its nucleus's histogram bins keep the first id the nucleus
    leaves out (``truncation_dense.boundary`` needs it for a clear boundary), also where the bins right after the
    nucleus are empty (a sparse top: a gap of one nat where a bin is 0.13), and every id before it, in order."""
    from logitless.ops.truncation_select import RowSettings
    from logitless.ops.truncation_wide import _nucleus_prefix, bounds
    torch.manual_seed(3)
    vocab, r = 4099, 5
    z = torch.randn(r, vocab)
    z[:, 0], z[:, 1] = 10.0, 9.0                 # the nucleus at top_p 0.5: id 0 alone; id 1 left out, a nat below
    z[2:, 1] = 9.0 + torch.rand(r - 2) * 0.5     # and further rows
    z = z[:, torch.randperm(vocab)]
    lse = torch.logsumexp(z.double(), dim=1).float()
    top_p = torch.tensor([0.5, 0.45, 0.3, 0.55, 0.6], dtype=torch.float64)
    s = RowSettings(torch.full((r,), -1), top_p, torch.zeros(r, dtype=torch.float64))
    values, order = z.sort(dim=1, descending=True)
    tau, which = bounds(values[:, :8] - lse.unsqueeze(1), lse, s, vocab)
    assert which.all()
    filled = values >= tau.unsqueeze(1)
    narrowed, pruned = _nucleus_prefix(values, filled, lse, s, tau)
    assert pruned.all()
    p = torch.softmax(z.double(), dim=1).sort(dim=1, descending=True).values
    first_out = ((torch.cumsum(p, dim=1) - p) < top_p.unsqueeze(1)).sum(dim=1)
    for i in range(r):
        kept = int(narrowed[i].sum())
        assert narrowed[i, :kept].all() and kept < int(filled[i].sum())        # a prefix, and something pruned
        assert kept > int(first_out[i]), (i, kept, int(first_out[i]))


@pytest.mark.parametrize("truncation", [Truncation(top_p=0.95), Truncation(top_p=0.9, min_p=0.005)])
def test_triton_wide_round_is_batch_invariant(truncation, wide_rounds):
    """The wide round's outputs of a token (the nucleus kernel's fixed-point sums over slots in the emitting pass's
    schedule order, the sorted rest) are the same bits in a batch, in the batch reversed, alone, and with or
    without a gradient to follow."""
    hidden, weight, labels = _wide_inputs()
    dev = device_for("triton")
    h, w, y = hidden.reshape(-1, hidden.shape[-1]).to(dev), weight.to(dev), labels.reshape(-1).to(dev)

    def run(rows, grad=False):
        out = fused_logprobs(h[rows].requires_grad_(grad), w, y[rows], temperature=0.9, backend="triton",
                             truncation=truncation)
        return [t.detach().cpu() for t in (out.logprobs, out.entropy, out.inside, out.kept_count, out.kept_logprob)]

    n = y.shape[0]
    whole = run(torch.arange(n))
    assert wide_rounds["direct"] > 0
    # and with a backward to come (a trainer's current log-probs against its old ones, computed without)
    for a, b in zip(whole, run(torch.arange(n), grad=True), strict=True):
        assert torch.equal(a, b)
    flipped = run(torch.arange(n).flip(0))
    for a, b in zip(whole, flipped, strict=True):
        assert torch.equal(a, b.flip(0))
    for i in (0, n - 1):
        alone = run(torch.tensor([i]))
        for a, b in zip(whole, alone, strict=True):
            assert torch.equal(a[i:i + 1], b)


def test_a_wider_top_k_beside_a_token_changes_none_of_its_bits(monkeypatch):
    """Each token's first selection round asks its own candidates (LOGITLESS_TRUNCATION_CANDIDATES, or one past its
    top_k): a token's outputs are the same bits alone and beside a token of a wider top_k (which once gave the
    whole batch 301 first candidates: a top_p token's nucleus then came from them, not from the wide round, and the
    selection's lse follows the candidates a tile keeps). On the triton backend, whose bits are batch invariant
    (docs/determinism.md)."""
    monkeypatch.setenv("LOGITLESS_TRUNCATION_CANDIDATES", "40")
    backend = "triton"
    hidden, weight, labels = _wide_inputs()
    dev = device_for(backend)
    h, w, y = hidden.reshape(-1, hidden.shape[-1]).to(dev), weight.to(dev), labels.reshape(-1).to(dev)
    top_k = torch.full(y.shape, -1, device=dev)        # top_p alone: past its first candidates, the wide round
    top_k[1::2] = 300

    def run(rows):
        out = fused_logprobs(h[rows], w, y[rows], temperature=0.9, backend=backend,
                             truncation=Truncation(top_k=top_k[rows], top_p=0.97))
        return [t.detach().cpu() for t in (out.logprobs, out.entropy, out.inside, out.kept_count, out.kept_logprob)]

    both = run(torch.arange(y.shape[0]))
    for i in (0, 2):
        for a, b in zip(both, run(torch.tensor([i])), strict=True):
            assert torch.equal(a[i:i + 1], b)
