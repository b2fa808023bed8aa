"""compiled_step: ``compiled(single_device())`` against eager ``single_device()``, medium model.

The ratio is compiled / eager time per step (below 1: compile helps). The
first compiled call compiles (seconds); it happens in the untimed warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave, per_call

NAME = "compiled_step"
DESCRIPTION = "Time per step, single device: compiled(single_device()) vs single_device(), eager."


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (512, 2048, 512)
    batch: int = 64
    steps_per_block: int = 5
    rounds: int = 20


def run(quick: bool = False) -> Result:
    config = Config(rounds=3) if quick else Config()
    eager_strategy = sg.single_device("cpu")
    compiled_strategy = sg.compiled(eager_strategy)
    ctx = eager_strategy.setup(sg.Env())
    with fixed_threads(THREADS):
        eager_model, compiled_model = steps.copies(lambda: steps.mlp(*config.widths), 2)
        eager_model = eager_strategy.wrap(eager_model, ctx)
        compiled_model = compiled_strategy.wrap(compiled_model, ctx)
        batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1])
        eager = steps.stratagem_step(eager_strategy, ctx, eager_model, steps.sgd(eager_model))
        fast = steps.stratagem_step(
            compiled_strategy, ctx, compiled_model, steps.sgd(compiled_model)
        )
        compiled_times, eager_times = interleave(
            per_call(lambda: fast(batch), config.steps_per_block),
            per_call(lambda: eager(batch), config.steps_per_block),
            rounds=config.rounds,
            warmup=2,
        )
    name = f"MLP {'-'.join(map(str, config.widths))}, batch {config.batch}, CPU time"
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={**config.__dict__, "torch": torch.__version__},
        cases=[compare(f"compiled vs eager: {name}", "s/step", compiled_times, eager_times)],
        quick=quick,
    )
