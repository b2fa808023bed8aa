"""world_examples: law examples per second on a persistent 2-rank ``World``.

Case 1: one example is one call of the ``reduce-arithmetic`` law on fresh
per-rank values. The persistent side runs it on a ``World`` started once (its
start-up is reported separately, not counted per example); the other side pays
what a test would pay without the kit: spawning a 2-process world for the example.

Case 2: a hypothesis property over combinator stacks on ``ddp()`` (precision,
clipping, accumulation, in any order), one ``data-parallel-step`` law per
example (3 steps, whole state). The World keeps one join per base and makes
the stacks' per-run state afresh; the other side rejoins for every example, as
the first edition's World did for every new setup.
"""

from __future__ import annotations

import time

import torch

import stratagem as sg
from benchmarks.report import Case, Result, compare, seconds
from benchmarks.timing import interleave
from stratagem.testing import Contract, World, laws
from stratagem.testing.modules import mlp

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
        stacks = _stack_property(world, rounds)
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
        cases=[case, stacks],
        quick=quick,
    )


def _stack_property(world: World, rounds: int) -> Case:
    from hypothesis import HealthCheck, given, settings

    from stratagem.testing import strategies as kit

    examples = 10
    data = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    loose = Contract(rtol=3e-2, atol=3e-2)  # bf16-mixed is among the stacks

    def property_run(rejoin: bool) -> float:
        @settings(
            max_examples=examples, deadline=None, database=None,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(strategy=kit.strategies(bases={"ddp": sg.ddp}))
        def law(strategy: sg.Strategy) -> None:
            if rejoin:
                world._leave_store()  # noqa: SLF001  # what a new setup cost before
            laws.check_data_parallel_step(strategy, mlp(), data, world=world, contract=loose)

        begin = time.perf_counter()
        law()
        return (time.perf_counter() - begin) / examples

    cached, rejoined = interleave(
        lambda: property_run(False), lambda: property_run(True), rounds=rounds, warmup=1
    )
    median = sorted(cached)[len(cached) // 2]
    return compare(
        "hypothesis property over combinator stacks: one join vs a join per example",
        "s/example",
        cached,
        rejoined,
        notes=f"{1 / median:.1f} examples/s with one join per base (target: at least 20)",
    )
