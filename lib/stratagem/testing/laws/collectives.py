"""Laws of the collective fields: reduce, gather, broadcast, barrier."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from stratagem.errors import UsageError
from stratagem.fields import ReduceOp
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import LawViolation, max_difference, run_on, same, summarize
from stratagem.testing.world import World

__all__ = [
    "PerRank",
    "check_broadcast",
    "check_gather",
    "check_reduce",
    "check_reduce_idempotent",
    "check_single_rank_identities",
]

PerRank = Sequence[torch.Tensor]
"""One tensor per rank, in rank order: what rank ``r`` passes to the collective is ``values[r]``."""


def _world_size(values: PerRank, world: World | None) -> int:
    if world is not None and world.world_size != len(values):
        raise UsageError(
            f"law input has {len(values)} per-rank values but the World has {world.world_size} "
            "ranks; pass one value per rank."
        )
    return len(values)


def _placed(value: torch.Tensor, ctx: Any) -> list[tuple[str, torch.Tensor]]:
    """Return the value as given and, where the strategy trains elsewhere, on its device.

    On a GPU world a collective carries both: CPU tensors over the CPU group beside
    the world's (`stratagem.collectives.host_group`), device tensors over the world's.
    """
    placed = [(str(value.device), value)]
    if torch.device(ctx.device) != value.device:
        placed.append((str(ctx.device), value.to(ctx.device)))
    return placed


def _tolerance(dtype: torch.dtype, expected: torch.Tensor, world_size: int) -> float:
    if not dtype.is_floating_point or expected.numel() == 0:
        return 0.0
    # The backend sums in the tensor's own dtype: allow a rounding per added rank.
    return float(torch.finfo(dtype).eps) * float(expected.abs().max()) * world_size


def _expected(values: PerRank, op: str) -> torch.Tensor:
    stacked = torch.stack([v.double() for v in values])
    if op == "sum":
        return stacked.sum(0)
    if op == "mean":
        return stacked.mean(0)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def _reduce_rank(
    strategy: StrategyLike, ctx: Any, values: PerRank, op: ReduceOp, times: int
) -> list[tuple[str, list[torch.Tensor], bool]]:
    """Reduce this rank's value ``times`` times over (each result again), wherever it is placed.

    Returns, per placement: where, each reduction's result, and whether the input is unchanged.
    """
    out = []
    for where, mine in _placed(values[ctx.rank], ctx):
        before, results = mine.clone(), [mine]
        for _ in range(times):
            results.append(strategy.reduce(results[-1], op, ctx))
        out.append((where, results[1:], torch.equal(mine, before)))
    return out


def check_reduce(
    strategy: StrategyLike, values: PerRank, op: ReduceOp, *, world: World | None = None
) -> None:
    """Law ``reduce-arithmetic``: rank ``r`` reducing ``values[r]`` gets ``op`` over all values.

    Also: the result keeps the input's dtype and shape, and the input is not modified.

    Args:
        strategy: the strategy under test.
        values: one tensor per rank, all of one shape and dtype.
        op: the reduction.
        world: a `World` with ``len(values)`` ranks (one is started when omitted).

    Raises:
        LawViolation: a rank's result differs from the arithmetic.
    """
    world_size = _world_size(values, world)
    results = run_on(world, world_size, _reduce_rank, strategy, list(values), op, 1)
    expected = _expected(values, op)
    inputs = f"op={op!r}, values={summarize(list(values))}"
    for rank, (where, [result], unchanged) in (
        (rank, placed) for rank, per_rank in enumerate(results) for placed in per_rank
    ):
        if not unchanged:
            raise LawViolation(
                "reduce-leaves-input",
                strategy,
                inputs,
                f"rank {rank}'s input (on {where}) was modified",
            )
        dtype = values[rank].dtype
        if result.dtype != dtype or result.shape != values[rank].shape:
            raise LawViolation(
                "reduce-arithmetic",
                strategy,
                inputs,
                f"rank {rank} returned {summarize(result)} (input on {where}), expected dtype "
                f"{dtype} and shape "
                f"{tuple(values[rank].shape)}",
            )
        target = expected.to(dtype) if not dtype.is_floating_point else expected
        difference = max_difference(result, target)
        if not difference <= _tolerance(dtype, expected, world_size):
            raise LawViolation(
                "reduce-arithmetic",
                strategy,
                inputs,
                f"rank {rank} returned {summarize(result)} (input on {where}), but {op} over the "
                "ranks is "
                f"{summarize(target.to(dtype))} (max difference {difference:g})",
            )


def check_reduce_idempotent(
    strategy: StrategyLike, values: PerRank, op: ReduceOp, *, world: World | None = None
) -> None:
    """Law ``reduce-idempotent``: reducing a reduced value again (mean, max, min) changes nothing.

    Raises:
        UsageError: ``op`` is ``"sum"`` (summing twice multiplies by the world size).
        LawViolation: the second reduction changed the value.
    """
    if op == "sum":
        raise UsageError("check_reduce_idempotent: 'sum' is not idempotent; use mean, max or min.")
    world_size = _world_size(values, world)
    results = run_on(world, world_size, _reduce_rank, strategy, list(values), op, 2)
    for rank, (_, [once, twice], _) in ((r, got) for r, gots in enumerate(results) for got in gots):
        difference = max_difference(once, twice)
        if not difference <= _tolerance(once.dtype, once.double(), world_size):
            raise LawViolation(
                "reduce-idempotent",
                strategy,
                f"op={op!r}, values={summarize(list(values))}",
                f"rank {rank}: reducing {summarize(once)} again gave {summarize(twice)}",
            )


def _gather_rank(
    strategy: StrategyLike, ctx: Any, values: PerRank
) -> list[tuple[str, torch.Tensor]]:
    return [(where, strategy.gather(mine, ctx)) for where, mine in _placed(values[ctx.rank], ctx)]


def check_gather(strategy: StrategyLike, values: PerRank, *, world: World | None = None) -> None:
    """Law ``gather-order``: every rank gets ``stack(values)``: rank order, a new first dimension.

    Raises:
        LawViolation: a rank's result has the wrong shape, order or values.
    """
    world_size = _world_size(values, world)
    expected = torch.stack(list(values))
    results = run_on(world, world_size, _gather_rank, strategy, list(values))
    for rank, (where, result) in ((r, got) for r, gots in enumerate(results) for got in gots):
        if result.shape != expected.shape or not same(result, expected):
            raise LawViolation(
                "gather-order",
                strategy,
                f"values={summarize(list(values))}",
                f"rank {rank} got {summarize(result)} (input on {where}), expected "
                f"{summarize(expected)} "
                "(row r must be rank r's tensor)",
            )


def _broadcast_rank(strategy: StrategyLike, ctx: Any, values: PerRank) -> list[Any]:
    out = []
    for where, mine in _placed(values[ctx.rank], ctx):
        for src in range(ctx.world_size):
            tensor = strategy.broadcast(mine, ctx, src=src)
            obj = strategy.broadcast({"from": ctx.rank, "sizes": [ctx.rank] * 2}, ctx, src=src)
            out.append((where, src, tensor, obj))
    strategy.barrier(ctx)
    return out


def check_broadcast(strategy: StrategyLike, values: PerRank, *, world: World | None = None) -> None:
    """Law ``broadcast-from-every-source``: every rank gets ``src``'s tensor and object.

    Raises:
        LawViolation: a rank received something other than what ``src`` sent.
    """
    world_size = _world_size(values, world)
    for rank, per_source in enumerate(
        run_on(world, world_size, _broadcast_rank, strategy, list(values))
    ):
        for where, src, tensor, obj in per_source:
            if not same(tensor, values[src]) or obj != {"from": src, "sizes": [src] * 2}:
                raise LawViolation(
                    "broadcast-from-every-source",
                    strategy,
                    f"src={src}, values={summarize(list(values))} (sent from {where})",
                    f"rank {rank} received {summarize(tensor)} and {obj!r}",
                )


def _identities_rank(
    strategy: StrategyLike, ctx: Any, value: torch.Tensor
) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for where, mine in _placed(value, ctx):
        out += [
            (f"reduce {op} (on {where})", strategy.reduce(mine, op, ctx))
            for op in ("sum", "max", "min") + (("mean",) if value.is_floating_point() else ())
        ]
        out.append((f"gather (on {where})", strategy.gather(mine, ctx)[0]))
        out.append((f"broadcast (on {where})", strategy.broadcast(mine, ctx, src=0)))
    strategy.barrier(ctx)
    return out


def check_single_rank_identities(
    strategy: StrategyLike, value: torch.Tensor, *, world: World | None = None
) -> None:
    """Law ``single-rank-identities``: on a world of one, every collective returns its input.

    Raises:
        UsageError: ``world`` has more than one rank.
        LawViolation: a collective changed the value.
    """
    if world is not None and world.world_size != 1:
        raise UsageError("check_single_rank_identities needs a World of one rank.")
    [results] = run_on(world, 1, _identities_rank, strategy, value)
    for what, result in results:
        if not same(result, value):
            raise LawViolation(
                "single-rank-identities",
                strategy,
                f"value={summarize(value)}",
                f"{what} on one rank returned {summarize(result)}",
            )
