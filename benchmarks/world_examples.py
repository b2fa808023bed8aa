"""world_examples: hypothesis-style law examples on a persistent 2-rank ``World`` vs a spawn each.

One example is one call of the ``reduce-arithmetic`` law on fresh per-rank
values. The persistent side runs it on a ``World`` started once (its start-up
is reported separately, not counted per example); the other side pays what a
test would pay without the kit: spawning a 2-process world for the example.
"""

from __future__ import annotations

import time

import torch

import stratagem as sg
from benchmarks.report import Result, compare, seconds
from benchmarks.timing import interleave
from stratagem.testing import World, laws

NAME = "world_examples"
DESCRIPTION = "law examples per second: persistent 2-rank World vs spawning 2 ranks per example."
BATCH = 20  # examples timed together on the World side, per round


def values(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(8, generator=generator) for _ in range(2)]


def run(quick: bool = False) -> Result:
    rounds = 2 if quick else 5
    strategy = sg.ddp()
    start = time.perf_counter()
    with World(2) as world:
        started = time.perf_counter() - start
        laws.check_reduce(strategy, values(0), "sum", world=world)  # join once, untimed
        counter = iter(range(1, 10**9))

        def on_world() -> float:
            begin = time.perf_counter()
            for _ in range(BATCH):
                laws.check_reduce(strategy, values(next(counter)), "mean", world=world)
            return (time.perf_counter() - begin) / BATCH

        def spawned() -> float:
            begin = time.perf_counter()
            laws.check_reduce(strategy, values(next(counter)), "mean")  # starts its own World
            return time.perf_counter() - begin

        persistent, fresh = interleave(on_world, spawned, rounds=rounds, warmup=0)
    case = compare(
        "law example: World vs spawn per example",
        "s/example",
        persistent,
        fresh,
        notes=(
            f"World start-up {seconds(started)} (once); "
            f"{1 / sorted(persistent)[len(persistent) // 2]:.0f} examples/s on the World"
        ),
    )
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={"rounds": rounds, "examples_per_round": BATCH, "world_size": 2},
        cases=[case],
        quick=quick,
    )
