"""fsdp_step: steps per second of a ``sg.fsdp_spawn()`` loop vs hand-written ``fully_shard``.

One launch of two gloo ranks. On each rank, models with the same weights:
one sharded by ``strategy.wrap``, the others sharded by hand with
``fully_shard`` on every Linear and then the root, over the same device mesh.
Blocks of steps of each alternate, so both see the same machine, the same
process group and the same warm caches; rank 0's timings are reported.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave

NAME = "fsdp_step"
DESCRIPTION = "Time per FSDP step on 2 gloo ranks: sg.fsdp_spawn() vs plain fully_shard."
TARGET = 1.02
RANKS = 2


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (256, 1024, 1024, 256)
    batch: int = 32  # per rank
    steps_per_block: int = 5  # short blocks: load changes hit both sides alike
    rounds: int = 40


def timed_block(
    step: steps.Step, batch: steps.Batch, calls: int, group: dist.ProcessGroup
) -> float:
    dist.barrier(group)  # both ranks start the block together
    start = time.perf_counter()
    for _ in range(calls):
        step(batch)
    return (time.perf_counter() - start) / calls


def shard_by_hand(module: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """What a hand-written FSDP2 loop does: every Linear, then the root."""
    from torch.distributed.fsdp import fully_shard

    for child in module.modules():
        if isinstance(child, torch.nn.Linear):
            fully_shard(child, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> dict[str, list[float]]:
    """Body of each rank: time the strategy's FSDP against a hand-made one, block by block.

    A second hand-made model, timed against the first in the same way, gives
    the A/A control: the ratio that noise alone produces.
    """
    assert ctx.group is not None
    group, mesh = ctx.group, ctx.extras["mesh"]
    with fixed_threads(THREADS):
        # contenders builds the plain copy first, as ddp_step does: build order biases both alike.
        ours, plain, control = steps.contenders(
            strategy,
            ctx,
            lambda: steps.mlp(*config.widths),
            wrap_by_hand=lambda module: shard_by_hand(module, mesh),
        )
        widths = config.widths
        batch = steps.random_batch(config.batch, widths[0], widths[-1], seed=1 + ctx.rank)
        calls = config.steps_per_block
        timings: dict[str, list[float]] = {}
        for label, first in (("stratagem", ours), ("control", control)):
            timings[label], timings[f"plain vs {label}"] = interleave(
                lambda f=first: timed_block(f, batch, calls, group),
                lambda: timed_block(plain, batch, calls, group),
                rounds=config.rounds,
            )
    return timings


def run(quick: bool = False) -> Result:
    config = Config(rounds=4) if quick else Config()
    strategy = sg.fsdp_spawn(shard_when=sg.every_module_of(torch.nn.Linear), device="cpu")
    start = time.perf_counter()
    timings = sg.launch(on_rank, strategy, devices=RANKS, args=(config,))[0]
    elapsed = time.perf_counter() - start
    name = f"MLP {'-'.join(map(str, config.widths))}, batch {config.batch}/rank, {RANKS} ranks"
    cases = [
        compare(
            name,
            "s/step",
            timings["stratagem"],
            timings["plain vs stratagem"],
            target=TARGET,
            notes=f"{1 / statistics.median(timings['stratagem']):.1f} vs "
            f"{1 / statistics.median(timings['plain vs stratagem']):.1f} steps/s",
        ),
        compare(
            f"{name}: A/A control, plain vs plain",
            "s/step",
            timings["control"],
            timings["plain vs control"],
        ),
    ]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={**asdict(config), "ranks": RANKS, "backend": "gloo", "launch_seconds": elapsed},
        cases=cases,
        quick=quick,
    )
