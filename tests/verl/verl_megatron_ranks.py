"""What the two-process checks on verl's Megatron engine share (verl_megatron_{tp2,cp2,pp2}_worker.py): one rank's
set-up (torch on one thread, the 2-rank gloo group and verl's CPU platform, the tiny Qwen2 saved once), its cases
run and recorded one by one, its results written for the parent test (tests/ranks.py), the (unfused, fused) actor
pairs, a case's batch (a rollout batch, or with the teacher's tensors for verl's distillation cases, shared here),
and one update with verl's loss or the fused one.

A worker's ``run(rank, init_file, tmp_dir, out_dir)``, spawned on two ranks by tests/ranks.py's ``spawn``, is::

    def run(rank, init_file, tmp_dir, out_dir):
        run_rank(rank, init_file, tmp_dir, out_dir, [(name, partial(check, ...)) for ...])

with ``check(r)`` given this rank's ``Rank``. Nothing here imports verl, Megatron or torch at module level: the
workers are imported by the parent test, and a rank sets its thread count before torch runs anything.
"""
from __future__ import annotations

import dataclasses
import os
import traceback

MINI_BATCH = 6            # the rollout batch's sequences: one mini-batch, one optimizer step
FUSED_KERNELS = "actor_rollout_ref.model.use_fused_kernels=True"
P = "actor_rollout_ref.actor."
DL = "distillation.distillation_loss."
# verl's distillation cases the layouts run (a case's loss as (mode, settings), Rank.batch): forward_kl_topk with
# both clamps, forward_kl_topk with task rewards (policy loss, KL loss, entropy bonus), k3 with task rewards
TOPK_CLAMPS = ("forward_kl_topk", [f"{DL}use_task_rewards=False", f"{DL}use_policy_gradient=False",
                                   f"{DL}log_prob_min_clamp=-9.0", f"{DL}loss_max_clamp=0.3"])
TOPK_TASK = ("forward_kl_topk", [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.7",
                                 f"{DL}use_policy_gradient=False", f"{DL}log_prob_min_clamp=-10.0",
                                 f"{P}loss_agg_mode=seq-mean-token-mean", f"{P}use_kl_loss=True",
                                 f"{P}entropy_coeff=0.01"])
K3_TASK = ("k3", [f"{DL}use_task_rewards=True", f"{DL}distillation_loss_coef=0.5", f"{DL}use_policy_gradient=False",
                  f"{DL}loss_max_clamp=0.8", f"{P}use_kl_loss=True", f"{P}entropy_coeff=0.01"])


@dataclasses.dataclass
class Rank:
    """This rank's number, the saved model's folder and the actor pairs built so far."""
    rank: int
    model_dir: str
    pairs: dict = dataclasses.field(default_factory=dict)

    def actors(self, overrides, *, one_layout: bool = False):
        """(verl's unfused Megatron actor, the actor built with verl's fused kernels) on ``overrides``, built once
        and kept. ``one_layout``: another parallel layout than the pairs built so far (a pipeline split) needs
        Megatron's parallel state rebuilt, so those pairs are dropped and the state torn down first."""
        import verl_megatron_engine as vme
        key = tuple(overrides)
        if key not in self.pairs:
            if one_layout and self.pairs:
                vme.teardown()
                self.pairs.clear()
            self.pairs[key] = (vme.Actor(self.model_dir, overrides), vme.Actor(self.model_dir, [*overrides,
                                                                                                 FUSED_KERNELS]))
        return self.pairs[key]

    def batch(self, seed: int, loss, **kwargs):
        """A case's batch from ``seed``, the same on both ranks (verl_engine.case_batch): ``loss`` is the actor
        overrides (verl's ``ppo_loss`` on a rollout batch) or (distillation mode, settings) (verl's
        ``distillation_ppo_loss`` on a batch with the teacher's tensors); ``kwargs``: rollout_batch's settings.
        Returns (tensors, meta, the actor overrides, the entry the fused update's path record names,
        exercised(metrics): verl's run exercises what the case names)."""
        import torch
        import verl_engine as ve
        return ve.case_batch(torch.Generator().manual_seed(seed), self.model_dir, loss, **kwargs)


def verl_update(actor, tensors, meta, loss, engine=None):
    """One update of ``actor`` with verl's own loss (``loss``: the actor's loss settings; ``engine``: micro-batch
    settings), entropy computed: verl_megatron_engine.Actor.update's (metrics, parameters)."""
    return actor.update(tensors, meta, loss, calculate_entropy=True, mini_batch_size=MINI_BATCH, engine=engine)


def fused_update(actor, tensors, meta, loss, engine=None, *, strict: bool = True):
    """The same update under ``logitless.verl.install(fused_loss=True, strict=strict)``, uninstalled after:
    ((metrics, parameters), the path record of the update)."""
    import logitless.verl as lv
    lv.install(fused_loss=True, strict=strict)
    try:
        return verl_update(actor, tensors, meta, loss, engine), lv.last_path()
    finally:
        lv.uninstall()


def assert_hook(rec, entry: str) -> None:
    """The fused update's path record ``rec``: logitless' output-processor hook ran the loss at ``entry``."""
    assert (rec.path, rec.entry, rec.reason) == ("hook", entry, ""), rec


def run_rank(rank: int, init_file: str, tmp_dir: str, out_dir: str, cases, *, prepare=None, layers: int = 2,
             vocab: int | None = None) -> None:
    """One rank of a two-process check: torch on one thread; the 2-rank gloo group meeting at ``init_file`` and
    verl's CPU platform (verl_megatron_engine.setup); the tiny tied Qwen2 of ``layers`` layers (``vocab`` words,
    verl_engine.VOCAB unless given) saved by rank 0 to ``tmp_dir``/qwen2; ``prepare(r)`` (what every case needs
    built first). A failure so far is the result "setup". Then each ``(name, check)`` of ``cases`` as ``check(r)``,
    recorded {name: [ok, message]} so that one failure does not hide the others; Megatron's parallel state torn
    down; the results written to ``out_dir`` (ranks.finish)."""
    import torch
    torch.set_num_threads(1)
    import verl_engine as ve
    ve.stub_server_modules()              # before verl's engine workers are imported
    import verl_megatron_engine as vme

    from ranks import finish
    results = {}
    try:
        vme.setup(rank, 2, init_file)
        if vocab is not None:
            ve.VOCAB = vocab
        r = Rank(rank, os.path.join(tmp_dir, "qwen2"))
        if rank == 0:                  # transformers saves on the main process only
            ve.save_tiny_qwen2(r.model_dir, seed=3, tied=True, layers=layers)
        torch.distributed.barrier()
        if prepare is not None:
            prepare(r)
    except Exception:  # noqa: BLE001 - reported to the parent test
        results["setup"] = [False, traceback.format_exc()[-3000:]]
        finish(results, out_dir, rank)
        return
    try:
        for name, check in cases:
            try:
                check(r)
                results[name] = [True, ""]
            except Exception:  # noqa: BLE001 - recorded per case, so one failure does not hide the others
                results[name] = [False, traceback.format_exc()[-3000:]]
        vme.teardown()
    finally:
        finish(results, out_dir, rank)
