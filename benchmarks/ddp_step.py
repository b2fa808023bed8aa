"""ddp_step: steps per second of a ``sg.ddp_spawn()`` loop vs hand-written DistributedDataParallel.

One launch of two gloo ranks. On each rank, three models with the same
weights: one wrapped by ``strategy.wrap``, two wrapped by hand in
``DistributedDataParallel`` over the same process group (the second for the
A/A control). Blocks of steps alternate, so all see the same machine, the
same process group and the same warm caches; rank 0's timings are reported.

A second pair of cases times gradient accumulation: four micro-batches per
optimizer step, the first three under ``strategy.no_sync`` (by hand:
``DistributedDataParallel.no_sync``), so one all-reduce per four backwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave

NAME = "ddp_step"
DESCRIPTION = "Time per DDP step on 2 gloo ranks: sg.ddp_spawn() vs plain DistributedDataParallel."
TARGET = 1.02
RANKS = 2


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (256, 1024, 1024, 256)
    batch: int = 32  # per rank
    steps_per_block: int = 5  # short blocks: load changes hit both sides alike
    rounds: int = 40
    micro_batches: int = 4  # per optimizer step, in the accumulation cases


def accumulating_steps(
    strategy: sg.StrategyLike,
    ctx: sg.Context,
    models: tuple[torch.nn.Module, DistributedDataParallel],
    micro_batches: int,
) -> tuple[steps.Step, steps.Step]:
    """One optimizer step over ``micro_batches`` backwards, through the strategy and by hand."""
    ours_model, plain_model = models
    ours_optimizer, plain_optimizer = steps.sgd(ours_model), steps.sgd(plain_model)

    def ours(batch: steps.Batch) -> None:
        for index in range(micro_batches):
            with contextlib.ExitStack() as stack:
                if index < micro_batches - 1:
                    stack.enter_context(strategy.no_sync(ours_model, ctx))
                loss = strategy.step(ours_model, batch, ctx, forward=steps.mse)
                strategy.backward(loss / micro_batches, ours_model, ctx)
        strategy.update(ours_optimizer, ours_model, ctx)

    def plain(batch: steps.Batch) -> None:
        inputs, targets = (tensor.to(ctx.device, non_blocking=True) for tensor in batch)
        for index in range(micro_batches):
            with plain_model.no_sync() if index < micro_batches - 1 else contextlib.nullcontext():
                loss = steps.mse(plain_model, (inputs, targets))
                (loss / micro_batches).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad(set_to_none=True)

    return ours, plain


def timed_block(
    step: steps.Step, batch: steps.Batch, calls: int, group: dist.ProcessGroup
) -> tuple[float, float]:
    """Wall time and CPU time per step, over ``calls`` steps that both ranks start together."""
    dist.barrier(group)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        step(batch)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> list[Case]:
    """Body of each rank: time the strategy's DDP against a hand-made one, block by block.

    Steps/s is a wall-clock measure; CPU time (this process and its gloo
    threads) is reported beside it because, unlike wall time, it does not
    count the moments another process on a shared machine holds the core.
    """
    assert ctx.group is not None
    group = ctx.group
    with fixed_threads(THREADS):
        ours, plain, control = steps.contenders(
            strategy,
            ctx,
            lambda: steps.mlp(*config.widths),
            wrap_by_hand=lambda module: DistributedDataParallel(
                module.to(ctx.device), process_group=group
            ),
        )
        widths = config.widths
        batch = steps.random_batch(config.batch, widths[0], widths[-1], seed=1 + ctx.rank)

        def timed(step: steps.Step) -> Callable[[], tuple[float, float]]:
            return lambda: timed_block(step, batch, config.steps_per_block, group)

        name = (
            f"MLP {'-'.join(map(str, widths))}, batch {config.batch}/rank, {ctx.world_size} ranks"
        )
        cases = []
        for label, first in ((name, ours), (f"{name}: A/A control, plain vs plain", control)):
            firsts, plains = interleave(timed(first), timed(plain), rounds=config.rounds)
            for index, clock in enumerate(("wall", "CPU")):
                cases.append(
                    compare(
                        f"{label}, {clock} time",
                        "s/step",
                        [times[index] for times in firsts],
                        [times[index] for times in plains],
                    )
                )
        cases.extend(accumulation_cases(strategy, ctx, config, batch, name))
        return cases


def accumulation_cases(
    strategy: sg.StrategyLike, ctx: sg.Context, config: Config, batch: steps.Batch, name: str
) -> list[Case]:
    """Accumulation with no_sync, stratagem vs by hand, wall and CPU time per optimizer step."""
    assert ctx.group is not None
    group = ctx.group
    plain_model, ours_model = steps.copies(lambda: steps.mlp(*config.widths), 2)
    plain_model = DistributedDataParallel(plain_model.to(ctx.device), process_group=group)
    ours, plain = accumulating_steps(
        strategy, ctx, (strategy.wrap(ours_model, ctx), plain_model), config.micro_batches
    )
    calls = max(1, config.steps_per_block // 2)
    firsts, plains = interleave(
        lambda: timed_block(ours, batch, calls, group),
        lambda: timed_block(plain, batch, calls, group),
        rounds=config.rounds,
    )
    label = (
        f"{name}, accumulation: {config.micro_batches} micro-batches, no_sync on all but the last"
    )
    return [
        compare(
            f"{label}, {clock} time",
            "s/optimizer step",
            [times[index] for times in firsts],
            [times[index] for times in plains],
        )
        for index, clock in enumerate(("wall", "CPU"))
    ]


def rates(case: Case) -> str:
    return f"{1 / case.stratagem.median:.1f} vs {1 / case.plain.median:.1f} per s"


def run(quick: bool = False) -> Result:
    config = Config(rounds=4) if quick else Config()
    start = time.perf_counter()
    cases = sg.launch(on_rank, sg.ddp_spawn(), devices=RANKS, args=(config,))[0]
    elapsed = time.perf_counter() - start
    cases = [
        dataclasses.replace(case, target=TARGET, notes=rates(case))
        if "wall time" in case.name and "A/A control" not in case.name
        else case
        for case in cases
    ]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            **dataclasses.asdict(config),
            "ranks": RANKS,
            "backend": "gloo",
            "launch_seconds": elapsed,
        },
        cases=cases,
        quick=quick,
    )
