"""async_save: how long a save stalls the training loop, ``blocking=False`` against a blocking save.

The same state (a medium MLP and its AdamW state) is saved to fresh
directories on the same disk, alternately, in one process. Two figures:

- the stall: the time until ``save`` returns, which is what the loop waits
  (the background save's copy to CPU memory, against the whole write);
- a save and the next ``STEPS`` training steps, timed together, since the
  background writer shares this machine's 2 cores with those steps.

In both, the background save is waited for after the timed part, untimed,
so every round starts with nothing in flight. Wall time: a save waits on ``fsync``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import stratagem as sg
from benchmarks.report import Result, compare
from benchmarks.timing import fixed_threads, interleave

NAME = "async_save"
DESCRIPTION = "training-loop stall of save(blocking=False) vs a blocking save of the same state."
WIDTH = 1536  # 3 layers of 1536x1536: 27 MiB of weights, 81 MiB with AdamW's two moments
STEPS = 5


def medium() -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *(m for _ in range(3) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randn(32, WIDTH)

    def train_step() -> None:
        model(batch).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    train_step()
    return model, optimizer, train_step


def run(quick: bool = False) -> Result:
    rounds = 3 if quick else 11
    ctx = sg.single_device("cpu").setup(sg.Env())
    root = Path(tempfile.mkdtemp(prefix="stratagem-bench-"))
    model, optimizer, train_step = medium()
    state = {"model": model, "optim": optimizer, "step": 1}
    count = iter(range(10**6))

    def timed(blocking: bool, steps: int) -> float:
        path = root / f"c{next(count)}"
        start = time.perf_counter()
        handle = sg.checkpoint.save(path, state, ctx, blocking=blocking)
        for _ in range(steps):
            train_step()
        elapsed = time.perf_counter() - start
        if handle is not None:
            handle.wait()
        shutil.rmtree(path)
        return elapsed

    try:
        with fixed_threads():
            cases = []
            for steps, name in ((0, "save returns"), (STEPS, f"save + {STEPS} steps")):
                background, blocking = interleave(
                    lambda steps=steps: timed(False, steps),
                    lambda steps=steps: timed(True, steps),
                    rounds=rounds,
                )
                cases.append(
                    compare(
                        name,
                        "s",
                        background,
                        blocking,
                        notes="stratagem = blocking=False, plain = blocking save",
                    )
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        sg.single_device("cpu").teardown(ctx)
    megabytes = sum(p.numel() for p in model.parameters()) * 4 * 3 / 2**20
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={"rounds": rounds, "state_mib": round(megabytes, 1), "steps": STEPS},
        cases=cases,
        quick=quick,
    )
