"""What ran: the records that replace grepping logs, shared by the op and every integration.

- ``last_backend()``: the backend the last fused op on this thread ran ("reference", "chunked", "triton");
  the ops write it (``record_backend``), with ``last_precision()``: how its products ran.
- ``last_path()``: a ``PathRecord`` (thread-local) that every public op and every integration call writes: which
  path produced the result (a public op called directly, a trainer's fused step, Megatron's hook, the legacy
  patch, the unfused fallback, ...), with the backend and how the products ran.
- Strict mode (argument ``strict=True`` or env ``LOGITLESS_STRICT=1``) turns a would-be fallback to the
  unfused path into ``FusedPathUnavailable``.

This module sits below everything else in the package (it imports only ``checks`` and ``knobs``).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Optional

from . import checks, knobs

PATHS = ("op", "fused", "hook", "legacy", "schedule-plan", "fsdp", "unfused")
_state = threading.local()
_serial = itertools.count(1)


def last_backend() -> Optional[str]:
    """Name of the backend that the last ``fused_logprobs`` / fused policy-loss call on this thread ran
    ("reference", "chunked" or "triton"), or None before the first call. Integrations and tests use it to
    prove that no silent fallback happened."""
    return getattr(_state, "backend", None)


class Precision(NamedTuple):
    """How a fused op's products ran (``logitless.ops.precision``): ``statistics`` for the logits ("native":
    half-precision operands; for float32 operands "bf16x1", "bf16x2", "bf16x3" (the split that ran), "bf16x6",
    "tf32" or "ieee") and ``gradients`` for d_hidden / d_weight ("native", "bf16", "bf16x3", "bf16x6", "ieee")."""
    statistics: str
    gradients: str


def last_precision() -> Optional[Precision]:
    """How the last fused op on this thread multiplied (``Precision``), or None before the first call."""
    return getattr(_state, "precision", None)


def record_backend(name: str, precision: tuple = ("native", "native"), entry: Optional[str] = None) -> None:
    """Set what ``last_backend()`` and ``last_precision()`` return (the ops call it); with ``entry`` (the public op
    that ran: "fused_logprobs", "fused_policy_loss", "fused_distillation_loss", "fused_topk", "fused_logprobs_k")
    also ``last_path()``: path "op". Called inside the custom ops, so that torch.compile traces no side effect."""
    _state.backend = name
    _state.precision = Precision(*precision)
    if entry is not None:
        write_record("op", name, entry)


class FusedPathUnavailable(RuntimeError):
    """The fused path cannot run on this model and strict mode forbids the unfused fallback."""


@dataclass(frozen=True)
class PathRecord:
    """One call's record.

    path: "op" (a public op: its own record, overwritten by the integration that called it), "fused" (a trainer
        integration's fused step: TRL's GRPO / Distillation / GKD / GOLD, logitless.transformers' forwards),
        "hook" (Megatron's native output_processor hook in the model's forward), "legacy"
        (logitless' instance patch for models without the hook), "schedule-plan" (the processor run
        by the post-process node of megatron-core's ``build_schedule_plan``, the combined 1F1B
        schedule), "fsdp" (verl's FSDP engine forward, the policy loss fused into its head) or "unfused"
        (logits materialised by the model; for entry "verl.policy_loss": verl computed the policy loss
        itself from the log-probs).
    backend: the fused op's backend that ran ("chunked", "triton", ...), None where no fused op ran
        (the unfused path; a labels=None forward, which returns the model's own output).
    entry: what was called: the public op's name (path "op"); "trl.grpo", "trl.distillation", "trl.gkd",
        "trl.gold", "trl.grpo.logprobs" (GRPO's log-probs without the fused loss), "transformers.fused_forward",
        "transformers.fused_policy_loss", "verl.fused_kernels" (verl's FSDP fused-kernel head, log-probs only)
        (path "fused"); "processor",
        "forward_padded", "forward_packed", "schedule_plan", "verl"
        (verl's fused head) or "verl.policy_loss" (verl's actor loss under
        ``logitless.verl.install(fused_loss=True)``).
    reason: why this path was taken (empty for the fused paths).
    serial: increases by one per record, so a caller can tell a fresh record from an old one.
    model: the class name of the Megatron model that ran ("GPTModel", "HybridModel", ...), None where
        it is not known.
    precision: how the fused op's products ran (``Precision``: the op's record on this thread when the
        record was written), None where no fused op ran.
    truncation: the sampler's truncation the log-probs were computed under (``fused_logprobs(...,
        truncation=)``): its settings, e.g. "top_k=50 top_p=0.95 min_p=0.05" ("per-token" for a tensor), or
        "kept_ids" (the replay form); None for the untruncated op.
    """
    path: str
    backend: Optional[str]
    entry: str
    reason: str
    serial: int
    model: Optional[str] = None
    precision: Optional[Precision] = None
    truncation: Optional[str] = None


def last_path() -> Optional[PathRecord]:
    """The latest record on this thread, or None before any fused op ran on it."""
    return getattr(_state, "record", None)


def write_record(path: str, backend: Optional[str], entry: str, reason: str = "",
                 model: Optional[str] = None, truncation: Optional[str] = None) -> PathRecord:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # the fused op that produced ``backend`` ran on this thread just before: its precision is the thread's last
    rec = PathRecord(path, backend, entry, reason, next(_serial), model,
                     last_precision() if backend is not None else None, truncation)
    _state.record = rec
    return rec


def serial_now() -> int:
    """The serial of the latest record on this thread (0 before any): what ``write_step`` compares against."""
    rec = last_path()
    return rec.serial if rec is not None else 0


def write_step(entry: str, since: int) -> Optional[PathRecord]:
    """An integration's fused step (path "fused", ``entry``), written over the record of the op it ran, with that
    op's backend, precision and truncation; nothing where no op has written a record since ``since``
    (``serial_now()`` taken before the step): no fused op ran, so there is nothing to say it did."""
    rec = last_path()
    if rec is None or rec.serial <= since:
        return None
    return write_record("fused", rec.backend, entry, truncation=rec.truncation)


def strict_enabled(strict: Optional[bool] = None) -> bool:
    """``strict`` when given (a bool), else the env var LOGITLESS_STRICT ("1", "true", "yes", "on")."""
    if strict is not None:
        return checks.boolean(strict, "strict")
    return knobs.strict()


def processor_path() -> str:
    """The path an output processor is running on: "legacy" inside the instance patch,
    "schedule-plan" inside logitless' schedule-plan entry point, else "hook"."""
    scopes = getattr(_state, "scopes", None)
    return scopes[-1] if scopes else "hook"


@contextlib.contextmanager
def path_scope(path: str) -> Iterator[None]:
    """While open, ``processor_path()`` returns ``path`` (one of PATHS) on this thread."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    scopes = getattr(_state, "scopes", None)
    if scopes is None:
        scopes = _state.scopes = []
    scopes.append(path)
    try:
        yield
    finally:
        scopes.pop()


def legacy_call():
    return path_scope("legacy")
