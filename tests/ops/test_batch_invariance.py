"""Batch invariance of the triton backend (docs/determinism.md): a token's log-prob and entropy are the same bits
whatever batch they are computed in, and a fixed batch's gradients are the same bits run to run.

- On any machine, without a GPU: every launch of the statistics and combine kernels (Triton and Gluon) uses the
  one compiled build for every token count, as triton's own launcher keys it for an sm_90 GPU (a child process,
  ``build_keys.py``); where the policy loss's pass keys other builds (chunks at sequence boundaries, unaligned
  slices), they compile to the same sm_90 program. This is what broke it on the GPU: triton compiled the combine
  once for n = 1, once for n % 16 == 0 and once for the rest, with block layouts that sum a token's vocabulary
  tiles in different orders. The interpreter has no builds, so only this check sees that cause without a GPU.
- Under the interpreter (CI) and on a GPU: the guarantee itself, torch.equal on every case (one token a call,
  larger batches, permutations, ignored rows, per-token temperatures, token chunks of the workspaces,
  fused_policy_loss against fused_logprobs on each of its routes, the entropy-free call, run to run, gradients
  run to run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

from logitless import fused_logprobs
from logitless.losses import fused_policy_loss
from logitless.ops.triton import policy_stats_gluon
from logitless.ops.triton.common import INTERPRETING

HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETING else "cpu"
R, H, V = 21, 96, 523     # 9 vocabulary tiles under the interpreter, the last ragged


def test_one_build_for_every_token_count():
    """Calls of 1, 7, 16, 37, 64 and 300 tokens: one build per kernel (fails where the token count is
    specialised: three builds each); and the policy loss's pass, in even chunks and in chunks cut at sequence
    boundaries, compiles to one sm_90 program per kernel variant (fails where the token count is specialised:
    three programs of the combine)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([HERE, *sys.path])
    out = subprocess.run([sys.executable, "-m", "build_keys"], cwd=HERE, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    keys = found["keys"]
    kernels = ["combine", "forward statistics (Triton)", "policy statistics (Triton)"]
    if triton.__version__.startswith(policy_stats_gluon.CHECKED_TRITON):
        kernels.append("statistics (Gluon)")      # else the ops never launch it (its module says why)
    assert sorted(keys) == kernels
    for kernel, per_n in keys.items():
        assert len(per_n) == 6, kernel
        builds = {json.dumps(k) for k in per_n.values()}
        assert len(builds) == 1, f"{kernel}: {len(builds)} builds for token counts {sorted(per_n, key=int)}"
    # the policy loss's pass too, with chunks cut at sequence boundaries (their slices start unaligned, which
    # triton keys as other builds): one sm_90 program per kernel variant
    assert sorted(found["programs"]) == kernels
    for kernel, programs in found["programs"].items():
        assert programs == 1, f"{kernel}: {programs} different sm_90 programs for one variant"


def _head(seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(R, H, generator=g).bfloat16().to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * (3 / H ** 0.5)).bfloat16().to(DEVICE)
    labels = torch.randint(0, V, (R,), generator=g).to(DEVICE)
    return g, hidden, weight, labels


def _score(hidden, weight, labels, **kw):
    with torch.no_grad():
        out = fused_logprobs(hidden, weight, labels, backend="triton", with_entropy=kw.pop("with_entropy", True),
                             **kw)
    return out.logprobs, out.entropy


def _embed(g, hidden, labels, n_total: int, ignored_share: float):
    """A batch of n_total rows with the reference rows at random places; of the others, ``ignored_share``
    ignored (-100), the rest fresh rows with labels."""
    big_h = torch.randn(n_total, H, generator=g).bfloat16().to(hidden.device)
    big_y = torch.randint(0, V, (n_total,), generator=g).to(labels.device)
    drop = torch.rand(n_total, generator=g).to(labels.device) < ignored_share
    big_y[drop] = -100
    where = torch.randperm(n_total, generator=g)[:hidden.shape[0]].to(hidden.device)
    big_h[where], big_y[where] = hidden, labels
    return big_h, big_y, where


def _same(got, want, what):
    assert torch.equal(got[0], want[0]), f"{what}: log-probs differ in {int((got[0] != want[0]).sum())} tokens"
    if want[1] is not None:
        assert torch.equal(got[1], want[1]), f"{what}: entropies differ in {int((got[1] != want[1]).sum())} tokens"


@pytest.mark.parametrize("case", ["one token a call", "batch + 1", "batch + 7", "3 batches + 5", "permuted",
                                  "half of the other rows ignored", "37% of the other rows ignored",
                                  "every other row ignored, unchecked", "temperature tensor of ones",
                                  "forward token chunks", "run to run"])
def test_fused_logprobs_is_batch_invariant(case, seed, monkeypatch):
    g, hidden, weight, labels = _head(seed)
    ref = _score(hidden, weight, labels)
    if case == "one token a call":
        got = [_score(hidden[i:i + 1], weight, labels[i:i + 1]) for i in range(5)]
        got = torch.cat([x[0] for x in got]), torch.cat([x[1] for x in got])
        ref = ref[0][:5], ref[1][:5]
    elif case in ("batch + 1", "batch + 7", "3 batches + 5"):
        n_total = {"batch + 1": R + 1, "batch + 7": R + 7, "3 batches + 5": 3 * R + 5}[case]
        big_h, big_y, where = _embed(g, hidden, labels, n_total, 0.0)
        lp, ent = _score(big_h, weight, big_y)
        got = lp[where], ent[where]
    elif case == "permuted":
        perm = torch.randperm(R, generator=g).to(hidden.device)
        lp, ent = _score(hidden[perm], weight, labels[perm])
        inv = torch.argsort(perm)
        got = lp[inv], ent[inv]
    elif case.endswith("ignored"):
        share = 0.5 if case.startswith("half") else 0.37
        big_h, big_y, where = _embed(g, hidden, labels, int(R / (1 - share)) + 3, 1.0)
        lp, ent = _score(big_h, weight, big_y)
        got = lp[where], ent[where]
    elif case == "every other row ignored, unchecked":
        # check_inputs=False computes every row (ignored ones too, with no label): the kept rows' bits hold
        big_h, big_y, where = _embed(g, hidden, labels, 2 * R, 1.0)
        lp, ent = _score(big_h, weight, big_y, check_inputs=False)
        got = lp[where], ent[where]
    elif case == "temperature tensor of ones":
        got = _score(hidden, weight, labels, temperature=torch.ones(R, device=hidden.device))
    elif case == "forward token chunks":
        # the forward's statistics workspace for 16 tokens a call (interpreter tiles), or 128 on a GPU
        monkeypatch.setenv("LOGITLESS_TRITON_STATS_BYTES", "1")
        got = _score(hidden, weight, labels)
    else:
        got = _score(hidden, weight, labels)
    _same(got, ref, case)


@pytest.mark.parametrize("value, dtype", [(1.1, torch.float64), (0.75, torch.float32), (0.7, torch.float64)])
def test_temperature_tensor_holding_the_scalar_gives_the_same_bits(value, dtype, seed):
    """A per-token temperature tensor that holds the scalar's value exactly (float64, or float32 when the value is
    a float32 number) gives the scalar's bits, per token and per sequence. A float32 tensor of 1.1 holds
    1.10000002384...: another temperature (docs/determinism.md)."""
    g, hidden, weight, labels = _head(seed)
    ref = _score(hidden, weight, labels, temperature=value)
    _same(_score(hidden, weight, labels, temperature=torch.full((R,), value, dtype=dtype, device=DEVICE)), ref,
          f"per-token {dtype} temperature {value}")
    seq = _score(hidden.view(3, 7, H), weight, labels.view(3, 7),
                 temperature=torch.full((3, 1), value, dtype=dtype, device=DEVICE))
    _same((seq[0].reshape(-1), seq[1].reshape(-1)), ref, f"per-sequence {dtype} temperature {value}")


def test_without_entropy_and_policy_loss_give_the_same_bits(seed, monkeypatch):
    """The entropy-free call's log-probs, and fused_policy_loss's log-probs and entropy (in a batch with ignored
    rows, its workspace cut into token chunks), equal fused_logprobs' alone."""
    g, hidden, weight, labels = _head(seed)
    ref = _score(hidden, weight, labels)
    lp, ent = _score(hidden, weight, labels, with_entropy=False)
    assert ent is None
    _same((lp, None), (ref[0], None), "with_entropy=False")
    big_h, big_y, where = _embed(g, hidden, labels, 2 * R + 5, 0.5)
    adv = torch.randn(big_y.shape[0], generator=g).to(hidden.device)
    for workspace in (None, "1"):
        if workspace:
            monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_BYTES", workspace)
        h = big_h.clone().requires_grad_(True)
        out = fused_policy_loss(h, weight, big_y, adv, entropy_coef=0.01, backend="triton")
        _same((out.logprobs[where], out.entropy[where]), ref, f"fused_policy_loss (workspace {workspace})")


# fused_policy_loss's routes (losses/api.py): each must give fused_logprobs' bits for the log-prob and entropy
POLICY_ROUTES = {
    # the torch derivatives of ops/policy_terms.py instead of the triton terms kernel, one fused pass
    # check_inputs=False: every row computed, the ignored ones with no label
    "token-local, unchecked": dict(entropy_coef=0.01, check_inputs=False),
    "rejection mask (torch terms)": dict(rejection_k2_max=0.05, entropy_coef=0.01),
    "current_is token (torch terms)": dict(surrogate="gpg", current_is="token_truncate", current_is_max=1.5),
    # coupled within sequences: one fused pass whose chunks are cut at sequence boundaries (api._sequence_bounds)
    "sequence-level ratio (chunks at sequence boundaries)": dict(ratio_level="sequence",
                                                                 loss_agg="seq-mean-token-mean"),
    "sequence rejection (chunks at sequence boundaries)": dict(rejection_seq_mean_k2_max=0.2, loss_agg="token-mean"),
    # coupled across the batch: fused_logprobs' forward, then a second pass
    "entropy mask (two passes)": dict(entropy_quantile=0.5, entropy_coef=0.01),
}


@pytest.mark.parametrize("route", list(POLICY_ROUTES))
def test_every_policy_loss_route_gives_the_same_bits(route, seed, monkeypatch):
    """Sequences of 7 tokens (some ignored), the policy workspace at its smallest (chunks of one token tile:
    16 rows under the interpreter, 128 on a Hopper GPU in half precision, so chunks cut at sequence boundaries
    start off the token tiles): fused_policy_loss's log-probs and entropy equal fused_logprobs' on the same rows,
    whichever pass the loss takes."""
    import logitless.losses.api as api
    from logitless.ops.triton.common import choose_tiles
    g = torch.Generator().manual_seed(seed)
    # the smallest chunk: one tile of the policy pass's tokens (its tiles on this device, or the interpreter's)
    tile = choose_tiles("POLICY", torch.bfloat16, torch.device(DEVICE)).block_m
    # 5 scored tokens a sequence (below): more scored rows than one tile, so at least two chunks
    b, s = max(6, tile // 5 + 2), 7
    hidden = torch.randn(b * s, H, generator=g).bfloat16().to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * (3 / H ** 0.5)).bfloat16().to(DEVICE)
    labels = torch.randint(0, V, (b * s,), generator=g).to(DEVICE)
    # 2 ignored tokens at random places in each sequence (never its first): 5 scored tokens a sequence, so the
    # chunks cut at sequence boundaries (at most one tile of scored rows) start at multiples of 5, the first at
    # the largest below the tile (15 of 16, 125 of 128): off the token tiles, on every seed
    ignored = torch.stack([1 + torch.randperm(s - 1, generator=g)[:2] for _ in range(b)])
    ignored += torch.arange(b).unsqueeze(1) * s
    labels[ignored.reshape(-1).to(DEVICE)] = -100
    ref = _score(hidden, weight, labels)
    keep = labels != -100
    monkeypatch.setenv("LOGITLESS_POLICY_WORKSPACE_BYTES", "1")
    cuts = []
    original = api._sequence_bounds
    monkeypatch.setattr(api, "_sequence_bounds", lambda *a: cuts.append(original(*a)) or cuts[-1])
    import logitless.losses.function as function
    kernels = []
    terms_for = function.policy_terms_for
    monkeypatch.setattr(function, "policy_terms_for", lambda *a: kernels.append(terms_for(*a)) or kernels[-1])
    ran = []
    two_pass = api._reference
    monkeypatch.setattr(api, "_reference", lambda *a, **k: ran.append(1) or two_pass(*a, **k))
    old = (ref[0] + 0.1 * torch.randn(b * s, generator=g).to(DEVICE)).clamp(max=0.0).masked_fill(~keep, 0.0)
    adv = torch.randn(b, 1, generator=g).expand(b, s).to(DEVICE)
    h = hidden.view(b, s, H).clone().requires_grad_(True)
    out = fused_policy_loss(h, weight, labels.view(b, s), adv, old.view(b, s), backend="triton",
                            **POLICY_ROUTES[route])
    out.loss.backward()
    assert h.grad.abs().sum() > 0
    _same((out.logprobs.reshape(-1)[keep], out.entropy.reshape(-1)[keep]), (ref[0][keep], ref[1][keep]), route)
    if "sequence boundaries" in route:
        # the fused pass ran in several chunks, some starting off a token tile
        assert not ran and len(cuts) == 1 and cuts[0] is not None and len(cuts[0]) > 2, cuts
        assert any(start % tile for start in cuts[0][1:-1]), cuts
    assert bool(ran) == route.endswith("(two passes)")
    if route.endswith("(torch terms)"):
        assert kernels == [None]      # the triton terms kernel does not cover these settings


def test_gradients_are_the_same_bits_run_to_run(seed):
    """A fixed batch with ignored rows: d_hidden and d_weight of a loss on log-probs and entropy, twice."""
    g, hidden, weight, labels = _head(seed)
    big_h, big_y, _ = _embed(g, hidden, labels, 2 * R + 3, 0.3)
    a = torch.randn(big_y.shape[0], generator=g).to(hidden.device)
    b = torch.randn(big_y.shape[0], generator=g).to(hidden.device)
    grads = []
    for _ in range(2):
        h = big_h.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        out = fused_logprobs(h, w, big_y, backend="triton", with_entropy=True)
        ((a * out.logprobs).sum() + (b * out.entropy).sum()).backward()
        grads.append((h.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert grads[0][0].abs().sum() > 0 and grads[0][1].abs().sum() > 0


def test_a_bad_forward_kernel_knob_is_an_error_on_every_machine(monkeypatch):
    """LOGITLESS_TRITON_FWD_KERNEL is read on every call, whether or not the Gluon kernel could run here."""
    _, hidden, weight, labels = _head(0)
    monkeypatch.setenv("LOGITLESS_TRITON_FWD_KERNEL", "gluon")
    with pytest.raises(ValueError, match="LOGITLESS_TRITON_FWD_KERNEL"):
        _score(hidden, weight, labels)


def test_chunked_backend_vocabulary_chunks_do_not_depend_on_the_batch_on_cpu():
    """The chunked backend's forward cuts the vocabulary at the same columns for every batch on CPU."""
    from logitless.ops import chunked
    cpu = torch.device("cpu")
    widths = {chunked.stats_columns(n, 151936, cpu) for n in (1, 7, 16, 300, 2048)}
    assert len(widths) == 1 and widths.pop() < 151936


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="measured with MKL's GEMM kernels only")
def test_chunked_backend_on_cpu_is_batch_invariant_from_16_tokens(seed):
    """CPU, chunked backend: a token's bits are the same in any call of 16 or more tokens (measured with MKL:
    calls of 1-3, 5 or 9 tokens take other GEMM kernels and differ; docs/determinism.md)."""
    g = torch.Generator().manual_seed(seed)
    h, v = 200, 4099
    hidden = torch.randn(600, h, generator=g).bfloat16()
    weight = (torch.randn(v, h, generator=g) * (3 / h ** 0.5)).bfloat16()
    labels = torch.randint(0, v, (600,), generator=g)
    labels[::7] = -100
    ref = fused_logprobs(hidden[:16], weight, labels[:16], backend="chunked", with_entropy=True)
    for n in (17, 64, 600):
        where = torch.randperm(n, generator=g)[:16]
        idx = torch.randperm(600, generator=g)[:n]
        idx[where] = torch.arange(16)
        out = fused_logprobs(hidden[idx], weight, labels[idx], backend="chunked", with_entropy=True)
        assert torch.equal(out.logprobs[where], ref.logprobs), n
        assert torch.equal(out.entropy[where], ref.entropy), n


@pytest.mark.skipif(DEVICE == "cpu" and not torch.backends.mkl.is_available(),
                    reason="on the CPU the two heads' products are MKL's GEMMs, row-invariant from 16 rows")
def test_distillation_per_token_outputs_are_batch_invariant(seed):
    """fused_distillation_loss on the triton backend: a token's divergence and student entropy are the same bits
    in any batch (16 or more tokens on the CPU, whose GEMMs take other kernels below; the elementwise kernels
    reduce each token over column spans fixed by V, then combine the spans in torch), with ignored rows and
    other tokens around it. On a GPU the products are cuBLAS GEMMs whose kernel may depend on the row count: this
    test run there is what says whether the guarantee holds."""
    from logitless.losses import fused_distillation_loss
    g = torch.Generator().manual_seed(seed)
    v, hs, ht, total = 2600, 96, 80, 40      # two column spans under the interpreter, the second ragged
    hidden = torch.randn(total, hs, generator=g).to(DEVICE)
    weight = (torch.randn(v, hs, generator=g) * (3 / hs ** 0.5)).to(DEVICE)
    t_hidden = torch.randn(total, ht, generator=g).to(DEVICE)
    t_weight = (torch.randn(v, ht, generator=g) * (3 / ht ** 0.5)).to(DEVICE)
    labels = torch.randint(0, v, (total,), generator=g).to(DEVICE)
    labels[::7] = -100

    def per_token(idx):
        out = fused_distillation_loss(hidden[idx], weight, labels[idx], teacher_hidden=t_hidden[idx],
                                      teacher_weight=t_weight, divergence="jsd", beta=0.3, backend="triton")
        return out.divergence, out.entropy
    first = torch.arange(16, device=DEVICE)
    ref = per_token(first)
    for n in (17, total):
        where = torch.randperm(n, generator=g)[:16].to(DEVICE)
        idx = torch.randperm(total, generator=g)[:n].to(DEVICE)
        # the first 16 tokens at random places among others
        others = idx[~torch.isin(idx, first)][:n - 16]
        idx = torch.empty(n, dtype=torch.int64, device=DEVICE)
        keep = torch.ones(n, dtype=torch.bool, device=DEVICE)
        keep[where] = False
        idx[where], idx[keep] = first, others
        got = per_token(idx)
        assert torch.equal(got[0][where], ref[0]) and torch.equal(got[1][where], ref[1]), n
