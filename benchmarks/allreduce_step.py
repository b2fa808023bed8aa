"""allreduce_step: ``allreduce_grads()`` (the Horovod way) against ``ddp()``, on 2 gloo ranks.

All are stratagem strategies, timed in one launch on the same process group
and the same medium model, blocks of steps interleaved round by round (the
order rotating every round). Three contenders per rank:

- ``allreduce_grads()`` as it is: its gradient hooks all-reduce buckets
  (buffers allocated once) as backward produces them, ``update`` sends the
  last with the flags in its tail and waits for all (target ≤ 1.01 x ddp);
- the same strategy as it was before the hooks (``update`` all-reduces every
  bucket after backward, `average_gradients`), kept here as the baseline;
- ``ddp()``, which overlaps its all-reduce with backward.

Each case is a ratio per round, median and interquartile range, and a 95 %
bootstrap interval of the median ratio (in the notes). Wall time: ranks wait
on each other's gradients.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import attrs
import torch

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, bootstrap_median, fixed_threads, rotate
from stratagem import training
from stratagem.strategies.allreduce_buckets import average_gradients

NAME = "allreduce_step"
DESCRIPTION = "Time per step on 2 gloo ranks: allreduce_grads() vs ddp(), MLP 512-2048-512."
RANKS = 2
TARGET = 1.01  # issue 21: at most 1.01 x ddp() per step


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (512, 2048, 512)
    batch: int = 64  # per rank
    steps_per_block: int = 3
    rounds: int = 40


@attrs.frozen
class AfterBackward:
    """The update field of allreduce_grads() before the hooks: all-reduce after backward, step."""

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: sg.Context
    ) -> None:
        average_gradients(module, ctx)
        training.update(optimizer, module, ctx)


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> list[Case]:
    assert ctx.group is not None
    hooked = sg.allreduce_grads()  # same setup as ddp(): it runs on this rank's group
    after = attrs.evolve(hooked, update=AfterBackward(), no_sync=training.no_sync)
    with fixed_threads(THREADS):
        ddp_model, hooked_model, after_model = steps.copies(lambda: steps.mlp(*config.widths), 3)
        ddp_model = strategy.wrap(ddp_model, ctx)
        hooked_model = hooked.wrap(hooked_model, ctx)
        after_model = after.wrap(after_model, ctx)
        ddp_step = steps.stratagem_step(strategy, ctx, ddp_model, steps.sgd(ddp_model))
        hooked_step = steps.stratagem_step(hooked, ctx, hooked_model, steps.sgd(hooked_model))
        after_step = steps.stratagem_step(after, ctx, after_model, steps.sgd(after_model))
        batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1], 1 + ctx.rank)

        def timed(step: steps.Step) -> Callable[[], float]:
            def block() -> float:
                sg.ddp().barrier(ctx)
                start = time.perf_counter()
                for _ in range(config.steps_per_block):
                    step(batch)
                return (time.perf_counter() - start) / config.steps_per_block

            return block

        hooked_times, after_times, ddp_times = rotate(
            [timed(hooked_step), timed(after_step), timed(ddp_step)], rounds=config.rounds
        )
    name = f"MLP {'-'.join(map(str, config.widths))}, batch {config.batch}/rank, wall time"
    cases = []
    for label, ours, theirs, target in (
        (f"allreduce_grads (hooks) vs ddp: {name}", hooked_times, ddp_times, TARGET),
        (f"allreduce_grads before the hooks vs ddp: {name}", after_times, ddp_times, None),
        (f"allreduce_grads hooks vs before: {name}", hooked_times, after_times, None),
    ):
        low, high = bootstrap_median([a / b for a, b in zip(ours, theirs, strict=True)])
        notes = f"median ratio 95% bootstrap interval {low:.3f} .. {high:.3f}"
        cases.append(compare(label, "s/step", ours, theirs, target=target, notes=notes))
    return cases


def run(quick: bool = False) -> Result:
    config = Config(rounds=3) if quick else Config()
    cases = sg.launch(on_rank, sg.ddp_spawn(), devices=RANKS, args=(config,))[0]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={**config.__dict__, "ranks": RANKS, "backend": "gloo"},
        cases=cases,
        quick=quick,
    )
