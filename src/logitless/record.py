"""What ran: the records that replace grepping logs, shared by the op and every integration.

- ``last_backend()``: the backend the last fused op on this thread ran ("reference", "chunked", "triton");
  the ops write it (``record_backend``).
- ``last_path()``: a ``PathRecord`` (thread-local) that every integration call writes: which path produced
  the log-probabilities (Megatron's hook, the legacy patch, the unfused fallback, ...).
- Strict mode (argument ``strict=True`` or env ``LOGITLESS_STRICT=1``) turns a would-be fallback to the
  unfused path into ``FusedPathUnavailable``.

This module sits below everything else in the package (it imports only ``checks`` and ``knobs``).
"""
from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

from . import checks, knobs

PATHS = ("hook", "legacy", "unfused")
_state = threading.local()
_serial = itertools.count(1)


def last_backend() -> Optional[str]:
    """Name of the backend that the last ``fused_logprobs`` / fused policy-loss call on this thread ran
    ("reference", "chunked" or "triton"), or None before the first call. Integrations and tests use it to
    prove that no silent fallback happened."""
    return getattr(_state, "backend", None)


def record_backend(name: str) -> None:
    """Set what ``last_backend()`` returns (the ops call it)."""
    _state.backend = name


class FusedPathUnavailable(RuntimeError):
    """The fused path cannot run on this model and strict mode forbids the unfused fallback."""


@dataclass(frozen=True)
class PathRecord:
    """One call's record.

    path: "hook" (Megatron's native output_processor hook), "legacy" (logitless' instance patch
        for releases without the hook) or "unfused" (logits materialised by the model).
    backend: the fused op's backend that ran ("chunked", "triton", ...), None on the unfused path.
    entry: what was called: "processor", "forward_padded" or "forward_packed".
    reason: why this path was taken (empty for the fused paths).
    serial: increases by one per record, so a caller can tell a fresh record from an old one.
    """
    path: str
    backend: Optional[str]
    entry: str
    reason: str
    serial: int


def last_path() -> Optional[PathRecord]:
    """The latest record on this thread, or None before any Megatron call through logitless."""
    return getattr(_state, "record", None)


def write_record(path: str, backend: Optional[str], entry: str, reason: str = "") -> PathRecord:
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    rec = PathRecord(path, backend, entry, reason, next(_serial))
    _state.record = rec
    return rec


def strict_enabled(strict: Optional[bool] = None) -> bool:
    """``strict`` when given (a bool), else the env var LOGITLESS_STRICT ("1", "true", "yes", "on")."""
    if strict is not None:
        return checks.boolean(strict, "strict")
    return knobs.strict()


def in_legacy_call() -> bool:
    """True while the legacy instance patch is running the processor (so it records "legacy")."""
    return getattr(_state, "legacy_depth", 0) > 0


@contextlib.contextmanager
def legacy_call() -> Iterator[None]:
    _state.legacy_depth = getattr(_state, "legacy_depth", 0) + 1
    try:
        yield
    finally:
        _state.legacy_depth -= 1
