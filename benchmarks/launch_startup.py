"""launch_startup: time until ``fn`` runs on 2 ranks, ``sg.launch`` vs ``mp.spawn`` by hand.

Both sides start two processes with the ``spawn`` start method, join a gloo
process group on 127.0.0.1 and then call the user's function, which notes
the moment it starts (``time.perf_counter`` is the system-wide monotonic
clock on Linux, so parent and children read the same clock). Reported: the
time from the launch call until the later rank starts ``fn``, and the time
until the launch call returns (processes joined, group destroyed).

The hand-written side is what a script does without a launcher: pick a free
port, ``mp.spawn(worker, nprocs=2)``, ``init_process_group`` in each worker,
results through a file per rank (``mp.spawn`` returns none).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

import stratagem as sg
from benchmarks.report import Result, compare, seconds
from benchmarks.timing import interleave

NAME = "launch_startup"
DESCRIPTION = "Time until fn starts on 2 gloo ranks: sg.launch(ddp_spawn()) vs mp.spawn by hand."
RANKS = 2


def started(strategy: sg.StrategyLike, ctx: sg.Context) -> float:
    """The user's function on the stratagem side: when did it start?"""
    del strategy, ctx
    return time.perf_counter()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker(rank: int, port: int, out: str) -> None:
    """The hand-written side's rank: join the group, note the start of ``fn``, leave."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    Path(out, f"rank{rank}").write_text(repr(time.perf_counter()))
    dist.barrier()
    dist.destroy_process_group()


def by_stratagem() -> tuple[float, float]:
    begin = time.perf_counter()
    starts = sg.launch(started, sg.ddp_spawn(), devices=RANKS)
    return max(starts) - begin, time.perf_counter() - begin


def by_hand() -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as out:
        begin = time.perf_counter()
        mp.spawn(worker, args=(free_port(), out), nprocs=RANKS, join=True)
        returned = time.perf_counter() - begin
        starts = [float(Path(out, f"rank{rank}").read_text()) for rank in range(RANKS)]
    return max(starts) - begin, returned


def run(quick: bool = False) -> Result:
    rounds = 2 if quick else 10
    ours, plain = interleave(by_stratagem, by_hand, rounds=rounds, warmup=1)
    cases = [
        compare(
            f"2 ranks, gloo: {what}",
            "s",
            [times[index] for times in ours],
            [times[index] for times in plain],
            notes=f"{seconds(min(t[index] for t in ours))} vs "
            f"{seconds(min(t[index] for t in plain))} at best",
        )
        for index, what in enumerate(("until fn starts on every rank", "until launch returns"))
    ]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={"rounds": rounds, "ranks": RANKS, "start_method": "spawn", "backend": "gloo"},
        cases=cases,
        quick=quick,
    )
