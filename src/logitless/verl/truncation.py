"""``install(truncation=True)``: the actor's log-probs under the rollout's truncated distribution.

verl's rollout samples with ``actor_rollout_ref.rollout.top_k`` / ``top_p`` (vLLM's sampler: temperature, then
top-k, then top-p) and, with ``calculate_log_probs``, returns the sampled tokens' log-probs under that truncated,
renormalised distribution (``logprobs_mode="processed_logprobs"``), which its rollout correction compares with the
actor's. The actor scores tokens under the full softmax; with the switch on, every actor log-prob is the truncated
one instead: the old log-probs (``compute_log_prob``), the reference's (``compute_ref_log_prob``) and the update's
current ones (``update_actor``), so the PPO ratio, the KL loss and the rollout correction all compare log-probs of
one distribution family (the truncated reference keeps the KL at 0 where the policy equals it).

How: verl hands the actor only the temperature (in the batch), never top_k / top_p. Those three methods of
``ActorRolloutRefWorker`` are wrapped: each reads the worker's own rollout config (``self.config.rollout``), checks
it and sets the ``Truncation`` on this thread for its call; the fused heads (``core.py``) read it with
``current()`` and pass it to ``fused_logprobs``, and under ``install(fused_loss=True)`` on the FSDP engine the
fused loss's head (``fused_loss.head``) passes it to ``policy_loss`` (the Megatron engine refuses that pair).
The engines' forward steps (``fused_loss.py``, ``megatron_loss.py``) call ``require_fused`` per micro-batch: a
micro-batch that would compute full-softmax log-probs (verl's logits path) is a ValueError whatever ``strict``
says, and on the FSDP engine ``check_ran`` after the forward makes sure the truncated head ran.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Optional

from ..truncation import Truncation
from .sites import Site, SiteState

WORKERS = "verl.workers.engine_workers"
FIELD = "actor_rollout_ref.rollout"
# rollout engines whose sampler logitless reproduces: vLLM's v1 sampler (temperature, top-k, top-p; no min_p in
# verl's config). verl 0.9.1's registry also has "sglang" and "trtllm", whose samplers and returned log-probs are
# not checked against logitless' order; its HFRollout has no registry name.
ENGINES = ("vllm",)
METHODS = ("compute_log_prob", "compute_ref_log_prob", "update_actor")


class _Active(threading.local):
    truncation: Optional[Truncation] = None
    heads: int = 0          # truncated head calls on this thread (``check_ran``)


_active = _Active()


def _get(config, name, default=None):
    getter = getattr(config, "get", None)
    return getter(name, default) if callable(getter) else getattr(config, name, default)


def rollout_truncation(rollout) -> Truncation:
    """The ``Truncation`` verl's rollout samples with, from its config (``actor_rollout_ref.rollout``: a
    DictConfig or verl's ``RolloutConfig``). ValueError naming the field when it cannot be reproduced."""
    name = _get(rollout, "name")
    if name not in ENGINES:
        raise ValueError(f"{FIELD}.name={name!r}: truncation=True reproduces the sampler of {ENGINES} only (vLLM's "
                         "order: temperature, top-k, top-p); this engine's kept set and log-probs are not checked "
                         "against it")
    top_k, top_p = _get(rollout, "top_k", -1), _get(rollout, "top_p", 1.0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) and top_k is not None:
        raise ValueError(f"{FIELD}.top_k must be an int (-1 or 0: off), got {top_k!r}")
    k = -1 if top_k in (None, 0, -1) else int(top_k)        # vLLM: 0 or -1 = all; HF: 0 = off
    if k < -1:
        raise ValueError(f"{FIELD}.top_k={top_k}: top_k must be -1 or 0 (off) or an int >= 1")
    p = 1.0 if top_p is None else top_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
        raise ValueError(f"{FIELD}.top_p={top_p!r}: top_p must be in (0, 1] (1.0: off)")
    if k == -1 and p == 1.0:
        raise ValueError(f"truncation=True but the rollout truncates nothing ({FIELD}.top_k={top_k}, "
                         f"{FIELD}.top_p={top_p}): set top_k / top_p, or install(truncation=False)")
    if _get(rollout, "calculate_log_probs", False):
        mode = _get(rollout, "logprobs_mode")
        if mode != "processed_logprobs":
            raise ValueError(f"{FIELD}.logprobs_mode={mode!r} with {FIELD}.calculate_log_probs=True: the rollout's "
                             "log-probs would not be those of the truncated distribution the actor scores under "
                             "truncation=True; set logprobs_mode=processed_logprobs")
    try:
        return Truncation(top_k=k, top_p=p)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{FIELD}: {exc}") from exc


def current() -> Optional[Truncation]:
    """The truncation of the worker call running on this thread, else None (the heads' plain log-probs)."""
    return _active.truncation


def note_head() -> None:
    """A head computed truncated log-probs (``check_ran``)."""
    _active.heads += 1


@contextlib.contextmanager
def applied(truncation: Optional[Truncation]):
    outer, _active.truncation = _active.truncation, truncation
    try:
        yield
    finally:
        _active.truncation = outer


def require_fused(use_fused_kernels: bool, what: str = "this micro-batch") -> None:
    """ValueError when a truncated call's micro-batch would take verl's logits path (full-softmax log-probs)."""
    if _active.truncation is not None and not use_fused_kernels:
        raise ValueError(f"truncation=True but {what} runs with use_fused_kernels=False: verl would compute "
                         "full-softmax log-probs from the logits, not the rollout's truncated ones; set "
                         "actor_rollout_ref.model.use_fused_kernels=True (and for Megatron use_remove_padding=True)")


@contextlib.contextmanager
def check_ran(what: str):
    """Around a truncated micro-batch's forward: ValueError after it when no truncated head ran (verl's model
    patch was skipped, so the log-probs would be the full softmax's)."""
    if _active.truncation is None:
        yield
        return
    before = _active.heads
    yield
    if _active.heads == before:
        raise ValueError(f"truncation=True but {what} did not reach logitless' fused head (verl's fused forward was "
                         "not applied to the model?): its log-probs would be the full softmax's")


def _make_method(original):
    @functools.wraps(original)     # keeps verl's dispatch registration (the function's attributes)
    def method(self, data, *args, **kwargs):
        if not SiteState.truncation:
            return original(self, data, *args, **kwargs)
        if getattr(self, "distillation_enabled", False):
            raise ValueError("truncation=True with distillation.enabled: the teacher's log-probs are not truncated; "
                             "install(truncation=False) for distillation")
        with applied(rollout_truncation(self.config.rollout)):
            return original(self, data, *args, **kwargs)

    return method


SITES = tuple(
    Site(f"worker.{name}", WORKERS, "ActorRolloutRefWorker", name, _make_method,
         f"ActorRolloutRefWorker.{name}: under install(truncation=True), the rollout's top_k / top_p applied to "
         "the actor's log-probs")
    for name in METHODS)
