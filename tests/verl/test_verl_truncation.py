"""``logitless.verl.install(truncation=True)``: the actor's log-probs under the rollout's top_k / top_p.

Against a float64 reference built from the logits of the same hidden states and head (vLLM's order: temperature,
top-k, then top-p over the survivors), through verl 0.9.1's real ``ActorRolloutRefWorker`` (roles "actor" and
"ref", built by its own ``init_model`` on CPU: verl_engine.py) and its FSDP engine, and on each fused head site
called directly; the config read from the worker's own rollout config; the refusals; install / uninstall.
"""
import types

import pytest
import torch

pytest.importorskip("verl")

import verl_engine as ve  # noqa: E402

import logitless.verl as lv  # noqa: E402
from logitless import Truncation  # noqa: E402
from logitless.verl import truncation as vt  # noqa: E402
from truncation64 import truth64  # noqa: E402

R = "actor_rollout_ref.rollout."
ROLLOUT = [f"{R}name=vllm", f"{R}top_k=5", f"{R}top_p=0.9", f"{R}log_prob_micro_batch_size_per_gpu=2",
           "actor_rollout_ref.model.use_fused_kernels=True",
           "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch"]


def truncated64(z, labels, top_k, top_p):
    """float64 (log-prob of the label, entropy, kept count) under vLLM's truncation of logits ``z`` [N, V] (already
    over the temperature), from the suite's one reference (truncation64.py)."""
    t64 = truth64(z.double(), torch.eye(z.shape[-1], dtype=torch.float64), labels, top_k=top_k, top_p=top_p)
    return t64.logprobs, t64.entropy, t64.kept_count


# --- the heads, called directly ----------------------------------------------------------------------------------

@pytest.fixture
def installed():
    ve.setup()
    lv.uninstall()
    lv.install(truncation=True)
    yield
    lv.uninstall()


@pytest.mark.parametrize("site", ["fsdp", "kernel", "megatron"])
def test_heads_under_truncation_match_float64(installed, site):
    """Each fused head site verl calls, inside a truncated call, gives the truncated log-probs and entropies
    (V 4099, H 96, 7 tokens, temperature 0.7), with gradients to hidden and weight; outside it the plain ones."""
    import importlib
    gen = torch.Generator().manual_seed(11)
    spread = torch.tensor([0.2, 0.3, 0.5, 1.0, 1.5, 2.0, 3.0])[:, None]    # flat rows to peaked ones
    hidden = (torch.randn(7, 96, generator=gen) * spread).requires_grad_()
    weight = (torch.randn(4099, 96, generator=gen) * 0.2).requires_grad_()
    labels = torch.randint(0, 4099, (7,), generator=gen)
    t, k, p = 0.7, 40, 0.99
    z = (hidden.detach().double() @ weight.detach().double().T) / t
    want_lp, want_ent, kept = truncated64(z, labels, k, p)
    assert bool((kept == k).any()) and bool((kept < k).any()), "top_k binds on some tokens, top_p on others"
    if site == "fsdp":
        head = importlib.import_module("verl.utils.experimental.torch_functional").FusedLinearForPPO()
        call = lambda: head.forward(hidden, weight, labels, temperature=t)  # noqa: E731
    else:
        mod = "verl.utils.kernel.linear_cross_entropy" if site == "kernel" else "verl.models.mcore.model_forward_fused"
        fn = importlib.import_module(mod).linear_cross_entropy
        call = lambda: fn(hidden, weight, labels, t)  # noqa: E731
    with vt.applied(Truncation(top_k=k, top_p=p)):
        lp, ent = call()
    assert float((lp.double() - want_lp).abs().max()) <= 2e-5
    assert float((ent.double() - want_ent).abs().max()) <= 2e-5
    (lp.sum() + ent.sum()).backward()
    assert hidden.grad is not None and weight.grad is not None and float(hidden.grad.abs().max()) > 0
    plain_lp, _ = call()          # no truncated call running: the full softmax
    full = z.log_softmax(-1).gather(-1, labels[:, None])[:, 0]
    assert float((plain_lp.double() - full).abs().max()) <= 2e-5
    assert float((want_lp - full).min()) > 1e-3       # the truncation moves every token's log-prob past the bound


# --- through verl's ActorRolloutRefWorker -------------------------------------------------------------------------

class Workers:
    """verl's ActorRolloutRefWorker with role "actor", built by its own init_model on the rollout config
    ``ROLLOUT`` (no rollout engine: role "actor_rollout_ref" would start vLLM). Its ``ref`` is its actor's
    TrainingWorker (the same initial weights), which compute_ref_log_prob calls: verl's reference engine cannot
    be built on CPU (FSDP2 with CPUOffloadPolicy(pin_memory=True), forced for forward-only engines, pins memory,
    which needs an accelerator)."""

    def __init__(self, model_dir):
        ve.setup()
        from verl.workers.engine_workers import ActorRolloutRefWorker

        from transformers import Qwen2ForCausalLM
        plain = Qwen2ForCausalLM.forward
        try:
            self.cfg = ve.compose(model_dir, ROLLOUT)
            self.actor = ActorRolloutRefWorker(self.cfg.actor_rollout_ref, role="actor")
            self.actor.init_model()
            self.actor.ref = self.actor.actor
            self.ref = self.actor
            self.forward = Qwen2ForCausalLM.forward          # verl's fused forward (its class patch)
        finally:
            Qwen2ForCausalLM.forward = plain

    def call(self, method, data):
        from transformers import Qwen2ForCausalLM
        plain = Qwen2ForCausalLM.forward
        Qwen2ForCausalLM.forward = self.forward
        try:
            return method(data)
        finally:
            Qwen2ForCausalLM.forward = plain


@pytest.fixture(scope="module")
def workers(model_dir):
    return Workers(model_dir)


@pytest.fixture(scope="module")
def batch(model_dir):
    gen = torch.Generator().manual_seed(7)
    tensors, meta = ve.rollout_batch(gen, model_dir, temperature=0.8)
    return tensors, meta


def infer_input(tensors, meta, **extra):
    from verl.utils import tensordict_utils as tu
    data = ve.to_actor_input(tensors, meta, calculate_entropy=True, mini_batch_size=len(tensors["input_ids"]))
    tu.assign_non_tensor(data, compute_loss=False, **extra)
    return data


def reference(model_dir, tensors, temperature, top_k, top_p):
    """float64 log-probs and entropies of every token (its next one as label) but each sequence's last, as verl's
    compute_log_prob lays them out (no-padding: the attended tokens in order), from the model's logits."""
    from transformers import Qwen2ForCausalLM
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    mask = tensors["attention_mask"].bool()
    with torch.no_grad():
        hidden = model.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                             position_ids=tensors["position_ids"]).last_hidden_state
        z = (hidden.double() @ model.lm_head.weight.double().T) / temperature
    lps, ents, full = [], [], []
    for i in range(len(z)):
        rows = z[i][mask[i]][:-1]
        labels = tensors["input_ids"][i][mask[i]][1:]
        lp, ent, _ = truncated64(rows, labels, top_k, top_p) if top_k or top_p < 1 else (None, None, None)
        lps.append(lp)
        ents.append(ent)
        full.append(rows.log_softmax(-1).gather(-1, labels[:, None])[:, 0])
    cat = (lambda xs: torch.cat(xs) if xs[0] is not None else None)  # noqa: E731
    return cat(lps), cat(ents), torch.cat(full)


def scored(out):
    """verl's nested per-token output without each sequence's last position (no label)."""
    values, offsets = out.values(), out.offsets()
    keep = torch.ones(int(offsets[-1]), dtype=torch.bool)
    keep[offsets[1:] - 1] = False
    return values[keep].double()


def test_old_and_ref_logprobs_are_the_rollouts_truncated_ones(workers, batch, model_dir, uninstalled):
    """compute_log_prob (old log-probs) and compute_ref_log_prob through verl's workers and FSDP engine equal the
    float64 truncated reference at the rollout config's top_k 5 / top_p 0.9; without the switch, the full
    softmax's; and a change of the worker's config reaches the next call."""
    tensors, meta = batch
    t = meta["temperature"]
    want_lp, want_ent, full = reference(model_dir, tensors, t, 5, 0.9)
    assert float((want_lp - full).mean()) > 1e-3        # the truncated log-probs are not the full softmax's
    lv.install()
    out = workers.call(workers.actor.compute_log_prob, infer_input(tensors, meta))
    assert float((scored(out["log_probs"]) - full).abs().max()) <= 2e-5
    lv.install(truncation=True)
    assert lv.sites()["worker.update_actor"].startswith("installed")
    for worker, method in ((workers.actor, "compute_log_prob"), (workers.ref, "compute_ref_log_prob")):
        out = workers.call(getattr(worker, method), infer_input(tensors, meta))
        assert float((scored(out["log_probs"]) - want_lp).abs().max()) <= 2e-5, method
        assert float((scored(out["entropy"]) - want_ent).abs().max()) <= 2e-5, method
        assert vt.current() is None
    with_top_p_only = reference(model_dir, tensors, t, 0, 0.7)[0]
    workers.actor.config.rollout.top_k, workers.actor.config.rollout.top_p = -1, 0.7
    try:
        out = workers.call(workers.actor.compute_log_prob, infer_input(tensors, meta))
    finally:
        workers.actor.config.rollout.top_k, workers.actor.config.rollout.top_p = 5, 0.9
    assert float((scored(out["log_probs"]) - with_top_p_only).abs().max()) <= 2e-5


def test_update_scores_current_logprobs_truncated(workers, batch, model_dir, uninstalled):
    """update_actor: with old log-probs the truncated reference's (the parameters of the step's start), verl's
    ppo_kl (mean of old - current over the scored tokens) is 0 under the switch; without it, positive (verl
    averages it per micro-batch: the truncated-minus-full gap, the kept mass's -log, of each)."""
    from verl.utils import tensordict_utils as tu
    tensors, meta = batch
    t = meta["temperature"]
    b, r = tensors["responses"].shape
    mask = tensors["attention_mask"].bool()
    want_lp, _, full = reference(model_dir, tensors, t, 5, 0.9)
    # the response tokens' entries of the reference (each sequence: its last r - 1 scored positions + padding)
    old = torch.zeros(b, r, dtype=torch.float64)
    old_full = torch.zeros(b, r, dtype=torch.float64)
    start = 0
    for i in range(b):
        n = int(mask[i].sum()) - 1
        resp = int(mask[i, -r:].sum())
        old[i, :resp] = want_lp[start + n - resp:start + n]
        old_full[i, :resp] = full[start + n - resp:start + n]
        start += n
    tensors = dict(tensors, old_log_probs=old.float())
    rmask = tensors["response_mask"].bool()
    gap = float(((old - old_full)[rmask]).mean())
    assert gap > 1e-3
    from functools import partial

    from verl.workers.utils.losses import ppo_loss
    results = {}
    for trunc in (True, False):
        lv.install(truncation=trunc)
        state = [p.detach().clone() for p in workers.actor.actor.engine.module.parameters()]
        workers.actor.actor.set_loss_fn(partial(ppo_loss, config=workers.actor.loss_fn.keywords["config"]))
        data = ve.to_actor_input(tensors, meta, calculate_entropy=True, mini_batch_size=b)
        tu.assign_non_tensor(data, use_dynamic_bsz=False)
        try:
            out = workers.call(workers.actor.update_actor, data)
        finally:
            with torch.no_grad():
                for p, p0 in zip(workers.actor.actor.engine.module.parameters(), state, strict=True):
                    p.copy_(p0)
        metrics = tu.get(out, "metrics")
        results[trunc] = metrics["actor/ppo_kl"]
    kl = lambda v: float(torch.as_tensor(v, dtype=torch.float64).mean())  # noqa: E731
    assert abs(kl(results[True])) <= 2e-5, results[True]
    assert kl(results[False]) > 1e-3, (results[False], gap)      # the full softmax's: old - current > 0


# (actor settings, engine settings): vanilla with the KL loss, the entropy bonus and dual clip on padded
# micro-batches; a sequence-coupled mode (gspo, sequence ratios) on packed (remove-padding) ones
FUSED_CASES = [
    ([f"{ve.P}use_kl_loss=True", f"{ve.P}kl_loss_type=low_var_kl", f"{ve.P}entropy_coeff=0.01",
      f"{ve.P}clip_ratio_c=1.2"], {"use_remove_padding": False}),
    ([f"{ve.P}policy_loss.loss_mode=gspo", f"{ve.P}loss_agg_mode=seq-mean-token-mean", f"{ve.P}clip_ratio_low=0.02",
      f"{ve.P}clip_ratio_high=0.03", f"{ve.P}use_kl_loss=True", f"{ve.P}kl_loss_type=kl"],
     {"use_remove_padding": True}),
]


def truncated_update(workers, model_dir, tensors, meta, overrides, engine, *, fused_loss, truncation=True):
    """verl's update_actor on the worker, under install(fused_loss=, truncation=), with verl's ppo_loss of the actor
    ``overrides``, from the worker's parameters at the module's start: (metrics, {name: parameter after the step})."""
    from verl.utils import tensordict_utils as tu
    engine_module = workers.actor.actor.engine.module
    state = [p.detach().clone() for p in engine_module.parameters()]
    default = workers.actor.loss_fn
    cfg, config = ve.actor_config(model_dir, ROLLOUT + list(overrides))
    ve.set_loss_fn(workers.actor.actor, cfg, config)
    lv.install(fused_loss=fused_loss, truncation=truncation, strict=fused_loss)
    torch.manual_seed(2024)
    data = ve.to_actor_input(tensors, meta, calculate_entropy=True, mini_batch_size=len(tensors["input_ids"]))
    tu.assign_non_tensor(data, use_dynamic_bsz=False, **engine)
    try:
        out = workers.call(workers.actor.update_actor, data)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                  for n, p in engine_module.named_parameters()}
    finally:
        lv.uninstall()
        workers.actor.actor.set_loss_fn(default)
        with torch.no_grad():
            for p, p0 in zip(engine_module.parameters(), state, strict=True):
                p.copy_(p0)
    return tu.get(out, "metrics"), params


@pytest.mark.parametrize("overrides, engine", FUSED_CASES, ids=["vanilla-padded", "gspo-packed"])
def test_fused_loss_under_truncation_matches_verl_loss(workers, model_dir, overrides, engine, uninstalled):
    """install(fused_loss=True, truncation=True) on verl's FSDP engine: update_actor gives the parameters, step and
    every metric of install(truncation=True) alone (verl's own ppo_loss on logitless' truncated log-probs), on the
    same batch from the same parameters; the fused run recorded as such. Without the truncation the fused update
    is another one (the comparison sees the truncation)."""
    from test_verl_fused_loss import STEP_TOL, assert_same_update
    gen = torch.Generator().manual_seed(17)
    tensors, meta = ve.rollout_batch(gen, model_dir)
    initial = types.SimpleNamespace(initial=[(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                             for p in workers.actor.actor.engine.module.parameters()])
    want = truncated_update(workers, model_dir, tensors, meta, overrides, engine, fused_loss=False)
    got = truncated_update(workers, model_dir, tensors, meta, overrides, engine, fused_loss=True)
    rec = lv.last_path()
    assert (rec.path, rec.entry, rec.reason) == ("fsdp", "verl.policy_loss", ""), rec
    assert_same_update(initial, got, want)
    if any("clip_ratio_c=1.2" in s for s in overrides):
        assert max(want[0]["actor/pg_clipfrac_lower"]) > 0, "dual clip never active: the case tests nothing"
    full = truncated_update(workers, model_dir, tensors, meta, overrides, engine, fused_loss=True, truncation=False)
    step = sum(float((p - q).square().sum()) for p, q in zip(want[1].values(), initial.initial, strict=True))
    apart = sum(float((full[1][n] - p).square().sum()) for n, p in want[1].items())
    assert apart > (10 * STEP_TOL) ** 2 * step, "the fused update without the truncation is the same one"


def test_unfused_micro_batch_refused(workers, batch, uninstalled):
    """A truncated call whose micro-batch would take verl's logits path: ValueError before the model runs
    (strict or not)."""
    tensors, meta = batch
    lv.install(truncation=True, strict=False)
    with pytest.raises(ValueError, match="use_fused_kernels=False"):
        workers.call(workers.actor.compute_log_prob, infer_input(tensors, meta, use_fused_kernels=False))
    assert vt.current() is None


def test_worker_config_refusals(workers, batch, uninstalled):
    """The worker's rollout config checked at each call: nothing truncated refused by name."""
    tensors, meta = batch
    lv.install(truncation=True)
    rollout = workers.actor.config.rollout
    rollout.top_k, rollout.top_p = 0, 1.0
    try:
        with pytest.raises(ValueError, match="truncates nothing"):
            workers.call(workers.actor.compute_log_prob, infer_input(tensors, meta))
    finally:
        rollout.top_k, rollout.top_p = 5, 0.9


# --- the config and the refusals -----------------------------------------------------------------------------------

def rollout_config(model_dir, *settings):
    return ve.compose(model_dir, ROLLOUT + list(settings)).actor_rollout_ref.rollout


def test_rollout_config_read(model_dir):
    """top_k / top_p from verl's own composed config (and its dataclass); HF's top_k 0 and vLLM's -1 are off."""
    from verl.utils.config import omega_conf_to_dataclass
    cfg = rollout_config(model_dir)
    got = vt.rollout_truncation(cfg)
    assert (got.top_k, got.top_p) == (5, 0.9)
    assert vt.rollout_truncation(omega_conf_to_dataclass(cfg)).top_k == 5
    for k in (0, -1):
        got = vt.rollout_truncation(rollout_config(model_dir, f"{R}top_k={k}", f"{R}top_p=0.8"))
        assert (got.top_k, got.top_p) == (-1, 0.8)
    got = vt.rollout_truncation(rollout_config(model_dir, f"{R}calculate_log_probs=True"))
    assert got.top_k == 5


@pytest.mark.parametrize("settings, named", [
    ([f"{R}top_k=-1", f"{R}top_p=1.0"], "truncates nothing"),
    ([f"{R}top_k=0", f"{R}top_p=1.0"], "truncates nothing"),
    ([f"{R}calculate_log_probs=True", f"{R}logprobs_mode=raw_logprobs"], "rollout.logprobs_mode='raw_logprobs'"),
    ([f"{R}name=sglang"], "rollout.name='sglang'"),
    ([f"{R}name=trtllm"], "rollout.name='trtllm'"),
    ([f"{R}top_k=-3"], "rollout.top_k=-3"),
    ([f"{R}top_p=1.5"], "rollout.top_p=1.5"),
])
def test_rollout_config_refused(model_dir, settings, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(".", r"\.")):
        vt.rollout_truncation(rollout_config(model_dir, *settings))


def test_install_refusals_and_restore(uninstalled):
    """A non-bool switch refused; install / uninstall put verl's worker methods
    back, with verl's dispatch registration kept on the replacements."""
    ve.setup()
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.workers.engine_workers import ActorRolloutRefWorker as W
    before = {name: vars(W)[name] for name in vt.METHODS}
    with pytest.raises(TypeError, match="truncation"):
        lv.install(truncation="yes")
    lv.install(truncation=True)
    for name in vt.METHODS:
        assert vars(W)[name] is not before[name]
        assert getattr(vars(W)[name], MAGIC_ATTR) == getattr(before[name], MAGIC_ATTR)
    lv.uninstall()
    assert {name: vars(W)[name] for name in vt.METHODS} == before


def test_a_truncated_forward_must_reach_the_head():
    """check_ran: a truncated micro-batch whose forward computed no truncated head is a ValueError; outside a
    truncated call nothing is checked."""
    with vt.applied(Truncation(top_k=3)):
        with pytest.raises(ValueError, match="did not reach logitless' fused head"):
            with vt.check_ran("a micro-batch"):
                pass
        with vt.check_ran("a micro-batch"):
            vt.note_head()
    with vt.check_ran("a micro-batch"):
        pass
