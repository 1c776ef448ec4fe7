"""``logitless.verl.install(fused_loss=True)`` on verl 0.9.1's real actor update: ``TrainingWorker.train_mini_batch``
-> ``FSDPEngineWithLMHead.train_batch`` (FSDP2 on a 1-rank gloo group, see verl_engine.py), one optimizer step
(SGD, so the step is the gradient itself) on the same batch and from the same parameters as verl's own loss
(``verl.workers.utils.losses.ppo_loss`` on verl's own fused-kernel log-probs, logitless not installed):
parameters after the step, every metric verl logs, and ``last_path()``.

Packed (remove-padding) micro-batches run eager attention here: transformers separates the packed sequences
by their position ids, the same in both runs."""
import logging
import math
import re

import pytest
import torch
import verl_engine as ve
from verl_engine import run

from required import import_or_skip

ve.stub_server_modules()
import_or_skip("verl.workers.engine_workers", "make setup installs verl (--no-deps) and its import deps")

import logitless.verl as lv  # noqa: E402
from logitless.verl import FusedPathUnavailable, fused_loss  # noqa: E402

PARAM_TOL = 1e-4       # relative, per parameter, after the step
STEP_TOL = 1e-4        # relative to the whole step's norm, per parameter's step
METRIC_TOL = 1e-5      # relative, or absolute below 1
TIMING = ("perf/", "mfu")
# verl's E[(prod_t rho_t)^2] - 1 over a sequence (bypass_mode's rollout_corr metrics): exp of twice the sum of a
# sequence's log-ratios, so the float32 rounding of each log-prob (~1e-6, logitless' against verl's) grows by
# twice the sequence's length: held to the step's tolerance
SEQUENCE_PRODUCT = ("rollout_corr/chi2_seq",)
# verl's entropy from its "torch" fused-kernel backend (float32, lse - sum p z) is off float64 by up to 5.2e-6 a
# token on these batches, with a bias (-2.0e-5 over 50 tokens; logitless': 4e-7 and -5e-7): under token-sum the
# entropy_loss metric adds that bias up, so it is held to 3e-5
ENTROPY_TOL = 3e-5


@pytest.fixture(scope="module")
def actor(model_dir):
    """An actor built with verl's fused kernels (use_fused_kernels=True, backend "torch")."""
    return ve.Actor(model_dir, ["actor_rollout_ref.model.use_fused_kernels=True"])


pytestmark = pytest.mark.usefixtures("uninstalled")      # tests/verl/conftest.py


def assert_same_update(actor, got, want):
    (m_got, p_got), (m_want, p_want) = got, want
    initial = (p.full_tensor() if hasattr(p, "full_tensor") else p for p in actor.initial)
    step = {n: p_want[n] - p0 for n, p0 in zip(p_want, initial, strict=True)}
    step_norm = math.sqrt(sum(float(s.square().sum()) for s in step.values()))
    assert step_norm > 1e-3, "the step moved nothing: the comparison would be empty"
    for n, p in p_want.items():
        assert float((p_got[n] - p).norm()) <= PARAM_TOL * float(p.norm()) + 1e-12, n
        s_got = p_got[n] - (p - step[n])
        assert float((s_got - step[n]).norm()) <= STEP_TOL * step_norm, n
    missing = set(m_want) - set(m_got)
    assert not missing, f"metrics verl logs but the fused run does not: {missing}"
    for key, want_v in m_want.items():
        if key.startswith(TIMING):
            continue
        got_v = m_got[key]
        want_l, got_l = (list(v) if isinstance(v, list) else [v] for v in (want_v, got_v))
        assert len(got_l) == len(want_l), key
        # a gradient's norm, and the exp of a sequence's summed log-ratios: the step's tolerance
        tol = STEP_TOL if key == "grad_norm" or key in SEQUENCE_PRODUCT else METRIC_TOL
        tol = ENTROPY_TOL if key == "actor/entropy_loss" else tol
        for g, w in zip(got_l, want_l, strict=True):
            assert abs(float(g) - float(w)) <= tol * max(1.0, abs(float(w))), (key, g, w)


# (loss_agg_mode, actor settings, engine settings): vanilla under each aggregation, dual clip active
# (clip_ratio_c 1.2), entropy bonus of either sign, packed and padded micro-batches, fixed and dynamic
# micro-batch sizes (test_every_mode_matches_verl_update covers the KL estimators and the other modes)
CASES = [
    ("token-mean", ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
                    "actor_rollout_ref.actor.entropy_coeff=0.01"], {"use_remove_padding": True}),
    ("token-sum", ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=mse",
                   "actor_rollout_ref.actor.clip_ratio_c=1.2"], {"use_remove_padding": False}),
    ("seq-mean-token-mean", ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=kl",
                             "actor_rollout_ref.actor.entropy_coeff=-0.02",
                             "actor_rollout_ref.actor.clip_ratio_high=0.28"],
     {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ("seq-mean-token-sum-norm", ["actor_rollout_ref.actor.loss_scale_factor=5"],
     {"use_remove_padding": False, "micro_batch_size_per_gpu": 3}),
]


@pytest.mark.parametrize("agg, settings, engine", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_fused_loss_matches_verl_update(actor, agg, settings, engine):
    gen = torch.Generator().manual_seed(7 + len(settings))
    tensors, meta = ve.rollout_batch(gen, actor.model_dir)
    overrides = [f"actor_rollout_ref.actor.loss_agg_mode={agg}", *settings]
    entropy = any("entropy_coeff" in s for s in settings)
    want = run(actor, tensors, meta, overrides, fused=False, calculate_entropy=entropy, engine=engine)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, calculate_entropy=entropy, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert rec.backend in ("chunked", "triton")
    assert_same_update(actor, got, want)
    if any("clip_ratio_c=1.2" in s for s in settings):
        assert max(want[0]["actor/pg_clipfrac_lower"]) > 0, "dual clip never active: the case tests nothing"


def test_matches_verl_without_fused_kernels(model_dir, actor):
    """Against verl's fully unfused update (use_fused_kernels=False: the model's logits, verl's
    log-softmax and entropy), on an actor built without fused kernels."""
    plain = ve.Actor(model_dir)
    gen = torch.Generator().manual_seed(11)
    tensors, meta = ve.rollout_batch(gen, model_dir)
    overrides = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.entropy_coeff=0.01"]
    want = run(plain, tensors, meta, overrides, fused=False)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True)
    assert lv.last_path().path == "fsdp"
    assert_same_update(actor, got, want)
    # and the fused loss on the actor without fused kernels: the model builds logits, so verl's loss runs
    with pytest.raises(FusedPathUnavailable, match="use_fused_kernels=False"):
        run(plain, tensors, meta, overrides, fused=True, strict=True)


def test_untied_head_under_fsdp2(tmp_path):
    """An untied lm_head is an FSDP2 unit of its own whose weight verl's fused forward reads sharded (verl's
    own fused kernels fail on that DTensor): the fused loss runs as that unit's forward, and the update and
    verl's compute_log_prob match verl's unfused actor."""
    ve.save_tiny_qwen2(str(tmp_path), seed=4, tied=False)
    plain = ve.Actor(str(tmp_path))
    fused = ve.Actor(str(tmp_path), ["actor_rollout_ref.model.use_fused_kernels=True"])
    gen = torch.Generator().manual_seed(13)
    tensors, meta = ve.rollout_batch(gen, str(tmp_path))
    overrides = ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.entropy_coeff=0.01"]
    want = run(plain, tensors, meta, overrides, fused=False)
    got = run(fused, tensors, meta, overrides, fused=True, strict=True)
    assert lv.last_path().path == "fsdp"
    assert "lm_head.weight" in want[1]
    assert_same_update(fused, got, want)
    lp_want, ent_want = ve.infer_logprobs(plain, tensors, meta)
    lv.install()
    lp, ent = ve.infer_logprobs(fused, tensors, meta)
    assert float((lp - lp_want).abs().max()) <= 2e-5 and float((ent - ent_want).abs().max()) <= 2e-5
    head = fused.worker.engine.module.lm_head
    assert hasattr(head.weight, "full_tensor"), "the gathered head weight was not resharded after the no-grad forward"


RC = "+actor_rollout_ref.actor.policy_loss.rollout_correction."


@pytest.mark.parametrize("setting, batch, named", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", f"{RC}loss_type=reinforce",
      f"{RC}rollout_is=sequence", f"{RC}rollout_is_batch_normalize=True",
      "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean"], {},
     "rollout_correction.rollout_is_batch_normalize=True"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=full"], {},
     "kl_loss_type='full'"),
])
def test_unfusable_setting_falls_back_recorded(actor, caplog, setting, batch, named):
    """A setting the fused loss cannot reproduce: verl's own loss runs (same update), recorded and logged
    once; under strict mode FusedPathUnavailable names the setting."""
    gen = torch.Generator().manual_seed(5)
    tensors, meta = ve.rollout_batch(gen, actor.model_dir, **batch)
    with pytest.raises(FusedPathUnavailable, match=named.replace("(", r"\(")):
        run(actor, tensors, meta, setting, fused=True, strict=True)
    if "kl_loss_type='full'" in named:
        return            # verl's own loss raises NotImplementedError for "full": nothing to compare
    want = run(actor, tensors, meta, setting, fused=False)
    fused_loss._logged.clear()          # "logged once" counts from here
    with caplog.at_level(logging.WARNING, logger="logitless.verl"):
        got = run(actor, tensors, meta, setting, fused=True)
        run(actor, tensors, meta, setting, fused=True)
    rec = lv.last_path()
    assert rec.path == "unfused" and rec.entry == "verl.policy_loss" and named in rec.reason
    logged = [r for r in caplog.records if named in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert_same_update(actor, got, want)


def test_every_registered_mode_is_mapped(actor):
    """Every policy-loss mode verl registers runs fused (the tests below), bypass_mode for the settings
    ``bypass.py`` maps; its other settings are refused under strict mode before the model runs, naming them."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from logitless.verl import policy
    assert set(POLICY_LOSS_REGISTRY) == set(FUSED_MODES) | {"geo_mean"} | set(policy.PARTLY_FUSED)
    gen = torch.Generator().manual_seed(9)
    tensors, meta = ve.rollout_batch(gen, actor.model_dir)
    for extra, named in [([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_batch_normalize=True"],
                          "rollout_is_batch_normalize=True"),
                         ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_rs=token_k2"],
                          "rollout_rs_threshold=None")]:
        with pytest.raises(FusedPathUnavailable, match=re.escape(named)):
            run(actor, tensors, meta, [f"{P}policy_loss.loss_mode=bypass_mode", *extra], fused=True, strict=True)
        assert lv.last_path().reason.startswith("policy_loss.loss_mode='bypass_mode' with")


P = ve.P
FUSED_MODES = ve.FUSED_MODES


@pytest.mark.parametrize("mode", sorted(FUSED_MODES))
def test_every_mode_matches_verl_update(actor, mode):
    """Each fused loss mode, with a KL loss, an entropy bonus and (every other mode) verl's rollout_is_weights,
    against verl's update; the modes cycle through the aggregations, the KL estimators and packed / padded
    micro-batches."""
    i = sorted(FUSED_MODES).index(mode)
    gen = torch.Generator().manual_seed(20 + i)
    tensors, meta = ve.rollout_batch(gen, actor.model_dir, is_weights=i % 2 == 0, greedy=mode.startswith("dppo"))
    agg = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum-norm"][i % 5]
    kl = ["low_var_kl", "mse", "kl", "abs", "low_var_kl+"][(i + i // 5) % 5]
    overrides = [f"{P}policy_loss.loss_mode={mode}", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_type={kl}", f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02", *FUSED_MODES[mode]]
    engine = {"use_remove_padding": i % 2 == 1}
    want = run(actor, tensors, meta, overrides, fused=False, engine=engine)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(actor, got, want)
    if mode in ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "clip_cov"):
        assert max(want[0]["actor/pg_clipfrac"]) > 0, "no clip event: the case does not test the clipping"


SAPO_CASES = [  # (loss_agg_mode, KL estimator, entropy coefficient, engine settings): the KL loss and the entropy
    # bonus aggregated by loss_agg_mode, sapo's policy term by seq-mean-token-mean (token-sum: the mode test above)
    ("token-mean", "low_var_kl", 0.02, {"use_remove_padding": True}),
    ("seq-mean-token-sum", "mse", -0.03, {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ("seq-mean-token-sum-norm", "kl", 0.05, {"use_remove_padding": True, "micro_batch_size_per_gpu": 3}),
    # verl's default entropy_coeff=0: no entropy bonus, so no entropy_agg (PolicyLoss refuses a setting nothing reads)
    ("token-mean", "kl", 0.0, {"use_remove_padding": True}),
]


@pytest.mark.parametrize("agg, kl, entropy, engine", SAPO_CASES, ids=[f"{c[0]}-entropy{c[2]}" for c in SAPO_CASES])
def test_sapo_terms_aggregated_apart_match_verl_update(actor, agg, kl, entropy, engine):
    """sapo with a KL loss and an entropy bonus under an aggregation other than seq-mean-token-mean: each term
    keeps verl's own aggregation (the fused loss's kl_agg / entropy_agg), against verl's update."""
    gen = torch.Generator().manual_seed(60 + len(agg))
    tensors, meta = ve.rollout_batch(gen, actor.model_dir, is_weights=True)
    overrides = [f"{P}policy_loss.loss_mode=sapo", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_type={kl}", f"{P}kl_loss_coef=0.2", f"{P}entropy_coeff={entropy}",
                 *FUSED_MODES["sapo"]]
    want = run(actor, tensors, meta, overrides, fused=False, engine=engine)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(actor, got, want)
    kl_loss = want[0]["kl_loss"]
    assert all(abs(v) > 1e-4 for v in (kl_loss if isinstance(kl_loss, list) else [kl_loss])), "no KL loss"


def test_sapo_terms_of_a_micro_batch_without_scored_tokens():
    """separate_terms with a policy-term constant of 0 (no scored token in the micro-batch): the coefficients stay,
    so the settings still make a PolicyLoss (an entropy_agg beside an entropy_coef turned to 0 would be refused)."""
    from logitless.losses import PolicyLoss
    from logitless.verl.policy import separate_terms

    kwargs = dict(surrogate="sapo", sapo_tau_pos=1.0, sapo_tau_neg=1.05, loss_agg="seq-mean-token-mean",
                  kl_coef=0.2, kl_type="k1", kl_agg="token-mean", entropy_coef=0.02, entropy_agg="token-mean",
                  dual_clip=None)
    got = separate_terms(kwargs, 0.0, 0.0)
    assert got["entropy_coef"] == 0.02 and got["kl_coef"] == 0.2
    lp = torch.full((2, 3), -1.0)
    PolicyLoss(advantages=torch.ones(2, 3), old_logprobs=lp, ref_logprobs=lp, **got)
    assert separate_terms(kwargs, 2.0, 1.0)["entropy_coef"] == pytest.approx(0.01)


def test_triton_backend_head(model_dir, actor):
    """verl's fused forward with impl_backend "triton" (its Triton linear_cross_entropy, CUDA only, which
    logitless replaces): the fused loss enters there too; against verl's own update on the "torch" backend."""
    triton_actor = ve.Actor(model_dir, ["actor_rollout_ref.model.use_fused_kernels=True",
                                        "actor_rollout_ref.model.fused_kernel_options.impl_backend=triton"])
    assert triton_actor.forward.__name__ == "forward_with_triton_backend"
    gen = torch.Generator().manual_seed(17)
    tensors, meta = ve.rollout_batch(gen, model_dir)
    overrides = [f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01", f"{P}loss_agg_mode=seq-mean-token-mean"]
    engine = {"use_remove_padding": True}
    want = run(actor, tensors, meta, overrides, fused=False, engine=engine)
    got = run(triton_actor, tensors, meta, overrides, fused=True, strict=True, engine=engine)
    assert lv.last_path().path == "fsdp"
    assert_same_update(actor, got, want)


AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


@pytest.mark.parametrize("agg", AGGS)
def test_geo_mean_matches_verl_update(actor, agg):
    """verl's geo_mean (a plain mean over the micro-batch's sequences of per-sequence losses, the KL loss and
    the entropy bonus aggregated by loss_agg_mode over the mini-batch) under every loss_agg_mode, with
    rollout_is_weights (their geometric mean per sequence) on every other one, packed and padded micro-batches,
    fixed and dynamic micro-batch sizes (a mini-batch of three micro-batches: the micro-batch means add up)."""
    i = AGGS.index(agg)
    gen = torch.Generator().manual_seed(40 + i)
    tensors, meta = ve.rollout_batch(gen, actor.model_dir, is_weights=i % 2 == 0)
    kl = ["low_var_kl", "mse", "kl", "abs", "low_var_kl+"][i]
    overrides = [f"{P}policy_loss.loss_mode=geo_mean", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_type={kl}", f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02",
                 f"{P}clip_ratio_low=0.1", f"{P}clip_ratio_high=0.15", f"{P}loss_scale_factor=5" if i == 3 else
                 f"{P}clip_ratio=0.2"]
    engine = [{"use_remove_padding": True}, {"use_remove_padding": False},
              {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30},
              {"use_remove_padding": False, "micro_batch_size_per_gpu": 3}, {"use_remove_padding": True}][i]
    want = run(actor, tensors, meta, overrides, fused=False, engine=engine)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(actor, got, want)
    assert max(want[0]["actor/pg_clipfrac"]) + max(want[0]["actor/pg_clipfrac_lower"]) > 0, \
        "no clipped log-ratio: the case does not test the clipping"


def test_geo_mean_without_kl_or_entropy_matches_verl_update(actor):
    """geo_mean with no KL loss and no entropy bonus: verl's loss ignores loss_agg_mode (seq-mean-token-sum here),
    and PolicyLoss refuses a loss_agg without effect, so the mapping leaves it out; the same update as verl's."""
    gen = torch.Generator().manual_seed(47)
    tensors, meta = ve.rollout_batch(gen, actor.model_dir)
    overrides = [f"{P}policy_loss.loss_mode=geo_mean", f"{P}loss_agg_mode=seq-mean-token-sum", f"{P}use_kl_loss=False",
                 f"{P}entropy_coeff=0", f"{P}clip_ratio=0.2"]
    want = run(actor, tensors, meta, overrides, fused=False, engine={"use_remove_padding": True})
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, engine={"use_remove_padding": True})
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(actor, got, want)
    assert max(want[0]["actor/pg_clipfrac"]) + max(want[0]["actor/pg_clipfrac_lower"]) > 0, \
        "no clipped log-ratio: the case does not test the clipping"


# verl's bypass_mode (old_log_probs = the rollout's; IS weights / rejection mask from this pass's log-probs):
# (rollout_correction settings, loss_agg_mode, engine settings), each with a KL loss, an entropy bonus and the
# batch's rollout_is_weights (which bypass_mode ignores)
BYPASS = [
    ([], "token-mean", {"use_remove_padding": True}),            # ppo_clip, verl's default rollout_is (metrics only)
    ([f"{RC}loss_type=ppo_clip", f"{RC}rollout_is=token", f"{P}clip_ratio_c=1.2"], "seq-mean-token-sum-norm",
     {"use_remove_padding": False, "micro_batch_size_per_gpu": 3}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=null"], "seq-mean-token-mean", {"use_remove_padding": False}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=1.25"], "token-sum",
     {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=1.1"], "seq-mean-token-sum",
     {"use_remove_padding": False}),
    # token-level rejection sampling (rollout_rs): the fused loss's rejection mask
    ([f"{RC}rollout_rs=token_k1", f"{RC}rollout_rs_threshold='0.7_1.4'"], "token-mean",
     {"use_remove_padding": True}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=1.25",
      f"{RC}rollout_rs='token_k2,token_k3'", f"{RC}rollout_rs_threshold='0.02,0.03'"], "seq-mean-token-mean",
     {"use_remove_padding": False, "micro_batch_size_per_gpu": 3}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=null", f"{RC}rollout_rs=token_k3", f"{RC}rollout_rs_threshold=0.03"],
     "seq-mean-token-sum-norm", {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ([f"{RC}rollout_rs=token_k1", f"{RC}rollout_rs_threshold=1.3"], "token-sum", {"use_remove_padding": False}),
    # reinforce with the weights of this pass's log-probs: current_is (verl's bypass_pg_is: sequence, 2.0)
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=sequence"], "seq-mean-token-mean", {"use_remove_padding": True}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=sequence", f"{RC}rollout_is_threshold='0.5_1.5'"], "token-mean",
     {"use_remove_padding": False, "micro_batch_size_per_gpu": 3}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_threshold='0.8_1.3'",
      f"{RC}rollout_rs=token_k1", f"{RC}rollout_rs_threshold='0.85_1.15'"], "seq-mean-token-sum",
     {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=0.9"], "token-sum",
     {"use_remove_padding": False}),
    # sequence-level rejection sampling (a sequence rejected whole), chained with token options
    ([f"{RC}rollout_rs='token_k1,seq_mean_k3'", f"{RC}rollout_rs_threshold='0.7_1.4,0.05'"], "seq-mean-token-mean",
     {"use_remove_padding": True}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=sequence", f"{RC}rollout_rs='seq_sum_k1,seq_max_k2'",
      f"{RC}rollout_rs_threshold='0.5_2.0,0.25'"], "token-mean", {"use_remove_padding": False}),
]


@pytest.mark.parametrize("rc, agg, engine", BYPASS, ids=[f"{c[1]}-{i}" for i, c in enumerate(BYPASS)])
def test_bypass_mode_matches_verl_update(actor, rc, agg, engine):
    """bypass_mode's fused mappings (bypass.py: ppo_clip -> vanilla, reinforce -> gpg, reinforce with token TIS
    -> cispo, reinforce with sequence / IcePop / below-1 weights -> gpg with current_is; rollout_rs, token and
    sequence options -> the rejection mask) against verl's own compute_policy_loss_bypass_mode, every
    rollout_corr metric included."""
    i = BYPASS.index((rc, agg, engine))
    gen = torch.Generator().manual_seed(60 + i)
    tensors, meta = ve.rollout_batch(gen, actor.model_dir, is_weights=True)
    overrides = [f"{P}policy_loss.loss_mode=bypass_mode", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02", f"{P}loss_scale_factor=5" if i == 1 else
                 f"{P}clip_ratio=0.2", *rc]
    want = run(actor, tensors, meta, overrides, fused=False, engine=engine)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(actor, got, want)
    assert any(k.startswith("rollout_corr/") for k in want[0]), sorted(want[0])
    text = " ".join(rc)
    if "reinforce" in text and "rollout_is=token" in text and "_threshold=1." in text:
        # the truncation binds on some token (the weights' maximum before truncation is above the threshold)
        upper = 1.25 if "1.25" in text else 1.1
        assert max(want[0]["rollout_corr/rollout_is_max"]) >= upper - 1e-6, sorted(want[0])
    if "reinforce" in text and "rollout_is_threshold='" in text:
        # IcePop zeroes some weights and keeps others
        oob = want[0]["rollout_corr/rollout_is_oob_ratio"]
        assert max(oob) > 0 and min(oob) < 1, oob
    if "rollout_rs=" in " ".join(rc):
        # the mask rejects some tokens and keeps others
        rejected = want[0]["rollout_corr/rollout_rs_masked_fraction"]
        assert max(rejected) > 0 and min(rejected) < 1, rejected


FSDP1 = ["actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.fsdp_config.strategy=fsdp"]


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_fsdp1_strategy(tmp_path, tied):
    """Strategy fsdp (FSDP1, its flat parameters; built on CPU through verl_engine.cpu_fsdp1): the fused loss
    against verl's own update on the same FSDP1 engine, gspo (sequence-coupled) with a KL loss and an entropy
    bonus, packed micro-batches."""
    ve.save_tiny_qwen2(str(tmp_path), seed=5, tied=tied)
    actor = ve.Actor(str(tmp_path), ["actor_rollout_ref.model.use_fused_kernels=True", *FSDP1])
    assert type(actor.worker.engine.module).__name__ == "FullyShardedDataParallel"
    gen = torch.Generator().manual_seed(80 + tied)
    tensors, meta = ve.rollout_batch(gen, str(tmp_path), is_weights=True)
    overrides = [f"{P}policy_loss.loss_mode=gspo", f"{P}clip_ratio_low=0.02", f"{P}clip_ratio_high=0.03",
                 f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.02", *FSDP1]
    engine = {"use_remove_padding": True}
    want = run(actor, tensors, meta, overrides, fused=False, engine=engine)
    got = run(actor, tensors, meta, overrides, fused=True, strict=True, engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(actor, got, want)
    assert max(want[0]["actor/pg_clipfrac"]) > 0


def test_rejection_settings_read_as_verl_reads_them():
    """bypass.py reads rollout_rs as verl's compute_rollout_rejection_mask does (options stripped and deduplicated,
    one threshold shared or one each, token_k1's single threshold u the band [1 / u, u]); what it cannot fuse it
    names; a rejection mask without the mini-batch's counts is refused where verl would count kept tokens."""
    from logitless.verl.bypass import rejection_counts_missing, rejection_settings

    got, why = rejection_settings({"rollout_rs": " token_k1 ,token_k2,token_k1", "rollout_rs_threshold": "1.5"})
    assert why == "" and got == {"rejection_ratio_min": pytest.approx(1 / 1.5),
                                 "rejection_ratio_max": pytest.approx(1.5), "rejection_k2_max": 1.5}
    got, why = rejection_settings({"rollout_rs": "token_k3,token_k1", "rollout_rs_threshold": "0.1,0.5_2"})
    assert why == "" and got == {"rejection_k3_max": 0.1, "rejection_ratio_min": 0.5, "rejection_ratio_max": 2.0}
    assert rejection_settings({"rollout_rs": None}) == ({}, "")
    assert "rollout_rs_threshold=None" in rejection_settings({"rollout_rs": "token_k2"})[1]
    got, why = rejection_settings({"rollout_rs": "seq_sum_k1,seq_mean_k1,seq_max_k3,seq_mean_k2",
                                   "rollout_rs_threshold": "0.5_2,1.25,0.3,0.1"})
    assert why == "" and got == {"rejection_seq_ratio_min": 0.5, "rejection_seq_ratio_max": 2.0,
                                 "rejection_seq_mean_ratio_min": pytest.approx(0.8),
                                 "rejection_seq_mean_ratio_max": pytest.approx(1.25),
                                 "rejection_seq_max_k3_max": 0.3, "rejection_seq_mean_k2_max": 0.1}
    assert "not options verl knows" in rejection_settings({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0})[1]
    mask = {"rejection_k2_max": 0.1}
    assert rejection_counts_missing(mask, "token-mean", batch_num_tokens=None, global_batch_size=4) != ""
    assert rejection_counts_missing(mask, "seq-mean-token-mean", batch_num_tokens=30, global_batch_size=None) != ""
    assert rejection_counts_missing(mask, "token-sum", batch_num_tokens=None, global_batch_size=None) == ""
    assert rejection_counts_missing({}, "token-mean", batch_num_tokens=None, global_batch_size=None) == ""
