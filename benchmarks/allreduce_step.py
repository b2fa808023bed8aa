"""allreduce_step: ``allreduce_grads()`` (the Horovod way) against ``ddp()``, on 2 gloo ranks.

Both are stratagem strategies, timed in one launch on the same process group
and the same medium model. There is no target: DDP overlaps its all-reduce
with backward, ``allreduce_grads()`` all-reduces after backward, in buckets,
at update time; the ratio tells users when each fits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave

NAME = "allreduce_step"
DESCRIPTION = "Time per step on 2 gloo ranks: allreduce_grads() vs ddp(), MLP 512-2048-512."
RANKS = 2


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (512, 2048, 512)
    batch: int = 64  # per rank
    steps_per_block: int = 3
    rounds: int = 20


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> list[Case]:
    assert ctx.group is not None
    horovod = sg.allreduce_grads()  # same setup as ddp(): it runs on this rank's group
    with fixed_threads(THREADS):
        ddp_model, ar_model = steps.copies(lambda: steps.mlp(*config.widths), 2)
        ddp_model = strategy.wrap(ddp_model, ctx)
        ar_model = horovod.wrap(ar_model, ctx)
        ddp_step = steps.stratagem_step(strategy, ctx, ddp_model, steps.sgd(ddp_model))
        ar_step = steps.stratagem_step(horovod, ctx, ar_model, steps.sgd(ar_model))
        batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1], 1 + ctx.rank)

        def timed(step: steps.Step) -> Callable[[], float]:
            def block() -> float:
                sg.ddp().barrier(ctx)
                start = time.perf_counter()
                for _ in range(config.steps_per_block):
                    step(batch)
                return (time.perf_counter() - start) / config.steps_per_block

            return block

        ours, theirs = interleave(timed(ar_step), timed(ddp_step), rounds=config.rounds)
        name = f"MLP {'-'.join(map(str, config.widths))}, batch {config.batch}/rank, wall time"
        return [compare(f"allreduce_grads vs ddp: {name}", "s/step", ours, theirs)]


def run(quick: bool = False) -> Result:
    config = Config(rounds=3) if quick else Config()
    [case] = sg.launch(on_rank, sg.ddp_spawn(), devices=RANKS, args=(config,))[0]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={**config.__dict__, "ranks": RANKS, "backend": "gloo"},
        cases=[case],
        quick=quick,
    )
