"""checked_cost: what ``sg.checked`` adds to each collective, on 2 gloo ranks.

``checked`` all-reduces a fingerprint hash before every collective that goes
through the strategy's fields. Each case times a block of calls through
``sg.checked(ddp)`` against the same calls through ``ddp()``'s own field, in
one launch, blocks alternating; an A/A control times the plain reduce
against itself. Rank 0's wall-clock timings are reported: a collective waits
for the other rank, so CPU time would not count it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import stratagem as sg
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave

NAME = "checked_cost"
DESCRIPTION = "Time per collective on 2 gloo ranks: sg.checked(ddp()) fields vs ddp()'s own."
RANKS = 2


@dataclass(frozen=True)
class Config:
    calls_per_block: int = 50
    rounds: int = 30


Call = Callable[[sg.StrategyLike, sg.Context], object]
TENSOR = torch.ones(256)  # 1 KiB: a logged metric or a few, the size these fields usually carry
CALLS: dict[str, Call] = {
    "reduce 256 floats": lambda s, ctx: s.reduce(TENSOR, "mean", ctx),
    "gather 256 floats": lambda s, ctx: s.gather(TENSOR, ctx),
    "broadcast 256 floats": lambda s, ctx: s.broadcast(TENSOR, ctx, src=0),
    "barrier": lambda s, ctx: s.barrier(ctx),
}


def block(
    strategy: sg.StrategyLike, ctx: sg.Context, call: Call, calls: int
) -> Callable[[], float]:
    def timed() -> float:
        dist.barrier(ctx.group)  # both ranks start the block together
        start = time.perf_counter()
        for _ in range(calls):
            call(strategy, ctx)
        return (time.perf_counter() - start) / calls

    return timed


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> list[Case]:
    """Body of each rank: every rank runs the same blocks in the same order."""
    checked = sg.checked(strategy)
    cases = []
    with fixed_threads(THREADS):
        for name, call in CALLS.items():
            ours, plain = interleave(
                block(checked, ctx, call, config.calls_per_block),
                block(strategy, ctx, call, config.calls_per_block),
                rounds=config.rounds,
            )
            cases.append(compare(name, "s/call", ours, plain))
        first = CALLS["reduce 256 floats"]
        again, plain = interleave(
            block(strategy, ctx, first, config.calls_per_block),
            block(strategy, ctx, first, config.calls_per_block),
            rounds=config.rounds,
        )
        cases.append(compare("reduce: A/A control, plain vs plain", "s/call", again, plain))
    return cases


def run(quick: bool = False) -> Result:
    config = Config(rounds=4) if quick else Config()
    cases = sg.launch(on_rank, sg.ddp_spawn(), devices=RANKS, args=(config,))[0]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            "calls_per_block": config.calls_per_block,
            "rounds": config.rounds,
            "ranks": RANKS,
            "backend": "gloo",
        },
        cases=cases,
        quick=quick,
    )
