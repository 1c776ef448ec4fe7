"""Runs the tensor-parallel cases in real gloo processes, once per world size, and caches outcomes.

Spawning costs seconds (each rank imports torch), so every case of a world size runs inside one
set of processes. Each rank records, per case, "ok", "skip: why" or the failure's traceback in a
JSON file; the pytest tests read them. Inputs are fresh random numbers every run: rank 0 draws a
seed and broadcasts it, so every rank builds the same full tensors; the seed is part of any failure.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import secrets
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 300
EXIT = "ranks_exit_cleanly"   # pseudo-case: every rank process ended with exit code 0


class Skip(Exception):
    """Raised by a case that cannot run here; the message says why."""


@functools.lru_cache(maxsize=None)
def run_world(world: int, cases_module: str = "tp_cases") -> dict:
    """{case name: [outcome per rank]} of every case registered for ``world`` ranks in ``cases_module``
    (a module of this folder with ``configure_process``, ``pre_init_cases`` and ``cases_for(world)``)."""
    cases = importlib.import_module(cases_module)
    names = [name for name, _ in cases.pre_init_cases() + cases.cases_for(world)]
    with tempfile.TemporaryDirectory(prefix="logitless-tp-") as tmp:
        seed = secrets.randbits(31)
        ctx = mp.start_processes(_entry, args=(world, tmp, seed, cases_module), nprocs=world, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        crashed = None
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    crashed = f"ranks still running after {TIMEOUT_S} s (a collective hung?)"
                    break
        except Exception as exc:          # a rank died outside the per-case guards
            crashed = f"{type(exc).__name__}: {exc}"
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.kill()
        outcomes = {name: [] for name in names}
        for rank in range(world):
            path = os.path.join(tmp, f"rank{rank}.json")
            got = json.load(open(path)) if os.path.exists(path) else {}
            for name in names:
                outcomes[name].append(got.get(name, f"no result from rank {rank} (seed {seed}): {crashed}"))
    # a rank that aborts after its cases (e.g. a process group kept alive past destroy) is a bug too
    outcomes[EXIT] = ["ok" if crashed is None else f"seed {seed}: {crashed}"]
    return outcomes


def check_outcome(world: int, case: str, cases_module: str = "tp_cases", *, skips: bool = True) -> None:
    """A test's verdict on ``case`` of ``cases_module`` over ``world`` ranks (run_world): every rank's outcome
    "ok", or, where ``skips``, the test skipped with the reasons of the ranks that skipped it (otherwise a skip
    fails like any other outcome)."""
    # imported here, not at the top: the rank processes import this module too
    import pytest
    per_rank = run_world(world, cases_module)[case]
    failed = [o for o in per_rank if o != "ok" and not (skips and o.startswith("skip: "))]
    assert not failed, "\n\n".join(failed)
    reasons = sorted({o[len("skip: "):] for o in per_rank if o.startswith("skip: ")})
    if reasons:
        pytest.skip("; ".join(reasons))


def _entry(rank: int, world: int, tmp: str, seed: int, cases_module: str = "tp_cases") -> None:
    # where no GPU exists triton must interpret, and must learn it before its first import
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    sys.path.insert(0, os.path.dirname(HERE))       # tests/, for reference64
    import torch.distributed as dist

    from tp_cases import Ctx
    cases = importlib.import_module(cases_module)
    cases_for, pre_init_cases = cases.cases_for, cases.pre_init_cases

    cases.configure_process()
    results = {}
    path = os.path.join(tmp, f"rank{rank}.json")

    def record(name, fn, ctx):
        try:
            fn(ctx)
            results[name] = "ok"
        except Skip as exc:
            results[name] = f"skip: {exc}"
        except BaseException:
            results[name] = f"rank {rank}, seed {ctx.seed}:\n{traceback.format_exc()}"
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)

    for name, fn in pre_init_cases():
        record(name, fn, Ctx(rank, world, None, seed))
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for i, (name, fn) in enumerate(cases_for(world)):
            record(name, fn, Ctx(rank, world, dist.group.WORLD, seed + 1000 * i))
        dist.barrier()
    finally:
        dist.destroy_process_group()
