"""A script that ends right after a background save returns: the save must still commit.

``python ends_after_background_save.py DIR single``: a context made by hand, no teardown,
the script ends. ``... DIR spawn``: two spawned ranks return right after the save, with an
exit timeout shorter than the commit. Each commit is held for 3 s, so it is in flight.
"""

import os
import sys
import threading
import time

import torch

import stratagem as sg
from stratagem.checkpoint import directory


def slow_commit(stage: str) -> None:
    if stage == "written" and threading.current_thread().name == "stratagem-save":
        time.sleep(3.0)


def save_and_return(strategy, ctx, path):
    directory.stage_hook = slow_commit
    torch.manual_seed(0)
    sg.checkpoint.save(path, {"model": torch.nn.Linear(4, 2), "step": 7}, ctx, blocking=False)
    return ctx.rank


if __name__ == "__main__":
    path, mode = os.path.join(sys.argv[1], "step_7"), sys.argv[2]
    if mode == "single":
        strategy = sg.single_device("cpu")
        save_and_return(strategy, strategy.setup(sg.Env()), path)  # no teardown: the script ends
    else:
        strategy = sg.ddp_spawn(device="cpu", start=sg.Spawn(exit_timeout=1.0))
        print(sg.launch(save_and_return, strategy, devices=2, args=(path,)), flush=True)
