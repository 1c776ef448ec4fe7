"""Tests on several gloo ranks on CPU: spawn the ranks, let each write its per-case results, read them back.

A worker's ``run(rank, *args, out_dir)`` runs every case of its suite, records each as [ok, message]
(one failure does not hide the others) and ends through ``finish``: results written, then the group torn
down only once every rank is done. A rank that destroys its group while a peer still has traffic in
flight can abort at exit ("terminate called without an active exception", about 1 run in 15 without the
barrier)."""
import json
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


def fresh_seed() -> int:
    """A fresh seed per spawn (printed; LOGITLESS_SEED replays one), the same on every rank."""
    seed = int(os.environ.get("LOGITLESS_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    return seed


def spawn(run, args: tuple, world: int, out_dir) -> list[dict]:
    """``run(rank, *args)`` on ``world`` spawned ranks (args ends with ``out_dir``); each rank's results."""
    mp.spawn(run, args=args, nprocs=world)
    return [json.loads(open(os.path.join(out_dir, f"rank{r}.json")).read()) for r in range(world)]


def check(results: list[dict], case: str) -> None:
    """Every rank reached ``case`` and passed it."""
    for rank, res in enumerate(results):
        assert "setup" not in res, f"rank {rank}: {res['setup'][1]}"
        assert case in res, f"rank {rank} did not reach {case}"
        ok, msg = res[case]
        assert ok, f"rank {rank}: {msg}"


def finish(results: dict, out_dir: str, rank: int) -> None:
    """The rank's results written, its group torn down after a barrier; then, unless an exception is on its way
    out (its traceback is the report), the process leaves at once: objects that still hold gloo groups (FSDP2's
    DeviceMesh, its modules) freed during interpreter finalization aborted a rank ("terminate called without an
    active exception", SIGABRT) about 1 exit in 4 after the FSDP2 suite's assertions had all passed."""
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    close_group()
    if sys.exc_info()[0] is None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def close_group() -> None:
    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        try:
            dist.barrier()
        except RuntimeError:  # a peer already died: its own error is the one to report
            pass
    dist.destroy_process_group()


def refused(calls, needles: tuple, what: str) -> str:
    """Each of ``calls`` raises a ValueError whose message holds every one of ``needles`` (a layout refused by
    name, before any work); returns the last message. ``what`` names the layout in the failure."""
    message = None
    for call in calls:
        try:
            call()
        except ValueError as e:
            message = str(e)
            assert all(n in message for n in needles), message
        else:
            raise AssertionError(f"{what} was not refused")
    return message
