"""Host reads of tensor values (and tensors made from host data), caught on the CPU.

A CUDA op that reads a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``, ``nonzero``, a boolean
mask index, ``repeat_interleave`` without ``output_size``, ...) synchronises the stream and cannot be captured in a
CUDA graph; ``torch.cuda.set_sync_debug_mode`` catches it, on a GPU only. On the CPU the same reads are the same
aten calls: ``host_reads()`` records them with a dispatch mode over everything a call runs (forward and backward,
inside logitless' custom ops too, whose Python bodies it enters), and ``Tensor.tolist`` / ``Tensor.numpy``,
which read the values without an aten call, patched while it is open. What it cannot see: reads in C++ kernels
that do not dispatch (none of torch's CPU ops used here) and in Triton's interpreter (not used with it), and
the CUDA side of a branch on the device (``DEVICE_SIDE``: the ops whose CPU side reads on purpose), which a GPU
run checks (the CUDA-graph capture tests).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose result (or whose output's size) is a device value read on the host
READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::masked_select",
         "aten::_unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::equal",
         "aten::allclose"}


# custom ops whose CUDA path reads its tensors on the device but whose CPU path reads them on the host by design
# (where that costs nothing): run as one opaque op here. The upstream gradient's factor of the losses whose
# gradients are formed in the forward: a Triton kernel on CUDA (ops/triton/scale.py), float(g) on the CPU.
DEVICE_SIDE = {"logitless::scale_by_upstream_"}


# a tensor made from host data (torch.tensor(...) inside the call): on CUDA a copy from pageable host memory,
# which a CUDA-graph capture refuses as well
FROM_HOST = {"aten::lift_fresh", "aten::lift_fresh_copy"}


def _reads(func, args, kwargs) -> bool:
    name = func._schema.name
    if name in READS or name in FROM_HOST:
        return True
    if name == "aten::repeat_interleave":
        # repeats given as a tensor: the output's size is their sum, read on the host unless output_size says it
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        # a boolean mask index is a nonzero inside the kernel
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())
    return False


class _Mode(TorchDispatchMode):
    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads(func, args, kwargs):
            self.seen.append(str(func))
        opdef = _maybe_get_opdef(func)
        if opdef is not None and func._schema.name not in DEVICE_SIDE:
            # a custom op of ours: run its Python body under this mode, so its own aten calls are seen
            with self:
                return opdef._init_fn(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_reads() -> Iterator[list]:
    """While open, the list it yields collects the name of every op that read a tensor's values on the host."""
    seen: list = []
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def reader(name, original):
        def read(t, *a, **kw):
            seen.append(f"Tensor.{name}")
            return original(t, *a, **kw)
        return read
    for name, original in originals.items():
        setattr(torch.Tensor, name, reader(name, original))
    try:
        with _Mode(seen):
            yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
