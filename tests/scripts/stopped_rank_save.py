"""Rank 1 stops (SIGSTOP) just as a background save starts writing; ddp(timeout=8).

``python stopped_rank_save.py DIR``: prints the launcher's error and how long it took.
"""

import os
import signal
import sys
import threading
import time

import torch

import stratagem as sg
from stratagem.checkpoint import directory


def stop_rank_one(stage: str) -> None:
    if stage == "writing" and threading.current_thread() is threading.main_thread():
        os.kill(os.getpid(), signal.SIGSTOP)


def train(strategy, ctx, path):
    if ctx.rank == 1:
        directory.stage_hook = stop_rank_one
    torch.manual_seed(0)
    sg.checkpoint.save(path, {"model": torch.nn.Linear(4, 2)}, ctx, blocking=False)
    return ctx.rank


if __name__ == "__main__":
    started = time.monotonic()
    strategy = sg.ddp_spawn(device="cpu", timeout=8, start=sg.Spawn(stop_grace=2))
    try:
        sg.launch(train, strategy, devices=2, args=(os.path.join(sys.argv[1], "c"),))
    except sg.RankError as error:
        print(f"ERROR {time.monotonic() - started:.1f} {error}", flush=True)
    else:
        print("NO ERROR", flush=True)
