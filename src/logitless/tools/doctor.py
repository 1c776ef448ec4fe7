"""`logitless doctor`: what is installed, which devices are there, which backend "auto" would
choose and why, and whether the installed megatron-core exposes the GPTModel output_processor hook.

The machine and version helpers live in machine.py (the bench records them too); the doctor imports
nothing of the benchmark's peers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

import torch

from .machine import machine, package_version, versions

# Runs in a child process: importing megatron-core is slow, prints warnings and can fail in many
# ways (missing apex, triton, a CUDA assert); none of that may take the doctor down with it.
_HOOK_PROBE = r"""
import inspect, json, sys, warnings
warnings.simplefilter("ignore")
result = {}
try:
    from megatron.core.models.gpt.gpt_model import GPTModel
    params = inspect.signature(GPTModel.forward).parameters
    result["params"] = [p for p in ("output_processor", "output_processor_context") if p in params]
except BaseException as exc:
    result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
sys.stdout.write("\n@@HOOK@@" + json.dumps(result) + "\n")
"""


def auto_choice(device: str) -> tuple[str, str]:
    """(backend name, reason) that ``backend="auto"`` picks for tensors on ``device``."""
    from logitless import choose_backend
    probe = torch.empty(1, 1, device=device)
    mod, reason = choose_backend(probe, probe, "auto")
    return mod.name, reason


def megatron_hook_status(timeout_s: float = 300.0) -> tuple[Optional[bool], str]:
    """(True/False/None, explanation) of whether megatron-core's GPTModel.forward takes both
    ``output_processor`` and ``output_processor_context``. None: megatron-core missing or broken."""
    version = package_version("megatron-core")
    if version is None:
        return None, "megatron-core is not installed"
    try:
        proc = subprocess.run([sys.executable, "-c", _HOOK_PROBE], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"importing megatron-core {version} took over {timeout_s:.0f} s"
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@HOOK@@")]
    if not marker:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return None, f"probing megatron-core {version} crashed (exit {proc.returncode}): {tail}"
    result = json.loads(marker[-1][len("@@HOOK@@"):])
    if "error" in result:
        return None, f"megatron-core {version} does not import: {result['error']}"
    params = result["params"]
    if len(params) == 2:
        return True, (f"yes: megatron-core {version} GPTModel.forward takes output_processor and "
                      "output_processor_context (the hook integration applies)")
    if not params:
        return False, (f"no: megatron-core {version} GPTModel.forward has no output_processor "
                       "(the hook arrived in 0.18; the legacy integration path applies)")
    return False, f"partial: megatron-core {version} GPTModel.forward takes only {params[0]}"


def distillation_paths(devices: list[str]) -> list[str]:
    """The doctor's lines on distillation: which backend each family of ``fused_distillation_loss`` runs on each
    device under backend="auto", and which trainers' distillation steps logitless can take over here."""
    from logitless.losses.distill_topk import TOPK_DIVERGENCES
    from logitless.losses.distillation import _backend
    from logitless.ops.divergence_terms import FULL_VOCAB_DIVERGENCES
    lines = []
    for dev in devices:
        probe = torch.empty(1, 1, device=dev)
        try:
            full = _backend("auto", probe)
            topk, _ = auto_choice(dev)
            lines.append(f"  {dev} tensors: full vocabulary {', '.join(FULL_VOCAB_DIVERGENCES)} -> {full}; "
                         f"top-k {', '.join(TOPK_DIVERGENCES)} and fused_topk -> {topk}")
        except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not crash
            lines.append(f"  {dev} tensors: cannot choose: {type(exc).__name__}: {exc}")
    trl = package_version("trl")
    lines.append(f"  TRL DistillationTrainer / GKDTrainer / GOLDTrainer (logitless.trl.enable): "
                 f"{'trl ' + trl if trl else 'trl is not installed'}")
    verl = package_version("verl")
    lines.append(f"  verl top-k distillation (logitless.verl.install): {'verl ' + verl if verl else 'not installed'}")
    mcore = package_version("megatron-core")
    lines.append(f"  Megatron-Core (logitless.megatron.DistillationTarget): "
                 f"{'megatron-core ' + mcore if mcore else 'not installed'}")
    return lines


def report() -> str:
    """The doctor's text."""
    lines = ["logitless doctor", "", "versions:"]
    for name, ver in versions().items():
        lines.append(f"  {name:18} {ver or 'not installed'}")
    m = machine()
    lines += ["", "devices:", f"  cpu: {m['cpu']} ({m['cpu_count']} cores, torch uses {m['torch_threads']} threads)"]
    if m["cuda"]:
        for d in m["cuda"]:
            lines.append(f"  cuda:{d['index']}: {d['name']} ({d['memory_gib']} GiB, sm {d['capability']})")
    else:
        lines.append("  cuda: not available")
    if os.environ.get("TRITON_INTERPRET") == "1":
        lines.append("  TRITON_INTERPRET=1: triton kernels run in triton's interpreter on CPU tensors")
    lines += ["", "backend='auto' would choose:"]
    for dev in ["cpu"] + (["cuda"] if m["cuda"] else []):
        try:
            name, why = auto_choice(dev)
            lines.append(f"  {dev} tensors: {name} ({why})")
        except Exception as exc:  # noqa: BLE001 - the doctor reports, it does not crash
            lines.append(f"  {dev} tensors: cannot choose: {type(exc).__name__}: {exc}")
    lines += ["", "distillation (fused_distillation_loss, backend='auto'):"]
    lines += distillation_paths(["cpu"] + (["cuda"] if m["cuda"] else []))
    _, hook = megatron_hook_status()
    lines += ["", f"megatron-core output_processor hook: {hook}"]
    return "\n".join(lines)
