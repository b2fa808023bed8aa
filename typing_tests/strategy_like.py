"""Type-checked only (mypy strict): a user's own record type is a StrategyLike."""

from __future__ import annotations

from typing import NamedTuple

import torch

import stratagem as sg
from stratagem.fields import (
    BackwardFn,
    BarrierFn,
    BroadcastFn,
    GatherFn,
    LaunchFn,
    LoadFn,
    NoSyncFn,
    ReduceFn,
    SaveFn,
    SetupFn,
    ShardFn,
    StepFn,
    TeardownFn,
    UpdateFn,
    WrapFn,
)


class MyStrategy(NamedTuple):
    name: str
    launch: LaunchFn
    setup: SetupFn
    wrap: WrapFn
    step: StepFn
    backward: BackwardFn
    update: UpdateFn
    no_sync: NoSyncFn
    reduce: ReduceFn
    gather: GatherFn
    broadcast: BroadcastFn
    barrier: BarrierFn
    shard: ShardFn
    save: SaveFn
    load: LoadFn
    teardown: TeardownFn


def from_builtin(base: sg.Strategy) -> MyStrategy:
    return MyStrategy(
        base.name,
        base.launch,
        base.setup,
        base.wrap,
        base.step,
        base.backward,
        base.update,
        base.no_sync,
        base.reduce,
        base.gather,
        base.broadcast,
        base.barrier,
        base.shard,
        base.save,
        base.load,
        base.teardown,
    )


def train(strategy: sg.StrategyLike, ctx: sg.Context) -> int:
    return ctx.world_size


results: list[int] = sg.launch(train, from_builtin(sg.single_device()))
same: list[int] = sg.launch(train, sg.single_device())


def my_reduce(tensor: torch.Tensor, op: sg.ReduceOp, ctx: sg.Context) -> torch.Tensor:
    return tensor


checked_reduce: ReduceFn = my_reduce
