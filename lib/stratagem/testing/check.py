"""`check_all`: every law that applies to a strategy, in one call."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from stratagem.combinators._base import applied
from stratagem.combinators.precision import PrecisionSetup
from stratagem.fields import REDUCE_OPS, ReduceOp
from stratagem.strategy import StrategyLike
from stratagem.testing import laws
from stratagem.testing.world import World

__all__ = ["check_all", "default_module"]

IDEMPOTENT_OPS: tuple[ReduceOp, ...] = ("mean", "max", "min")


def default_module() -> torch.nn.Module:
    """Build the small MLP the laws use when the caller gives none (seeded, so runs repeat)."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    finally:
        torch.random.set_rng_state(generator_state)


@contextmanager
def _world(world: World | None, world_size: int) -> Iterator[World]:
    if world is not None:
        yield world
        return
    with World(world_size) as fresh:
        yield fresh


def check_all(
    strategy: StrategyLike,
    *,
    world_size: int = 2,
    world: World | None = None,
    module: torch.nn.Module | None = None,
    batch: torch.Tensor | None = None,
    portable_to: StrategyLike | None = None,
    directory: str | os.PathLike[str] | None = None,
    tolerance: float = 1e-6,
) -> None:
    """Check every law that applies to ``strategy`` on a `World` of ``world_size`` ranks.

    Collectives (arithmetic for each op, idempotence, gather order, broadcast
    from every source), wrap, the data-parallel step, accumulation,
    ``no_sync`` (on more than one rank), purity, autocast in ``step`` when the
    strategy has a mixed precision, and the checkpoint round trip
    (portable to ``portable_to`` when given). On one rank, the collectives must
    be identities.

    Args:
        strategy: the record to check (its fields must be picklable: module-level
            functions or attrs callables).
        world_size: ranks to start when ``world`` is omitted.
        world: a running `World` to reuse (fast across many calls).
        module: the module to train (default: a small seeded MLP with 4 inputs).
        batch: its input batch, length divisible by the world size (default: 4 rows a rank).
        portable_to: a single-process strategy that must load the checkpoints.
        directory: where the checkpoint law writes (a temporary directory when omitted).
        tolerance: allowed parameter difference against plain PyTorch.

    Raises:
        LawViolation: the first law broken, with the input that broke it.
    """
    with _world(world, world_size) as running:
        size = running.world_size
        model = module if module is not None else default_module()
        data = (
            batch
            if batch is not None
            else torch.randn(4 * size, 4, generator=torch.Generator().manual_seed(1))
        )
        values = [torch.tensor([1.5 * r - 2.0, 4.0 + r, -float(r)]) for r in range(size)]
        if size == 1:
            laws.check_single_rank_identities(strategy, values[0], world=running)
        for op in REDUCE_OPS:
            laws.check_reduce(strategy, values, op, world=running)
        laws.check_reduce(strategy, [v.long() for v in values], "max", world=running)
        for op in IDEMPOTENT_OPS:
            laws.check_reduce_idempotent(strategy, values, op, world=running)
        laws.check_gather(strategy, values, world=running)
        laws.check_broadcast(strategy, values, world=running)
        laws.check_wrap(strategy, model, data, world=running, tolerance=tolerance)
        laws.check_data_parallel_step(strategy, model, data, world=running, tolerance=tolerance)
        laws.check_accumulation(strategy, model, data, world=running, tolerance=tolerance)
        if size > 1:
            laws.check_no_sync(strategy, model, data, world=running)
        laws.check_purity(strategy, model, data, world=running)
        precision = applied(strategy, PrecisionSetup)
        if precision is not None and precision.precision.endswith("-mixed"):
            dtype = torch.bfloat16 if precision.precision.startswith("bf16") else torch.float16
            laws.check_step_autocast(strategy, model, data, dtype, world=running)
        laws.check_checkpoint_round_trip(
            strategy, model, data, world=running, portable_to=portable_to, directory=directory
        )
