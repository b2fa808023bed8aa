"""Laws of ``save`` and ``load``: a round trip is the identity, and a checkpoint loads anywhere."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from stratagem.env import Context, Env
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import (
    LawViolation,
    first_mismatch,
    fresh_copy,
    full_parameters,
    run_on,
    shares,
    squares_mean,
    summarize,
)
from stratagem.testing.world import World

__all__ = ["check_checkpoint_round_trip"]

_PLAIN_VALUES = {"step": 3, "note": "law"}


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state_dict()["state"].values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = getattr(value, "to_local", None)
                out.append((local() if callable(local) else value).detach().cpu().clone())
    return out


def _round_trip_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, batch: torch.Tensor, path: str
) -> dict[str, Any]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: real state
    mine = shares(batch, ctx.world_size)[ctx.rank]
    strategy.backward(strategy.step(model, mine, ctx, forward=squares_mean), model, ctx)
    strategy.update(optimizer, model, ctx)
    strategy.save(path, {"model": model, "optimizer": optimizer, **_PLAIN_VALUES}, ctx)

    restored = strategy.wrap(fresh_copy(module), ctx)
    restored_optimizer = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    values = strategy.load(path, {"model": restored, "optimizer": restored_optimizer}, ctx)
    return {
        "saved": full_parameters(model),
        "loaded": full_parameters(restored),
        "saved_optimizer": _optimizer_tensors(optimizer),
        "loaded_optimizer": _optimizer_tensors(restored_optimizer),
        "values": values,
    }


@contextlib.contextmanager
def _directory(directory: str | os.PathLike[str] | None) -> Iterator[str]:
    if directory is not None:
        yield os.fspath(directory)
        return
    made = tempfile.mkdtemp(prefix="stratagem-law-")
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def check_checkpoint_round_trip(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: torch.Tensor,
    *,
    portable_to: StrategyLike | None = None,
    directory: str | os.PathLike[str] | None = None,
    world: World | None = None,
    world_size: int = 2,
) -> None:
    """Law ``checkpoint-round-trip``: load after save restores parameters, optimizer, values.

    With ``portable_to`` (e.g. ``single_device("cpu")``), law
    ``checkpoint-portable`` too: that strategy, in this process, loads the same
    checkpoint into a plain module and gets the same parameters.

    Args:
        strategy: the strategy under test.
        module: a module to train one step, save and restore.
        batch: the batch for that step (its length divisible by the world size).
        portable_to: a single-process strategy that must read the checkpoint.
        directory: where to write (a temporary directory when omitted).
        world: the `World` to run on.
        world_size: ranks to start when ``world`` is omitted.

    Raises:
        LawViolation: something saved did not come back as it was.
    """
    size = world.world_size if world is not None else world_size
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    with _directory(directory) as root:
        path = os.path.join(root, "checkpoint")
        results = run_on(world, size, _round_trip_rank, strategy, module, batch, path)
        for rank, result in enumerate(results):
            for what in ("", "_optimizer"):
                mismatch = first_mismatch(result[f"loaded{what}"], result[f"saved{what}"], 0.0)
                if mismatch is not None or not result[f"saved{what}"]:
                    thing = "optimizer state" if what else "parameter"
                    raise LawViolation(
                        "checkpoint-round-trip",
                        strategy,
                        inputs,
                        f"rank {rank}: {thing} {mismatch[0] if mismatch else 0} was not restored "
                        f"(saved {len(result[f'saved{what}'])} tensors, loaded "
                        f"{len(result[f'loaded{what}'])}; a save that drops it gives this)",
                    )
            if result["values"] != _PLAIN_VALUES:
                raise LawViolation(
                    "checkpoint-round-trip",
                    strategy,
                    inputs,
                    f"rank {rank}: load returned plain values {result['values']!r}, "
                    f"saved {_PLAIN_VALUES!r}",
                )
        if portable_to is not None:
            _check_portable(strategy, portable_to, module, path, results[0]["saved"], inputs)


def _check_portable(
    strategy: StrategyLike,
    target: StrategyLike,
    module: torch.nn.Module,
    path: str,
    saved: list[torch.Tensor],
    inputs: str,
) -> None:
    ctx: Context = target.setup(Env())
    try:
        plain = target.wrap(fresh_copy(module), ctx)
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        target.load(path, {"model": plain, "optimizer": optimizer}, ctx)
        mismatch = first_mismatch(full_parameters(plain), saved, 0.0)
    finally:
        target.teardown(ctx)
    if mismatch is not None:
        raise LawViolation(
            "checkpoint-portable",
            strategy,
            inputs,
            f"{getattr(target, 'name', target)!r} loaded parameter {mismatch[0]} with a "
            f"difference of {mismatch[1]:g}",
        )
