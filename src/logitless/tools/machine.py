"""The machine and the installed versions: recorded by every benchmark, printed by the doctor.
Read from package metadata, so nothing heavy (megatron-core, peers) is imported."""
from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Optional

import torch

VERSIONED = ("torch", "triton", "transformers", "megatron-core", "numpy")
# Optional packages the benchmark compares with (their versions are recorded when installed).
PEER_PACKAGES = ("liger-kernel", "cut-cross-entropy", "trl")


def package_version(dist: str) -> Optional[str]:
    """The installed version of distribution ``dist``, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, Optional[str]]:
    """Installed versions (None when missing) of python, logitless, the main dependencies and peers.
    Read from package metadata, so nothing heavy is imported."""
    from logitless import __version__
    out: dict[str, Optional[str]] = {"python": platform.python_version(), "logitless": __version__,
                                     "torch": torch.__version__}
    for dist in VERSIONED[1:] + PEER_PACKAGES:
        out[dist] = package_version(dist)
    return out


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """CPU model and core count, torch's thread count, and the CUDA devices (name, memory)."""
    info = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "cuda": []}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["cuda"].append({"index": i, "name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                 "capability": f"{p.major}.{p.minor}"})
    return info
