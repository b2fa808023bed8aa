"""pipeline_step: time per 1F1B step of ``pipeline()`` vs the same schedule written by hand.

One launch of two gloo ranks. On each rank, three copies of one MLP split in
two stages: one wrapped by ``strategy.wrap`` and trained with the loop of
``ddp()`` (step, backward, update), two split by hand into a
``PipelineStage`` each and run by a hand-made ``Schedule1F1B`` over the same
process group (the second for the A/A control). Blocks of steps alternate,
so all see the same machine and the same group; rank 0's timings are
reported. The hand-written step broadcasts the mean loss from the last
stage, as ``pipeline()``'s step does so that every rank runs the same loop;
a second case compares with a hand-written step that keeps the loss on the
last stage only, which shows what that broadcast costs.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave

NAME = "pipeline_step"
DESCRIPTION = "Time per 1F1B step on 2 gloo ranks: pipeline() vs a hand-made Schedule1F1B."
TARGET = 1.02
RANKS = 2


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (256, 1024, 1024, 1024, 256)
    batch: int = 32
    microbatches: int = 4
    steps_per_block: int = 5
    rounds: int = 30


def stages_of(widths: tuple[int, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The MLP's submodule paths, split in two halves at a ReLU."""
    count = 2 * (len(widths) - 1) - 1  # Linear, ReLU, Linear, ..., Linear
    middle = count // 2 + (count // 2) % 2  # after a ReLU: each half starts with a Linear
    return tuple(map(str, range(middle))), tuple(map(str, range(middle, count)))


def by_hand(module: torch.nn.Module, ctx: sg.Context, config: Config, share_loss: bool) -> Any:
    """Split ``module`` as the strategy does and build the schedule: what a user writes.

    With ``share_loss``, the last stage broadcasts the mean loss to the other
    rank after each step, as a loop that is the same on every rank needs.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    group = ctx.mesh["pp"].get_group()
    rank = dist.get_rank(group)
    paths = stages_of(config.widths)[rank]
    part = torch.nn.Sequential(*(module.get_submodule(p) for p in paths)).to(ctx.device)
    stage = PipelineStage(part, rank, RANKS, ctx.device, group=group)
    schedule = Schedule1F1B(
        stage, n_microbatches=config.microbatches, loss_fn=torch.nn.functional.mse_loss
    )
    optimizer = torch.optim.SGD(part.parameters(), lr=1e-4)

    def step(batch: steps.Batch) -> None:
        inputs, targets = (t.to(ctx.device) for t in batch)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs)
            loss = torch.empty(())
        else:
            schedule.step(target=targets, losses=losses)
            loss = torch.stack([item.detach() for item in losses]).mean()
        if share_loss:
            dist.broadcast(loss, src=dist.get_global_rank(group, RANKS - 1), group=group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed_block(step: Any, batch: steps.Batch, calls: int, group: Any) -> tuple[float, float]:
    dist.barrier(group)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        step(batch)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> list[Case]:
    """Body of each rank: the strategy's pipeline against two made by hand, block by block."""
    group = ctx.group
    with fixed_threads(THREADS):
        ours_module, plain_module, bare_module, control_module = steps.copies(
            lambda: steps.mlp(*config.widths), 4
        )
        model = strategy.wrap(ours_module, ctx)
        optimizer = steps.sgd(model)

        def ours(batch: steps.Batch) -> None:
            loss = strategy.step(model, batch, ctx, forward=steps.mse)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)

        plain = by_hand(plain_module, ctx, config, share_loss=True)
        bare = by_hand(bare_module, ctx, config, share_loss=False)
        control = by_hand(control_module, ctx, config, share_loss=True)
        widths = config.widths
        batch = steps.random_batch(config.batch, widths[0], widths[-1], seed=1)
        name = (
            f"MLP {'-'.join(map(str, widths))} in 2 stages, batch {config.batch}, "
            f"{config.microbatches} micro-batches, 1F1B"
        )
        cases = []
        contests = (
            (name, ours, plain),
            (f"{name}: vs by hand without the loss on every rank", ours, bare),
            (f"{name}: A/A control, plain vs plain", control, plain),
        )
        for label, first, second in contests:
            firsts, plains = interleave(
                lambda first=first: timed_block(first, batch, config.steps_per_block, group),
                lambda second=second: timed_block(second, batch, config.steps_per_block, group),
                rounds=config.rounds,
            )
            for index, clock in enumerate(("wall", "CPU")):
                cases.append(
                    compare(
                        f"{label}, {clock} time",
                        "s/step",
                        [times[index] for times in firsts],
                        [times[index] for times in plains],
                    )
                )
        return cases


def run(quick: bool = False) -> Result:
    config = Config(rounds=4) if quick else Config()
    strategy = sg.spawned(
        sg.pipeline(
            stages=stages_of(config.widths), schedule="1f1b", microbatches=config.microbatches
        )
    )
    start = time.perf_counter()
    cases = sg.launch(on_rank, strategy, devices=RANKS, args=(config,))[0]
    elapsed = time.perf_counter() - start
    cases = [
        dataclasses.replace(
            case,
            target=TARGET,
            notes=f"{1 / case.stratagem.median:.1f} vs {1 / case.plain.median:.1f} steps/s",
        )
        if "wall time" in case.name and ": " not in case.name
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
