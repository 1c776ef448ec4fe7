"""`logitless bench --tp N`: fused_logprobs with the LM head sharded by vocabulary over N ranks.

Launches N processes (torch.multiprocessing, spawn) in one group: gloo on CPU, NCCL on CUDA (one
GPU per rank, NVLink multicast off: NCCL_NVLS_ENABLE=0). Every rank holds the same hidden [N, H]
and labels and an even shard of the vocabulary rows [V/N, H] (the remainder to the first ranks).

Per logitless backend, each rank times (median of ``repeats`` calls, each started after a barrier):
- forward (no grad) and forward+backward (loss = sum(a * logprob) + sum(b * entropy), gradients to
  hidden and to the weight shard, d_hidden all-reduced inside backward: the default contract);
- the GEMM floor of its shard in the input dtype, as `logitless bench` counts it: forward = 1 GEMM
  [N,H]x[H,V/N], forward+backward = 4 (forward, recompute, dH, dW);
- the op's two collectives alone, on tensors of the op's sizes: the forward combine (one all-gather
  of the packed [3, N] float32 statistics, plus its few vector operations) and the backward
  all-reduce of d_hidden [N, H] float32.
Every number is the maximum over ranks (the slowest rank sets the step time). The collectives'
share is their time over the op's: comm_fwd / fwd and (comm_fwd + comm_bwd) / fwd_bwd.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .common import DTYPES, GemmFloor, cell, markdown_table, random_head, sync

LOGITLESS_BACKENDS = ("reference", "chunked", "triton")
TIMES = ("fwd_s", "fwd_bwd_s", "floor_fwd_s", "floor_fwd_bwd_s", "comm_fwd_s", "comm_bwd_s")


def run_tp_bench(world_size: int, shape: Sequence[int], dtype="float32", device: str = "cpu",
                 backends: Iterable[str] = ("chunked",), *, temperature: float = 1.0, repeats: int = 3,
                 seed: Optional[int] = None, json_path: Optional[str] = None) -> list[dict]:
    """Time fused_logprobs over a vocab-parallel group of ``world_size`` ranks; returns one row per backend.

    Args:
        world_size: ranks (processes) to launch; on CUDA one GPU each.
        shape: (N tokens, H hidden, V global vocabulary).
        dtype: "float32", "bfloat16", "float16" or the torch dtype.
        device: "cpu" (gloo) or "cuda" (NCCL).
        backends: logitless backend names; other names (peers of `logitless bench`) get a row with
            status "unavailable", since this bench times logitless only.
        temperature, repeats, seed: as in `logitless bench` (seed None: a fresh random one).
        json_path: also write the rows there as JSON.

    Returns:
        list of dicts, one per backend, with keys: backend, status ("ok" | "unavailable" | "failed"),
        reason (None or why), world_size, collectives ("gloo" | "nccl"), device, dtype, tokens,
        hidden, vocab, vocab_per_rank (list), temperature, repeats, seed, and (None unless ok), in
        seconds, maxima over ranks of per-rank medians: fwd_s, fwd_bwd_s, floor_fwd_s,
        floor_fwd_bwd_s, comm_fwd_s, comm_bwd_s; then fwd_x_floor, fwd_bwd_x_floor (op / floor) and
        comm_share_fwd, comm_share_fwd_bwd (collectives / op, in [0, 1]).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    try:
        n, h, v = (int(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be (tokens, hidden, vocab), got {shape!r}") from None
    if min(n, h, v) < 1:
        raise ValueError(f"shape must be positive, got {(n, h, v)}")
    if v < world_size:
        raise ValueError(f"vocab {v} is smaller than world_size {world_size}: some rank would hold no rows")
    dtype_name = next((k for k, d in DTYPES.items() if dtype in (k, d)), None)
    if dtype_name is None:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"world_size {world_size} needs {world_size} GPUs, found {torch.cuda.device_count()}")
    if isinstance(backends, str):
        backends = [backends]
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    cfg = {"world_size": world_size, "shape": (n, h, v), "dtype": dtype_name, "device": device,
           "backends": list(dict.fromkeys(backends)), "temperature": float(temperature), "repeats": repeats,
           "seed": random.randrange(2 ** 31) if seed is None else int(seed)}
    with tempfile.TemporaryDirectory(prefix="logitless-bench-tp-") as tmp:
        ctx = mp.start_processes(_rank_main, args=(cfg, tmp), nprocs=world_size, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join():
                pass
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            # gloo's teardown can abort a rank ("terminate called without an active exception") after every
            # rank has passed the last barrier: the rows are complete then, and only a death before counts
            if not all(os.path.exists(os.path.join(tmp, f"done-{r}")) for r in range(world_size)):
                raise RuntimeError(f"a tensor-parallel bench rank failed:\n{exc}") from None
        with open(os.path.join(tmp, "rows.json")) as f:
            rows = json.load(f)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


# --- inside each rank ------------------------------------------------------------------------

def _rank_main(rank: int, cfg: dict, tmp: str) -> None:
    world = cfg["world_size"]
    if cfg["device"] == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"      # NVLink multicast off
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
                                device_id=dev)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))   # the ranks share the cores
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world)
    try:
        rows = [_bench_backend(name, cfg, rank, dev) for name in cfg["backends"]]
        if rank == 0:
            with open(os.path.join(tmp, "rows.json"), "w") as f:
                json.dump(rows, f)
        dist.barrier()     # no rank tears the group down while another still uses it
        open(os.path.join(tmp, f"done-{rank}"), "w").close()
    finally:
        dist.destroy_process_group()


def _median_time(fn, dev: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        sync(dev)
        start = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _bench_backend(name: str, cfg: dict, rank: int, dev: torch.device) -> dict:
    from logitless import fused_logprobs
    from logitless.parallel import VocabParallel

    world = cfg["world_size"]
    n, h, v = cfg["shape"]
    sizes = [v // world + (r < v % world) for r in range(world)]
    row = {"backend": name, "status": "ok", "reason": None, "world_size": world,
           "collectives": "nccl" if dev.type == "cuda" else "gloo", "device": cfg["device"], "dtype": cfg["dtype"],
           "tokens": n, "hidden": h, "vocab": v, "vocab_per_rank": sizes, "temperature": cfg["temperature"],
           "repeats": cfg["repeats"], "seed": cfg["seed"]}
    row.update({k: None for k in TIMES + ("fwd_x_floor", "fwd_bwd_x_floor", "comm_share_fwd",
                                          "comm_share_fwd_bwd")})
    if name not in LOGITLESS_BACKENDS:
        row.update(status="unavailable", reason="not a logitless backend: the tensor-parallel bench times "
                                                "logitless.fused_logprobs only")
        return row

    dtype, group, t = DTYPES[cfg["dtype"]], dist.group.WORLD, cfg["temperature"]
    shared = torch.Generator(device=dev).manual_seed(cfg["seed"])           # same on every rank
    own = torch.Generator(device=dev).manual_seed(cfg["seed"] + 1 + rank)   # this rank's rows
    hidden, _ = random_head(n, h, 1, dtype, dev, shared)
    labels = torch.randint(0, v, (n,), device=dev, generator=shared)
    a = torch.randn(n, device=dev, generator=shared)
    b = torch.randn(n, device=dev, generator=shared)
    _, weight = random_head(1, h, sizes[rank], dtype, dev, own)      # this rank's shard of the head
    h_leaf = hidden.detach().requires_grad_(True)
    w_leaf = weight.detach().requires_grad_(True)

    def fwd():
        with torch.no_grad():
            return fused_logprobs(hidden, weight, labels, temperature=t, tp_group=group, backend=name)

    def fwd_bwd():
        out = fused_logprobs(h_leaf, w_leaf, labels, temperature=t, tp_group=group, backend=name)
        loss = (out.logprobs * a).sum() + (out.entropy * b).sum()
        return torch.autograd.grad(loss, (h_leaf, w_leaf))

    try:   # every rank fails alike here (the backend's own checks), before any collective of the op
        fwd_bwd()
    except (RuntimeError, ValueError, TypeError) as exc:
        row.update(status="unavailable" if "cannot" in str(exc) else "failed", reason=f"{type(exc).__name__}: {exc}")
        return row

    floor = GemmFloor(hidden, weight)      # the GEMMs of this rank's shard
    tp = VocabParallel.for_group(group, weight)
    stats = [torch.randn(n, device=dev, generator=own) for _ in range(3)]
    dh = torch.randn(n, h, device=dev, generator=own)

    def comm_fwd():
        return tp.combine_stats(*stats)

    def comm_bwd():
        return tp.reduce_grad_hidden(dh)

    reps = cfg["repeats"]
    mine = [_median_time(fn, dev, reps) for fn in (fwd, fwd_bwd, floor.forward, floor.forward_backward,
                                                        comm_fwd, comm_bwd)]
    floor.close()
    slowest = torch.tensor(mine, dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    row.update(zip(TIMES, slowest.tolist(), strict=True))
    row["fwd_x_floor"] = row["fwd_s"] / row["floor_fwd_s"]
    row["fwd_bwd_x_floor"] = row["fwd_bwd_s"] / row["floor_fwd_bwd_s"]
    row["comm_share_fwd"] = min(1.0, row["comm_fwd_s"] / row["fwd_s"])
    row["comm_share_fwd_bwd"] = min(1.0, (row["comm_fwd_s"] + row["comm_bwd_s"]) / row["fwd_bwd_s"])
    return row


# --- output ----------------------------------------------------------------------------------

def format_tp_table(rows: list[dict]) -> str:
    """The rows of :func:`run_tp_bench` as a markdown table (times in ms), with a header line."""
    if not rows:
        return "no rows\n"
    r0 = rows[0]
    head = (f"vocab-parallel over {r0['world_size']} ranks: N={r0['tokens']} H={r0['hidden']} V={r0['vocab']} "
            f"{r0['dtype']} on {r0['device']} ({r0['collectives']}); max over ranks of per-rank medians\n\n")
    cols = ["backend", "fwd ms", "fwd x floor", "fwd+bwd ms", "fwd+bwd x floor", "comm share fwd",
            "comm share fwd+bwd", "note"]
    table = [[r["backend"], cell(r["fwd_s"] and r["fwd_s"] * 1e3, ".1f"), cell(r["fwd_x_floor"], ".2f"),
              cell(r["fwd_bwd_s"] and r["fwd_bwd_s"] * 1e3, ".1f"), cell(r["fwd_bwd_x_floor"], ".2f"),
              cell(r["comm_share_fwd"], ".2f"), cell(r["comm_share_fwd_bwd"], ".2f"),
              "" if r["status"] == "ok" else f"{r['status']}: {r['reason']}"] for r in rows]
    return head + markdown_table(cols, table)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m logitless.tools.bench_tp", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, required=True, help="ranks")
    p.add_argument("--shape", default="1024,512,32000", help="N,H,V (global vocabulary)")
    p.add_argument("--dtype", default=None, choices=tuple(DTYPES))
    p.add_argument("--device", default=None, choices=("cpu", "cuda"))
    p.add_argument("--backends", default=None, help="comma-separated logitless backends")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    backends = args.backends.split(",") if args.backends else (["chunked", "triton"] if device == "cuda"
                                                               else ["chunked"])
    rows = run_tp_bench(args.tp, tuple(int(x) for x in args.shape.split(",")),
                        args.dtype or ("bfloat16" if device == "cuda" else "float32"), device, backends,
                        temperature=args.temperature, repeats=args.repeats, seed=args.seed, json_path=args.json)
    print(format_tp_table(rows), end="")
    return 0 if all(r["status"] != "failed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
