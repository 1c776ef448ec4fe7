"""The backends by name, and the choice ``backend="auto"`` makes. Modules are imported on first use,
so a missing triton only matters to whoever asks for the triton backend."""
from __future__ import annotations

import importlib

from torch import Tensor

from .contract import Backend

BACKENDS = ("auto", "reference", "chunked", "triton")
_MODULES = {"reference": "logitless.ops.reference", "chunked": "logitless.ops.chunked",
            "triton": "logitless.ops.triton.backend"}


def load_backend(name: str) -> Backend:
    """The backend module for ``name`` (not "auto"). Raises ValueError for an unknown name and
    RuntimeError when the backend cannot be imported here (e.g. triton missing)."""
    if name not in _MODULES:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    try:
        return importlib.import_module(_MODULES[name])
    except ImportError as exc:
        raise RuntimeError(f"backend {name!r} cannot be imported here: {exc}") from exc


def choose_backend(hidden: Tensor, weight: Tensor, backend: str = "auto") -> tuple[Backend, str]:
    """Resolve ``backend`` for these inputs: returns (module, reason it was chosen).

    "auto" takes "triton" for CUDA tensors when it can run, else "chunked". An explicit name that
    cannot run on these inputs raises RuntimeError with the reason."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    if backend != "auto":
        mod = load_backend(backend)
        reason = mod.unavailable_reason(hidden, weight)
        if reason is not None:
            raise RuntimeError(f"backend {backend!r} cannot run on these inputs: {reason}")
        return mod, "requested"
    if hidden.is_cuda:
        try:
            mod = load_backend("triton")
            reason = mod.unavailable_reason(hidden, weight)
        except RuntimeError as exc:
            reason = str(exc)
        if reason is None:
            return mod, "CUDA tensors and triton runs"
        return load_backend("chunked"), f"triton cannot run: {reason}"
    return load_backend("chunked"), f"{hidden.device.type} tensors: triton runs on CUDA only"
