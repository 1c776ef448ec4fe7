"""The backends by name, and the choice ``backend="auto"`` makes. Modules are imported on first use,
so a missing triton only matters to whoever asks for the triton backend."""
from __future__ import annotations

from torch import Tensor

from .contract import Backend

BACKENDS = ("auto", "reference", "chunked", "triton")


def load_backend(name: str) -> Backend:
    """The backend module for ``name`` (not "auto"). Raises ValueError for an unknown name and
    RuntimeError when the backend cannot be imported here (e.g. triton missing).

    Plain import statements, not importlib: torch.compile's tracer runs these (importlib would be a
    graph break in every compiled caller of ``fused_logprobs``)."""
    if name not in BACKENDS[1:]:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    try:
        if name == "reference":
            from . import reference as mod
        elif name == "chunked":
            from . import chunked as mod
        else:
            from .triton import backend as mod
    except ImportError as exc:
        raise RuntimeError(f"backend {name!r} cannot be imported here: {exc}") from exc
    return mod


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
