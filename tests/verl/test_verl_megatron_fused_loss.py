"""``logitless.verl.install(fused_loss=True)`` on verl 0.9.1's Megatron engine: ``TrainingWorker.train_mini_batch``
-> ``MegatronEngineWithLMHead`` (megatron-core 0.19.2, hook mode, TP 1 on a 1-rank gloo group, see
verl_megatron_engine.py), one optimizer step (SGD without momentum, so the step is the gradient itself) on the same
batch and from the same parameters as verl's own unfused Megatron path (``use_fused_kernels=False``: the model's
logits, verl's vocab-parallel log-softmax and entropy, ``verl.workers.utils.losses.ppo_loss``): parameters after
the step, every metric verl logs, and ``last_path()``."""
import logging

import pytest
import torch
import verl_engine as ve
from verl_engine import run

from required import import_or_skip

ve.stub_server_modules()
import_or_skip("megatron.core", "make setup installs megatron-core")
import_or_skip("mbridge", "make setup installs mbridge (the test extra)")
import_or_skip("verl.workers.engine.megatron", "make setup installs verl (--no-deps) and its import deps")

import verl_megatron_cp2_worker  # noqa: E402
import verl_megatron_engine as vme  # noqa: E402
import verl_megatron_pp2_worker  # noqa: E402
import verl_megatron_tp2_worker  # noqa: E402
from verl_megatron_engine import assert_same_update  # noqa: E402

import logitless.verl as lv  # noqa: E402
from logitless.verl import FusedPathUnavailable, fused_loss  # noqa: E402
from logitless.verl.megatron_loss import thd_rows  # noqa: E402
from logitless.verl.tokens import IGNORE, ResponseTokens  # noqa: E402

P = ve.P
RC = "+actor_rollout_ref.actor.policy_loss.rollout_correction."
THD = ["actor_rollout_ref.model.use_remove_padding=True"]


@pytest.fixture(scope="module")
def actors(model_dir):
    """(verl's unfused actor, an actor built with verl's fused kernels): the same weights (loaded from the
    same checkpoint by mbridge), THD (remove-padding) micro-batches."""
    plain = vme.Actor(model_dir, THD)
    fused = vme.Actor(model_dir, [*THD, "actor_rollout_ref.model.use_fused_kernels=True"])
    assert fused.worker.engine.engine_config.use_fused_kernels
    return plain, fused


pytestmark = pytest.mark.usefixtures("megatron_state", "uninstalled")      # tests/verl/conftest.py


def fused_matches(actors, tensors, meta, overrides, *, calculate_entropy=True, engine=None):
    plain, fused = actors
    want = run(plain, tensors, meta, overrides, fused=False, calculate_entropy=calculate_entropy, engine=engine)
    got = run(fused, tensors, meta, overrides, fused=True, strict=True, calculate_entropy=calculate_entropy,
              engine=engine)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("hook", "verl.policy_loss", ""), rec
    assert rec.backend in ("chunked", "triton")
    assert_same_update(plain.initial, got, want)
    return want


# (loss_agg_mode, actor settings, engine settings): vanilla under each aggregation, dual clip active
# (clip_ratio_c 1.2), entropy bonus of either sign or none, fixed and dynamic micro-batch sizes
CASES = [
    ("token-mean", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=low_var_kl", f"{P}entropy_coeff=0.01"], {}),
    ("token-sum", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=mse", f"{P}clip_ratio_c=1.2"],
     {"micro_batch_size_per_gpu": 3}),
    ("seq-mean-token-mean", [f"{P}use_kl_loss=True", f"{P}kl_loss_type=kl", f"{P}entropy_coeff=-0.02",
                             f"{P}clip_ratio_high=0.28"],
     {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ("seq-mean-token-sum", [f"{P}entropy_coeff=0.01"], {}),
    ("seq-mean-token-sum-norm", [f"{P}loss_scale_factor=5"], {"micro_batch_size_per_gpu": 3}),
]


@pytest.mark.parametrize("agg, settings, engine", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_fused_loss_matches_verl_megatron_update(actors, agg, settings, engine):
    gen = torch.Generator().manual_seed(7 + len(settings))
    tensors, meta = ve.rollout_batch(gen, actors[0].model_dir)
    entropy = any("entropy_coeff" in s for s in settings)
    want = fused_matches(actors, tensors, meta, [f"{P}loss_agg_mode={agg}", *settings], calculate_entropy=entropy,
                         engine=engine)
    if any("clip_ratio_c=1.2" in s for s in settings):
        assert max(want[0]["actor/pg_clipfrac_lower"]) > 0, "dual clip never active: the case tests nothing"


FUSED_MODES = ve.FUSED_MODES


@pytest.mark.parametrize("mode", sorted(FUSED_MODES))
def test_every_mode_matches_verl_megatron_update(actors, mode):
    """Each fused loss mode, with a KL loss, an entropy bonus and (every other mode) verl's rollout_is_weights,
    against verl's Megatron update; the modes cycle through the aggregations and the KL estimators."""
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from logitless.verl import megatron_loss, policy
    assert set(POLICY_LOSS_REGISTRY) == set(FUSED_MODES) | {"geo_mean"} | set(policy.PARTLY_FUSED)
    assert set(megatron_loss.MODES) == set(POLICY_LOSS_REGISTRY)
    i = sorted(FUSED_MODES).index(mode)
    gen = torch.Generator().manual_seed(20 + i)
    tensors, meta = ve.rollout_batch(gen, actors[0].model_dir, is_weights=i % 2 == 0, greedy=mode.startswith("dppo"))
    agg = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "token-sum", "seq-mean-token-sum-norm"][i % 5]
    kl = ["low_var_kl", "mse", "kl", "abs", "low_var_kl+"][(i + i // 5) % 5]
    overrides = [f"{P}policy_loss.loss_mode={mode}", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_type={kl}", f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02", *FUSED_MODES[mode]]
    want = fused_matches(actors, tensors, meta, overrides)
    if mode in ("vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "clip_cov"):
        assert max(want[0]["actor/pg_clipfrac"]) > 0, "no clip event: the case does not test the clipping"


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_sapo_terms_aggregated_apart_match_verl_megatron_update(actors, agg):
    """sapo with a KL loss and an entropy bonus under loss_agg_mode other than seq-mean-token-mean (verl: the policy
    term by seq-mean-token-mean, the others by loss_agg_mode; fused: kl_agg / entropy_agg), fixed and dynamic
    micro-batch sizes."""
    gen = torch.Generator().manual_seed(70 + len(agg))
    tensors, meta = ve.rollout_batch(gen, actors[0].model_dir, is_weights=True)
    overrides = [f"{P}policy_loss.loss_mode=sapo", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_type=low_var_kl", f"{P}kl_loss_coef=0.2", f"{P}entropy_coeff=0.03",
                 *FUSED_MODES["sapo"]]
    engine = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30} if agg == "token-mean" else None
    fused_matches(actors, tensors, meta, overrides, engine=engine)


AGGS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm", "seq-mean-token-mean"])
def test_geo_mean_matches_verl_megatron_update(actors, agg):
    """verl's geo_mean (a plain mean over the micro-batch's sequences of per-sequence losses; the KL loss and the
    entropy bonus by loss_agg_mode over the mini-batch), with rollout_is_weights, fixed and dynamic micro-batch
    sizes."""
    i = AGGS.index(agg)
    gen = torch.Generator().manual_seed(40 + i)
    tensors, meta = ve.rollout_batch(gen, actors[0].model_dir, is_weights=i % 2 == 0)
    overrides = [f"{P}policy_loss.loss_mode=geo_mean", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_type=low_var_kl", f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02",
                 f"{P}clip_ratio_low=0.1", f"{P}clip_ratio_high=0.15", f"{P}loss_scale_factor=5"]
    engine = {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30} if i == 4 else {"micro_batch_size_per_gpu": 3}
    want = fused_matches(actors, tensors, meta, overrides, engine=engine)
    assert max(want[0]["actor/pg_clipfrac"]) + max(want[0]["actor/pg_clipfrac_lower"]) > 0, \
        "no clipped log-ratio: the case does not test the clipping"


# bypass_mode's fused mappings (ppo_clip -> vanilla, reinforce -> gpg, reinforce with token TIS -> cispo, with
# sequence IS -> gpg with current_is; rollout_rs -> the rejection mask), each with a KL loss, an entropy
# bonus and the batch's rollout_is_weights (which bypass_mode ignores)
BYPASS = [
    ([], "token-mean", {}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=null"], "seq-mean-token-mean", {"micro_batch_size_per_gpu": 3}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=token", f"{RC}rollout_is_threshold=1.25"], "token-sum",
     {"use_dynamic_bsz": True, "max_token_len_per_gpu": 30}),
    ([f"{RC}loss_type=reinforce", f"{RC}rollout_is=sequence", f"{RC}rollout_rs='token_k1,token_k3,seq_max_k2'",
      f"{RC}rollout_rs_threshold='0.7_1.4,0.03,0.1'"], "seq-mean-token-mean", {}),
]


@pytest.mark.parametrize("rc, agg, engine", BYPASS, ids=[f"{c[1]}-{i}" for i, c in enumerate(BYPASS)])
def test_bypass_mode_matches_verl_megatron_update(actors, rc, agg, engine):
    """bypass_mode against verl's own compute_policy_loss_bypass_mode on the Megatron engine, every rollout_corr
    metric included."""
    i = BYPASS.index((rc, agg, engine))
    gen = torch.Generator().manual_seed(60 + i)
    tensors, meta = ve.rollout_batch(gen, actors[0].model_dir, is_weights=True)
    overrides = [f"{P}policy_loss.loss_mode=bypass_mode", f"{P}loss_agg_mode={agg}", f"{P}use_kl_loss=True",
                 f"{P}kl_loss_coef=0.1", f"{P}entropy_coeff=0.02", f"{P}clip_ratio=0.2", *rc]
    want = fused_matches(actors, tensors, meta, overrides, engine=engine)
    assert any(k.startswith("rollout_corr/") for k in want[0]), sorted(want[0])
    if "rollout_is_threshold=1.25" in " ".join(rc):
        assert max(want[0]["rollout_corr/rollout_is_max"]) >= 1.25 - 1e-6, "the truncation never binds"
    if "rollout_rs=" in " ".join(rc):
        rejected = want[0]["rollout_corr/rollout_rs_masked_fraction"]
        assert max(rejected) > 0 and min(rejected) < 1, rejected


def test_matches_verl_padded_bshd_update(model_dir, actors):
    """Against verl's unfused Megatron update on padded (BSHD, use_remove_padding=False) micro-batches, an actor
    built apart (verl's fused kernels need THD)."""
    bshd = vme.Actor(model_dir, ["actor_rollout_ref.model.use_remove_padding=False"])
    gen = torch.Generator().manual_seed(11)
    tensors, meta = ve.rollout_batch(gen, model_dir)
    overrides = [f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01", f"{P}loss_agg_mode=seq-mean-token-mean"]
    want = run(bshd, tensors, meta, overrides, fused=False)
    got = run(actors[1], tensors, meta, overrides, fused=True, strict=True)
    assert lv.last_path().path == "hook"
    assert_same_update(bshd.initial, got, want)


def test_untied_head_and_compute_log_prob(tmp_path):
    """An untied output layer (the processor's output_weight is None: output_layer.weight), and verl's
    compute_log_prob (forward only, verl's loss function set) passing through the installed fused loss: its
    log-probs and entropies equal verl's unfused actor's."""
    ve.save_tiny_qwen2(str(tmp_path), seed=4, tied=False)
    plain = vme.Actor(str(tmp_path), THD)
    fused = vme.Actor(str(tmp_path), [*THD, "actor_rollout_ref.model.use_fused_kernels=True"])
    assert not fused.worker.engine.share_embeddings_and_output_weights
    assert any("output_layer" in n for n in fused.initial)
    gen = torch.Generator().manual_seed(13)
    tensors, meta = ve.rollout_batch(gen, str(tmp_path))
    overrides = [f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01", f"{P}loss_agg_mode=seq-mean-token-sum"]
    want = run(plain, tensors, meta, overrides, fused=False)
    got = run(fused, tensors, meta, overrides, fused=True, strict=True)
    assert lv.last_path().path == "hook" and lv.last_path().entry == "verl.policy_loss"
    assert_same_update(plain.initial, got, want)
    lp_want, ent_want = plain.infer(tensors, meta, overrides)
    lv.install(fused_loss=True, strict=True)
    lp, ent = fused.infer(tensors, meta, overrides)
    assert lv.last_path().entry == "verl"            # verl's fused head on logitless, no policy loss
    assert float((lp - lp_want).abs().max()) <= 2e-5 and float((ent - ent_want).abs().max()) <= 2e-5
    assert lp.abs().sum() > 0


@pytest.mark.parametrize("setting, named", [
    ([f"{P}policy_loss.loss_mode=bypass_mode", f"{RC}loss_type=reinforce", f"{RC}rollout_is=token",
      f"{RC}rollout_is_batch_normalize=True"], "rollout_correction.rollout_is_batch_normalize=True"),
])
def test_unfusable_setting_falls_back_recorded(actors, caplog, setting, named):
    """A setting the fused loss cannot reproduce: verl's own loss runs on the Megatron engine (the same update
    as verl's unfused actor), recorded and logged once; under strict mode FusedPathUnavailable names it."""
    plain, fused = actors
    gen = torch.Generator().manual_seed(5)
    tensors, meta = ve.rollout_batch(gen, plain.model_dir)
    with pytest.raises(FusedPathUnavailable, match=named.replace("(", r"\(")):
        run(fused, tensors, meta, setting, fused=True, strict=True)
    want = run(plain, tensors, meta, setting, fused=False)
    fused_loss._logged.clear()          # "logged once" counts from here
    with caplog.at_level(logging.WARNING, logger="logitless.verl"):
        got = run(fused, tensors, meta, setting, fused=True)
        run(fused, tensors, meta, setting, fused=True)
    rec = lv.last_path()
    assert rec.path == "unfused" and rec.entry == "verl.policy_loss" and named in rec.reason
    assert len([r for r in caplog.records if named in r.getMessage()]) == 1
    assert_same_update(plain.initial, got, want)


@pytest.mark.parametrize("setting, named", [
    ("legacy", "legacy fused forward"),
])
def test_megatron_settings_not_wired_are_refused_under_strict(actors, setting, named):
    """Megatron settings the fused loss is not wired to, read from the engine's config (pipeline parallelism,
    set to 2 on the built engine) or the model (verl's legacy fused-forward mode on a release with the hook,
    which logitless' legacy patch does not serve; on megatron-core < 0.18 it does, see
    verl_megatron_legacy_suite.py): strict mode raises before the model runs, naming the setting."""
    from verl.utils.megatron_utils import unwrap_model
    plain, fused = actors
    gen = torch.Generator().manual_seed(6)
    tensors, meta = ve.rollout_batch(gen, plain.model_dir)
    cfg = fused.worker.engine.engine_config
    model = unwrap_model(fused.worker.engine.module[0])
    saved = (cfg.pipeline_model_parallel_size, model._verl_fused_forward_mode)
    if setting == "legacy":
        model._verl_fused_forward_mode = "legacy"
    else:
        object.__setattr__(cfg, setting, 2)
    try:
        with pytest.raises(FusedPathUnavailable, match=named):
            run(fused, tensors, meta, [], fused=True, strict=True)
    finally:
        object.__setattr__(cfg, "pipeline_model_parallel_size", saved[0])
        model._verl_fused_forward_mode = saved[1]
    assert lv.last_path().path == "unfused" and named in lv.last_path().reason


def test_truncation_refused_at_first_training_micro_batch(actors):
    """install(fused_loss=True, truncation=True): the Megatron engine's processor does not take the rollout's
    truncation, so a training micro-batch under a truncated worker call is a ValueError naming the engine, before
    the model runs (strict or not; the parameters unchanged); the forward-only log-probs still run, truncated."""
    from logitless import Truncation
    from logitless.verl import truncation as vt
    plain, fused = actors
    gen = torch.Generator().manual_seed(8)
    tensors, meta = ve.rollout_batch(gen, plain.model_dir)
    lv.install(fused_loss=True, truncation=True)
    lp_full, _ = fused.infer(tensors, meta)        # no truncated worker call: the full softmax
    with vt.applied(Truncation(top_k=5, top_p=0.9)):
        with pytest.raises(ValueError, match="Megatron engine: the fused policy loss does not take the rollout's"):
            fused.update(tensors, meta, calculate_entropy=True, mini_batch_size=6)
        for n, p in fused.params().items():
            assert torch.equal(p, fused.initial[n]), n
        lp, _ = fused.infer(tensors, meta)
    assert float((lp - lp_full).abs().max()) > 1e-2          # truncated: not the full softmax's
    assert vt.current() is None


def test_thd_rows_follow_verl_padded_layout():
    """The response tokens laid out in verl's THD rows when each sequence is padded (TP > 1 pads every
    sequence to a multiple of the TP size) and the tail too: checked position by position."""
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 3, 6]
    offsets = torch.tensor([0, 5, 8, 14])
    total = 14
    scored = torch.rand(total, generator=gen) > 0.4
    adv, old = torch.randn(total, generator=gen), -torch.rand(total, generator=gen)
    tokens = ResponseTokens(scored=scored, advantages=adv * scored, old_logprobs=old * scored, ref_logprobs=None,
                            rollout_weights=None, offsets=offsets, count=int(scored.sum()), sequences=3, width=4)
    cu_padded = torch.tensor([0, 6, 10, 16], dtype=torch.int32)      # each sequence to a multiple of 2
    n = 18                                                            # and 2 rows of tail padding
    labels = torch.randint(0, 50, (1, n), generator=gen)
    rows = thd_rows(tokens, labels, cu_padded)
    assert rows.cu_seqlens.tolist() == [0, 6, 10, 16, 18]
    expect_labels = torch.full((n,), IGNORE)
    expect_adv = torch.zeros(n)
    for i, length in enumerate(lengths):
        for j in range(length):
            p, r = int(offsets[i]) + j, int(cu_padded[i]) + j
            if scored[p]:
                expect_labels[r] = labels[0, r]
            expect_adv[r] = adv[p] * scored[p]
    assert torch.equal(rows.labels, expect_labels) and torch.equal(rows.advantages, expect_adv)
    with pytest.raises(ValueError, match="less room"):
        thd_rows(tokens, labels[:, :12], torch.tensor([0, 5, 8, 12]))


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    """TP 2 over two spawned gloo ranks (verl_megatron_tp2_worker.py), every case in one spawn."""
    from ranks import spawn
    tmp = tmp_path_factory.mktemp("verl_megatron_tp2")
    return spawn(verl_megatron_tp2_worker.run, (str(tmp / "store"), str(tmp), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", verl_megatron_tp2_worker.CASES)
def test_tensor_parallel_two_ranks(tp2_results, case):
    """verl's unfused Megatron actor against the fused loss at TP 2, with sequence parallelism (mbridge's default at
    TP > 1) and without, a token-mean and a sequence-level (gspo, seq-mean-token-mean) loss, and geo_mean under SP;
    verl's distillation (test_verl_megatron_distillation.py at TP 1): forward_kl_topk with both clamps (SP and
    not), with task rewards (SP), k3 with task rewards: every rank's parameter shards after the step, rank 0's
    metrics."""
    from ranks import check
    check(tp2_results, case)


@pytest.fixture(scope="module")
def cp2_results(tmp_path_factory):
    """Context parallelism 2 over two spawned gloo ranks (verl_megatron_cp2_worker.py), every case in one spawn."""
    from ranks import spawn
    tmp = tmp_path_factory.mktemp("verl_megatron_cp2")
    return spawn(verl_megatron_cp2_worker.run, (str(tmp / "store"), str(tmp), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", verl_megatron_cp2_worker.CASES)
def test_context_parallel_two_ranks(cp2_results, case):
    """verl's unfused Megatron actor against the fused loss at CP 2 (verl's zigzag split; each rank's fused loss
    on its own rows with the whole micro-batch's normalisation): token-local modes (vanilla, cispo, dppo_tv, gpg)
    under token-mean, token-sum, seq-mean-token-sum(-norm), fixed and dynamic micro-batch sizes; gspo and
    seq-mean-token-mean refused by name under strict mode and run by verl (recorded) otherwise; verl's distillation:
    forward_kl_topk with both clamps, with task rewards (dynamic micro-batch sizes, rollout_is_weights), k3 with
    task rewards. Every rank's parameters after the step, rank 0's metrics."""
    from ranks import check
    check(cp2_results, case)


def test_cp_local_positions_follow_verl_zigzag():
    """Each CP rank's rows of verl's zigzag split (chunks r and 2cp-1-r of every padded sequence) against
    mcore_env's independent statement of it; a sequence not split in 2 * cp equal chunks is refused."""
    import mcore_env
    from logitless.verl import megatron_cp
    cu = torch.tensor([0, 8, 12, 28], dtype=torch.int32)
    for rank in range(2):
        got = megatron_cp.local_positions(cu, 2, rank)
        assert torch.equal(got, mcore_env._zigzag_positions(cu.tolist(), 2, rank)), rank
    cu3 = torch.tensor([0, 6, 18], dtype=torch.int32)
    assert torch.equal(torch.cat([megatron_cp.local_positions(cu3, 3, r) for r in range(3)]).sort().values,
                       torch.arange(18))
    with pytest.raises(ValueError, match="equal chunks"):
        megatron_cp.local_positions(torch.tensor([0, 6]), 2, 0)


def test_cp_refusals_name_the_setting():
    """Under context parallelism the fused loss runs token-local losses with fixed per-token weights only; the
    others, and CP with TP > 1, are named."""
    from logitless.verl import megatron_cp
    ok = {"surrogate": "ppo", "loss_agg": "token-sum"}
    assert megatron_cp.refusals(ok, False, mode="vanilla", agg="token-mean", tensor_parallel=1) == []
    cases = [
        (dict(ok, ratio_level="sequence-token"), False, "gspo", "token-mean", 1, "loss_mode='gspo'"),
        ({"surrogate": "geo_mean", "loss_agg": "token-sum"}, True, "geo_mean", "token-mean", 1, "'geo_mean'"),
        ({"surrogate": "clip_cov", "loss_agg": "token-sum"}, False, "clip_cov", "token-sum", 1, "'clip_cov'"),
        (dict(ok, loss_agg="seq-mean-token-mean"), False, "vanilla", "seq-mean-token-mean", 1,
         "loss_agg_mode='seq-mean-token-mean'"),
        (ok, False, "vanilla", "token-mean", 2, "tensor_model_parallel_size=2"),
        # bypass_mode's mappings that weigh or reject whole sequences by this pass's log-probs
        ({"surrogate": "gpg", "loss_agg": "token-sum", "current_is": "sequence_truncate", "current_is_max": 2.0},
         False, "bypass_mode", "token-mean", 1, "'bypass_mode'"),
        (dict(ok, rejection_seq_ratio_min=0.5, rejection_seq_ratio_max=2.0), False, "bypass_mode", "token-mean", 1,
         "'bypass_mode'"),
    ]
    for settings, mbm, mode, agg, tp, named in cases:
        bad = megatron_cp.refusals(settings, mbm, mode=mode, agg=agg, tensor_parallel=tp)
        assert len(bad) == 1 and named in bad[0] and "context parallelism" in bad[0], bad


@pytest.fixture(scope="module")
def pp2_results(tmp_path_factory):
    """Pipeline parallelism 2 over two spawned gloo ranks (verl_megatron_pp2_worker.py), every case in one spawn."""
    from ranks import spawn
    tmp = tmp_path_factory.mktemp("verl_megatron_pp2")
    return spawn(verl_megatron_pp2_worker.run, (str(tmp / "store"), str(tmp), str(tmp)), 2, tmp)


@pytest.mark.parametrize("case", verl_megatron_pp2_worker.CASES)
def test_pipeline_parallel_two_ranks(pp2_results, case):
    """verl's unfused Megatron actor against the fused loss at PP 2 (the output processor on the last stage), with
    and without 2 virtual stages per rank: vanilla token-mean (dual clip, KL loss, entropy bonus), gspo
    seq-mean-token-mean with dynamic micro-batch sizes, sapo seq-mean-token-sum (its terms aggregated apart); verl's
    forward_kl_topk distillation with task rewards (1F1B) and with both clamps (interleaved); every rank's
    parameters after the step, the last stage's metrics."""
    from ranks import check
    check(pp2_results, case)
