"""`check_all`: every law that applies to a strategy, in one call, with a report of what ran."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import torch

from stratagem.combinators.accumulation import AccumulationSetup, resolved_every
from stratagem.combinators.checkpointing import CheckpointWrap
from stratagem.combinators.clipping import ClipUpdate
from stratagem.combinators.compiled import CompiledWrap
from stratagem.combinators.precision import PrecisionSetup
from stratagem.errors import UsageError, describe
from stratagem.fields import REDUCE_OPS, ReduceOp
from stratagem.precisions import AUTOCAST_DTYPES
from stratagem.strategy import StrategyLike, applied
from stratagem.testing import laws
from stratagem.testing.contract import Contract
from stratagem.testing.laws._core import squares_mean
from stratagem.testing.laws.options import Forward, OptimizerFactory, adamw, sgd_momentum
from stratagem.testing.laws.parallel import backward_in_step
from stratagem.testing.modules import default_modules, mlp
from stratagem.testing.tolerances import compute_dtype, mixed_precision
from stratagem.testing.world import World

__all__ = ["LAWS", "Report", "check_all", "default_module"]

IDEMPOTENT_OPS: tuple[ReduceOp, ...] = ("mean", "max", "min")

LAWS: tuple[str, ...] = (
    "single-rank-identities",
    "reduce-arithmetic",
    "reduce-idempotent",
    "gather-order",
    "broadcast-from-every-source",
    "wrap-preserves",
    "data-parallel-step",
    "accumulation",
    "no-sync",
    "ranks-in-sync",
    "purity",
    "step-autocast",
    "precision-close-to-float32",
    "float32-master-weights",
    "combinator-arithmetic",
    "checkpoint-round-trip",
    "checkpoint-resume",
    "checkpoint-strict",
    "shard-partition",
)
"""The laws `check_all` runs, by the names ``skip`` takes and violations carry."""


def _default_batch(strategy: StrategyLike, world_size: int) -> torch.Tensor:
    """Four rows a rank, or more so that an accumulation window of k micro-batches divides them."""
    window = applied(strategy, AccumulationSetup)
    rows = 4 if window is None else math.lcm(4, resolved_every(window.every, world_size))
    return torch.randn(rows * world_size, 4, generator=torch.Generator().manual_seed(1))


def _has_arithmetic(strategy: StrategyLike) -> bool:
    """Whether a combinator of ``strategy`` does arithmetic of its own (and not a pipeline)."""
    if backward_in_step(strategy):
        return False
    # Compiling and recomputing activations change no arithmetic: their oracle is the plain step.
    own = (AccumulationSetup, ClipUpdate, PrecisionSetup, CompiledWrap, CheckpointWrap)
    return any(applied(strategy, kind) is not None for kind in own)


def default_module() -> torch.nn.Module:
    """Build the small MLP the laws use when the caller gives none (seeded, so runs repeat)."""
    return mlp()


@attrs.frozen
class Report:
    """What `check_all` checked: the laws that passed, and those skipped with their reasons."""

    strategy: str
    passed: tuple[str, ...]
    skipped: Mapping[str, str]

    def __str__(self) -> str:
        lines = [f"check_all({self.strategy!r}): {len(self.passed)} laws passed"]
        lines += [f"  passed: {law}" for law in self.passed]
        lines += [f"  skipped: {law} ({reason})" for law, reason in self.skipped.items()]
        return "\n".join(lines)


@contextmanager
def _world(world: World | None, world_size: int) -> Iterator[World]:
    if world is not None:
        yield world
        return
    with World(world_size) as fresh:
        yield fresh


def _check_skip(skip: object) -> dict[str, str]:
    if skip is None:
        return {}
    if not isinstance(skip, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and v.strip() for k, v in skip.items()
    ):
        raise UsageError(
            f"check_all: 'skip' must map law names to the reason each does not apply "
            f"(got {describe(skip)}), e.g. skip={{'no-sync': 'syncs every 4 updates'}}."
        )
    unknown = sorted(set(skip) - set(LAWS))
    if unknown:
        raise UsageError(
            f"check_all: 'skip' names {unknown}, which are not laws; the laws are {list(LAWS)}."
        )
    return dict(skip)


def check_all(
    strategy: StrategyLike,
    *,
    world_size: int = 2,
    world: World | None = None,
    module: torch.nn.Module | None = None,
    modules: Mapping[str, torch.nn.Module] | None = None,
    batch: Any = None,
    forward: Forward | None = None,
    optimizers: Sequence[OptimizerFactory] = (sgd_momentum, adamw),
    reference: StrategyLike | None = None,
    contract: Contract | None = None,
    skip: Mapping[str, str] | None = None,
    portable_to: StrategyLike | None = None,
    directory: str | os.PathLike[str] | None = None,
    tolerance: float | None = None,
) -> Report:
    """Check every law that applies to ``strategy`` on a `World` of ``world_size`` ranks.

    Collectives (arithmetic for each op, idempotence, gather order, broadcast
    from every source), wrap, the data-parallel step and accumulation against
    the derived reference (several steps, each optimizer, each module: by
    default a plain MLP, one with BatchNorm and one with tied weights),
    ``no_sync`` (on more than one rank), purity, autocast in ``step`` when the
    strategy has a mixed precision, training close to float32 when it computes
    in another dtype (and float32 master weights under a mixed precision), the
    arithmetic of accumulation, clipping and precision against plain torch by
    hand (`laws.check_combinator_arithmetic`), the checkpoint round trip
    (portable to ``portable_to`` when given), a resume with training and a
    save in flight between save and load, strict loading, and the partition
    that ``shard`` deals. On one rank, the collectives must be identities.

    Tolerances follow the precision the stack applied (`with_precision`, or an
    ``fsdp()`` ``mp_policy``): each law derives its own
    (`stratagem.testing.tolerances`), so a precision stack needs no `Contract`
    for them. Results are compared on the CPU whatever device the strategy
    trains on; the data each rank trains on follows the strategy's device.

    Args:
        strategy: the record to check (its fields must be picklable: module-level
            functions or attrs callables).
        world_size: ranks to start when ``world`` is omitted.
        world: a running `World` to reuse (fast across many calls).
        module: one module to train instead of the defaults.
        modules: modules to train by name instead of the defaults (`default_modules`).
        batch: the input batch: a tensor, an ``(inputs, targets)`` tuple or a dict of
            tensors, length a multiple of the world size (default: a tensor of 4 rows a
            rank, or the least multiple of 4 that ``accumulate``'s k micro-batches divide).
        forward: a module-level function ``(module, batch) -> loss``, a mean over
            samples, given to ``step`` by every training law (default: the mean of
            the squared outputs of a tensor batch). A batch that is not a tensor
            needs one, and so does a ``pipeline(...)``, whose step computes the loss.
        optimizers: module-level factories ``parameters -> optimizer``, each used in turn
            by every law that compares training with a reference or across ranks
            (``data-parallel-step``, ``accumulation``, ``ranks-in-sync``).
        reference: the one-process strategy the training laws compare with
            (derived from ``strategy`` when it is built from stratagem's parts).
        contract: what ``strategy`` promises (`Contract`): synchronisation
            period, buffers, tolerances (derived from the precision where it
            names none).
        skip: laws that do not apply, by name, each with the reason (kept in the report).
        portable_to: a single-process strategy that must load the checkpoints.
        directory: where the checkpoint law writes (a temporary directory when omitted).
        tolerance: an absolute tolerance for the training laws (first edition's
            argument; ``contract=Contract(atol=...)`` says the same; ``rtol`` stays
            the contract's, as several steps of optimizer state need one).

    Returns:
        A `Report` of the laws that passed and those skipped, with their reasons.

    Raises:
        LawViolation: the first law broken, with the input that broke it.
        UsageError: an argument cannot test the laws (``skip`` names an unknown law, ...).
    """
    skipped = _check_skip(skip)
    terms = contract if contract is not None else Contract()
    if tolerance is not None:
        terms = attrs.evolve(terms, atol=tolerance)
    loss = forward if forward is not None else squares_mean
    trained = dict(modules) if modules is not None else default_modules()
    if module is not None:
        trained = {"module": module}
    passed: list[str] = []

    def run(law: str, check: Any, *args: Any, **kwargs: Any) -> None:
        if law in skipped:
            return
        check(*args, **kwargs)
        if law not in passed:
            passed.append(law)

    with _world(world, world_size) as running:
        size = running.world_size
        data = batch if batch is not None else _default_batch(strategy, size)
        values = [torch.tensor([1.5 * r - 2.0, 4.0 + r, -float(r)]) for r in range(size)]
        if size == 1:
            run("single-rank-identities", laws.check_single_rank_identities, strategy, values[0],
                world=running)  # fmt: skip
        for op in REDUCE_OPS:
            run("reduce-arithmetic", laws.check_reduce, strategy, values, op, world=running)
        run("reduce-arithmetic", laws.check_reduce, strategy, [v.long() for v in values], "max",
            world=running)  # fmt: skip
        for op in IDEMPOTENT_OPS:
            run("reduce-idempotent", laws.check_reduce_idempotent, strategy, values, op,
                world=running)  # fmt: skip
        run("gather-order", laws.check_gather, strategy, values, world=running)
        run("broadcast-from-every-source", laws.check_broadcast, strategy, values, world=running)
        first = next(iter(trained.values()))
        run("wrap-preserves", laws.check_wrap, strategy, first, data, world=running,
            tolerance=terms.atol, rtol=terms.rtol, forward=forward)  # fmt: skip
        training = {"world": running, "reference": reference, "contract": terms, "forward": loss}
        for model in trained.values():
            for optimizer in optimizers:
                run("data-parallel-step", laws.check_data_parallel_step, strategy, model, data,
                    optimizer=optimizer, **training)  # fmt: skip
            for optimizer in optimizers:
                run("accumulation", laws.check_accumulation, strategy, model, data,
                    optimizer=optimizer, **training)  # fmt: skip
        if size > 1:
            run("no-sync", laws.check_no_sync, strategy, first, data, world=running,
                forward=loss)  # fmt: skip
            for model in trained.values():
                for optimizer in optimizers:
                    run("ranks-in-sync", laws.check_ranks_in_sync, strategy, model, data,
                        world=running, contract=terms, optimizer=optimizer,
                        forward=loss)  # fmt: skip
        run("purity", laws.check_purity, strategy, first, data, world=running, forward=loss)
        precision = applied(strategy, PrecisionSetup)
        autocast = AUTOCAST_DTYPES.get(precision.precision) if precision is not None else None
        if autocast is not None:
            run("step-autocast", laws.check_step_autocast, strategy, first, data,
                autocast, world=running, forward=forward)  # fmt: skip
        low = compute_dtype(strategy) != torch.float32
        if low:
            run("precision-close-to-float32", laws.check_precision, strategy, first, data,
                world=running, reference=reference, contract=terms, forward=loss)  # fmt: skip
        if low and mixed_precision(strategy):
            for model in trained.values():
                run("float32-master-weights", laws.check_master_weights, strategy, model, data,
                    world=running, forward=loss)  # fmt: skip
        if (low or _has_arithmetic(strategy)) and terms.sync_every == 1:
            run("combinator-arithmetic", laws.check_combinator_arithmetic, strategy, first, data,
                world=running, contract=terms, forward=loss)  # fmt: skip
        for model in trained.values():
            run("checkpoint-round-trip", laws.check_checkpoint_round_trip, strategy, model, data,
                world=running, portable_to=portable_to, directory=directory,
                updates=terms.sync_every, contract=terms, forward=loss)  # fmt: skip
        run("checkpoint-resume", laws.check_checkpoint_resume, strategy, first, data,
            world=running, directory=directory, contract=terms, forward=loss)  # fmt: skip
        run("checkpoint-strict", laws.check_checkpoint_strict, strategy, first, world=running,
            directory=directory)  # fmt: skip
        run("shard-partition", laws.check_shard_partition, strategy, world=running)
    return Report(getattr(strategy, "name", type(strategy).__name__), tuple(passed), skipped)
