"""Every Triton / Gluon kernel launch of the public ops as it would be made on an H100 / H200 (sm_90), recorded on
a CPU and built for sm_90 by triton's own compiler, without a GPU.

Run as a child process without TRITON_INTERPRET (the suite sets it; under it ``triton.jit`` builds interpreter
functions, which have nothing to compile): ``python -m sm90_launches [--stage ttgir]`` prints one JSON object
{"builds": [{"kernel", "constexprs", "signature", "cases", "error"}...], "stage", "seconds"}.

How: the host code runs as on a Hopper GPU (``as_on_hopper``: the launchers' GPU block sizes, since triton was
imported without the interpreter; the Hopper tiles, bulk-copy descriptors and the Gluon kernel; every tensor
answers ``is_cuda``), on CPU tensors. Each launch's argument types and specialisations are what triton's own
launcher computes for them (its binder, for the sm_90 backend); each distinct one is built once, after the
drive. The launch itself then runs in triton's interpreter (the same python function), so that the op goes on
to its next kernels with real values (ids, counts); only what the interpreter cannot run is swapped for the run
(``RUN_ONLY``: the PTX fast log2, the pair kernels' for loops bounded by loaded values), and a Gluon kernel does
not run (its outputs stay as allocated: later launches depend on their shapes, not their values).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("run without TRITON_INTERPRET: under it triton.jit makes interpreter functions, with nothing to build")

import torch  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction, _LangPatchScope, _patch_lang  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

try:
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
except ImportError:  # pragma: no cover - a triton without Gluon
    GluonASTSource = GluonJITFunction = None

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
SM_COUNT = 132       # H100 SXM / H200
# constexprs whose GPU value the interpreter cannot run (inline PTX; a for loop bounded by loaded values): the build
# takes the GPU's, the run this one
RUN_ONLY = {"FAST_LOG2_": False, "WHILE_LOOP_": True}

BUILDS: dict = {}    # (kernel, key) -> {"fn", "options", "signature", "constexprs", "attrs", "cases"}
CASE = ["(import)"]
RECORD_ONLY = [False]     # launches recorded, not run (the model-sized cases: their outputs stay as allocated)
_BINDERS: dict = {}
_INTERPRETED: dict = {}
_PATCHED: set = set()          # modules whose view of triton.language is patched for this launch
_ORIGINALS: dict = {}          # (object, attribute) -> the value before the launch patched it
_MISSING = object()
_REAL_SET_ATTR = _LangPatchScope.set_attr


def _interpreted(fn: JITFunction) -> InterpretedFunction:
    if fn.fn not in _INTERPRETED:
        _INTERPRETED[fn.fn] = InterpretedFunction(fn.fn)
    return _INTERPRETED[fn.fn]


def _record_and_run(self, *args, grid, warmup, **kwargs):
    """JITFunction.run: the launch's sm_90 build recorded (triton's binder: argument types, the value 1,
    divisibility by 16, alignment, options), then the kernel run in the interpreter."""
    if self not in _BINDERS:
        _BINDERS[self] = create_function_from_signature(self.signature, self.params, BACKEND)
    bound, spec, options = _BINDERS[self](*args, **kwargs)
    key = (self, repr((spec, options)))
    if key not in BUILDS:
        options, signature, constexprs, attrs = self._pack_args(BACKEND, kwargs, bound, spec, options)
        BUILDS[key] = dict(fn=self, options=options, signature=signature, constexprs=constexprs, attrs=attrs,
                           cases=[])
    if CASE[0] not in BUILDS[key]["cases"]:
        BUILDS[key]["cases"].append(CASE[0])
    if RECORD_ONLY[0] or (GluonJITFunction is not None and isinstance(self, GluonJITFunction)):
        return None     # the interpreter does not run Gluon
    run_kwargs = {k: RUN_ONLY.get(k, v) for k, v in kwargs.items()}
    try:
        _interpreted(self).run(*args, grid=grid, warmup=False, **run_kwargs)
    finally:
        _restore_language()
    return None


def _device_call(self, *args, **kwargs):
    """A @triton.jit function called from a kernel that runs in the interpreter: as the interpreter's own device
    call, which patches triton.language (as seen from the function's module) for the interpreter, but once per
    module and launch (the patching costs more than most calls)."""
    fn = _interpreted(self)
    if fn.fn.__module__ not in _PATCHED:
        _PATCHED.add(fn.fn.__module__)
        _patch_lang(fn.fn)
    return fn.rewrite()(*args, **kwargs)


def _set_attr(self, obj, name, value):
    """_LangPatchScope.set_attr, noting each attribute's value before the launch's first patch of it."""
    _ORIGINALS.setdefault((id(obj), name), (obj, name, getattr(obj, name, _MISSING)))
    _REAL_SET_ATTR(self, obj, name, value)


def _restore_language() -> None:
    """Undo every patch of triton.language made during a launch (the interpreter leaves its device calls'
    patches in place, and the sm_90 builds need the real language)."""
    for obj, name, value in _ORIGINALS.values():
        if value is _MISSING:
            if hasattr(obj, name):
                delattr(obj, name)
        else:
            setattr(obj, name, value)
    _ORIGINALS.clear()
    _PATCHED.clear()


def as_on_hopper():
    """The host code's choices as on an H100 / H200, on CPU tensors."""
    from logitless.ops.triton import backend, common, forward_stats, policy_stats, policy_stats_gluon
    JITFunction.run = _record_and_run
    JITFunction.__call__ = _device_call
    _LangPatchScope.set_attr = _set_attr
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.device = lambda device: contextlib.nullcontext()
    common.hopper_or_newer = lambda device: True
    common._capability_major = lambda index: 9
    common._sm_count = lambda index: SM_COUNT
    common._index = lambda device: 0
    backend.unavailable_reason = lambda hidden, weight: None
    # Gluon's own device checks (the device type; the tensors' layout checks stay)
    real_usable = policy_stats_gluon.usable_operands

    def usable_operands(hidden, weight, block_n):
        return real_usable(_OnCuda(hidden), weight, block_n)
    policy_stats_gluon.usable_operands = usable_operands
    forward_stats.gluon_stats = policy_stats_gluon
    policy_stats.gluon_stats = policy_stats_gluon


class _OnCuda:
    """A tensor whose device reads "cuda" (for a device check), everything else its own."""

    def __init__(self, t):
        self._t = t
        self.device = torch.device("cuda", 0)

    def __getattr__(self, name):
        return getattr(self._t, name)


def build(entry: dict, stage: str) -> None:
    """The sm_90 build of one launch, up to ``stage`` (its IR from the python source, then the nvidia backend's
    passes), without triton's cache (a cached build would skip the front end)."""
    fn = entry["fn"]
    gluon = GluonJITFunction is not None and isinstance(fn, GluonJITFunction)
    src = (GluonASTSource if gluon else ASTSource)(fn, entry["signature"], entry["constexprs"], entry["attrs"])
    options = entry["options"]
    context = ir.context()
    ir.load_dialects(context)
    BACKEND.load_dialects(context)
    module = src.make_ir(TARGET, options, BACKEND.get_codegen_implementation(options), BACKEND.get_module_map(),
                         context)
    stages: dict = {}
    BACKEND.add_stages(stages, options, src.language)
    names = list(stages)
    metadata = {"hash": "0", "target": TARGET, **options.__dict__}
    last = max(names.index(stage), names.index(src.ext))     # Gluon starts at ttgir
    for name in names[names.index(src.ext):last + 1]:
        module = stages[name](module, metadata)
    return metadata


def _named(fn, constexprs: dict) -> dict:
    """{parameter name: value} of a build's compile-time arguments (triton keys them by argument path)."""
    return {".".join([fn.arg_names[path[0]], *map(str, path[1:])]): str(value) for path, value in constexprs.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", default="ttgir", help="last compiler stage: ttir, ttgir, llir, ptx or cubin")
    parser.add_argument("--drive", default="sm90_drive", help="the module whose drive(case, record_only) launches")
    args = parser.parse_args()
    start = time.perf_counter()
    as_on_hopper()
    importlib.import_module(args.drive).drive(CASE, RECORD_ONLY)
    drive_s = time.perf_counter() - start
    out = []
    for entry in BUILDS.values():
        error, metadata = None, {}
        try:
            metadata = build(entry, args.stage)
        except Exception as exc:      # noqa: BLE001 - reported per build, with its message
            error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[-3000:]
        out.append(dict(kernel=f"{entry['fn'].module}.{entry['fn'].fn.__name__}",
                        constexprs=_named(entry["fn"], entry["constexprs"]),
                        signature=entry["signature"], num_warps=entry["options"].num_warps,
                        shared=metadata.get("shared"),
                        cases=entry["cases"], error=error))
    print(json.dumps(dict(builds=out, stage=args.stage, drive_s=drive_s, seconds=time.perf_counter() - start)))


if __name__ == "__main__":
    main()
