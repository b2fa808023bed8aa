"""Laws of ``save`` and ``load``: a round trip is the identity, and a checkpoint loads anywhere."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Unpack

import torch

from stratagem.checkpoint import directory as _checkpoint_directory
from stratagem.checkpoint.entries import per_rank
from stratagem.combinators.accumulation import AccumulationState
from stratagem.env import Context, Env
from stratagem.strategy import StrategyLike
from stratagem.testing.contract import Contract
from stratagem.testing.laws._core import (
    LawViolation,
    fresh_copy,
    holds_part,
    keyed_parameters,
    max_difference,
    own_share,
    run_on,
    summarize,
)
from stratagem.testing.laws.options import Forward, LossOptions, RunOptions, settings
from stratagem.testing.laws.state import first_difference, snapshot

__all__ = ["check_checkpoint_resume", "check_checkpoint_round_trip", "check_checkpoint_strict"]

_PLAIN_VALUES = {"step": 3, "note": "law"}


def _round_trip_rank(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    path: str,
    updates: int,
    forward: Forward,
) -> dict[str, Any]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # momentum: real state
    mine = own_share(batch, ctx)
    # Whole windows of accumulate, and (a strategy that synchronises every k updates) k of them.
    window = ctx.extras.get("accumulation")
    for _ in range(updates * (window.every if isinstance(window, AccumulationState) else 1)):
        strategy.backward(strategy.step(model, mine, ctx, forward=forward), model, ctx)
        strategy.update(optimizer, model, ctx)
    strategy.save(path, {"model": model, "optimizer": optimizer, **_PLAIN_VALUES}, ctx)

    restored = strategy.wrap(fresh_copy(module), ctx)
    restored_optimizer = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
    values = strategy.load(path, {"model": restored, "optimizer": restored_optimizer}, ctx)
    return {
        "saved": keyed_parameters(model),
        "part": holds_part(ctx),
        "state": snapshot(model, optimizer),
        "loaded_state": snapshot(restored, restored_optimizer),
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
    batch: Any,
    *,
    portable_to: StrategyLike | None = None,
    directory: str | os.PathLike[str] | None = None,
    updates: int = 1,
    contract: Contract | None = None,
    **options: Unpack[LossOptions],
) -> None:
    """Law ``checkpoint-round-trip``: load after save restores the whole state, key by key.

    Parameters, buffers and optimizer state (by parameter name), and the plain
    values, must come back on every rank exactly as rank 0 held them when it
    saved: a checkpoint holds rank 0's copy of replicated state, never a
    mixture of ranks.

    With ``portable_to`` (e.g. ``single_device("cpu")``), law
    ``checkpoint-portable`` too: that strategy, in this process, loads the same
    checkpoint into a plain module and gets the same parameters.

    Args:
        strategy: the strategy under test.
        module: a module to train one step, save and restore.
        batch: the batch for that step (its length divisible by the world size).
        portable_to: a single-process strategy that must read the checkpoint.
        directory: where to write (a temporary directory when omitted).
        updates: updates before the save (a strategy that synchronises every k
            updates is saved after k, when its ranks agree).
        contract: with ``optimizer_state="sharded"``, each rank's optimizer
            state must come back as that rank saved it.
        **options: `LossOptions`: ``world`` (None: a `World` of
            ``world_size=2`` ranks is started), ``forward=squares_mean`` (give
            one for an ``(inputs, targets)`` batch, or a pipeline, which needs one).

    A pipeline's stage holds the keys of its stages: each comes back as the
    first rank holding it saved it.

    Raises:
        LawViolation: something saved did not come back as it was.
        TypeError: a keyword the law does not take.
    """
    own = ["portable_to", "directory", "updates", "contract"]
    given = settings("check_checkpoint_round_trip", options, LossOptions, own=own)
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    with _directory(directory) as root:
        path = os.path.join(root, "checkpoint")
        results = run_on(
            given.world, given.ranks, _round_trip_rank, strategy, module, batch, path, updates,
            given.forward,
        )  # fmt: skip
        # Every rank loads what the checkpoint holds: rank 0's copy of the replicated state
        # (whole tensors, so shards compare alike), never a mixture of ranks. A pipeline's
        # stages hold parts: each key as the first rank that holds it saved it.
        first_saved = _first_holder([r["state"] for r in results])
        promised = results[0]["state"]
        sharded = contract is not None and contract.optimizer_state == "sharded"
        for rank, result in enumerate(results):
            saved, loaded = result["state"], result["loaded_state"]
            if result["part"]:
                promised = {k: first_saved[k] for k in saved}
            if sharded:  # the module's state from rank 0, the optimizer's this rank's own
                promised = {
                    **{k: v for k, v in results[0]["state"].items() if k.startswith("model.")},
                    **{k: v for k, v in saved.items() if k.startswith("optimizer.")},
                }
            if not sharded and not any(key.startswith("optimizer.") for key in saved):
                raise LawViolation(
                    "checkpoint-round-trip",
                    strategy,
                    inputs,
                    f"rank {rank}: the optimizer holds no state after {updates} update(s); "
                    "an update that never steps it gives this",
                )
            difference = first_difference(loaded, promised, rtol=0.0, atol=0.0)
            if difference is not None:
                raise LawViolation(
                    "checkpoint-round-trip",
                    strategy,
                    inputs,
                    f"rank {rank}: after load, {difference.describe('what rank 0 saved')} "
                    "(a save or load that drops an entry, or mixes ranks, gives this)",
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
            saved_whole = _first_holder([r["saved"] for r in results])
            _check_portable(strategy, portable_to, module, path, saved_whole, inputs)


def _first_holder(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Every key of ``states``, each with the value of the first rank that holds it."""
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for key, value in state.items():
            merged.setdefault(key, value)
    return merged


def _check_portable(
    strategy: StrategyLike,
    target: StrategyLike,
    module: torch.nn.Module,
    path: str,
    saved: dict[str, torch.Tensor],
    inputs: str,
) -> None:
    ctx: Context = target.setup(Env())
    try:
        plain = target.wrap(fresh_copy(module), ctx)
        optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        target.load(path, {"model": plain, "optimizer": optimizer}, ctx)
        loaded = keyed_parameters(plain)
    finally:
        target.teardown(ctx)
    for name in [*loaded, *saved]:
        if name not in loaded or name not in saved:
            found = (
                f"parameter {name!r} is only in {'the saved' if name in saved else 'the loaded'}"
            )
        elif (difference := max_difference(loaded[name], saved[name])) > 0:
            found = f"parameter {name!r} with a difference of {difference:g}"
        else:
            continue
        raise LawViolation(
            "checkpoint-portable",
            strategy,
            inputs,
            f"{getattr(target, 'name', target)!r} loaded {found}",
        )


def _extended(module: torch.nn.Module) -> torch.nn.Module:
    """Return a copy of ``module`` with one more parameter (a key its checkpoint lacks)."""
    bigger = fresh_copy(module)
    bigger.register_parameter("stratagem_law_extra", torch.nn.Parameter(torch.zeros(1)))
    return bigger


def _strict_rank(
    strategy: StrategyLike, ctx: Any, module: torch.nn.Module, path: str
) -> dict[str, Any]:
    outcome: dict[str, Any] = {}
    strategy.save(f"{path}-plain", {"model": fresh_copy(module), "step": 1}, ctx)
    strategy.save(f"{path}-bigger", {"model": _extended(module), "step": 1}, ctx)
    for case, saved, target in (
        ("missing", "plain", _extended(module)),  # the target has a key the checkpoint lacks
        ("unexpected", "bigger", fresh_copy(module)),  # the checkpoint has one the target lacks
    ):
        try:
            strategy.load(f"{path}-{saved}", {"model": target}, ctx)
            outcome[case] = None
        except Exception as error:  # any error is a refusal; the law asks only for one
            outcome[case] = type(error).__name__
    mark = torch.tensor([float(ctx.rank)])
    strategy.save(f"{path}-ranks", {"mark": per_rank(mark), "step": 2}, ctx)
    outcome["per_rank"] = strategy.load(f"{path}-ranks", {}, ctx).get("mark")
    return outcome


def check_checkpoint_strict(
    strategy: StrategyLike,
    module: torch.nn.Module,
    *,
    directory: str | os.PathLike[str] | None = None,
    **options: Unpack[RunOptions],
) -> None:
    """Law ``checkpoint-strict``: a load refuses keys that do not match; per-rank values return.

    Loading a checkpoint that lacks a key the target has must raise, and so
    must one that holds a key the target lacks; a value saved with
    ``sg.per_rank`` comes back to the rank that saved it. ``directory`` is
    where to write (a temporary directory when omitted); ``**options``
    (`RunOptions`): ``world``, ``world_size=2``.

    Raises:
        LawViolation: a mismatched load went through silently, or a rank got
            another rank's per-rank value.
        TypeError: a keyword the law does not take.
    """
    given = settings("check_checkpoint_strict", options, RunOptions, own=["directory"])
    inputs = f"module={summarize(module)}"
    with _directory(directory) as root:
        path = os.path.join(root, "strict")
        results = run_on(given.world, given.ranks, _strict_rank, strategy, module, path)
    for rank, outcome in enumerate(results):
        for case, what in (
            ("missing", "a checkpoint that lacks a key of the target"),
            ("unexpected", "a checkpoint with a key the target lacks"),
        ):
            if outcome[case] is None:
                raise LawViolation(
                    "checkpoint-strict",
                    strategy,
                    inputs,
                    f"rank {rank}: loading {what} raised nothing; a load that ignores "
                    "missing or unexpected keys (strict=False) gives this",
                )
        mark = outcome["per_rank"]
        if not isinstance(mark, torch.Tensor) or mark.tolist() != [float(rank)]:
            raise LawViolation(
                "checkpoint-strict",
                strategy,
                inputs,
                f"rank {rank}: the per-rank value it saved came back as {mark!r}",
            )


# --- resume: training goes on between save and load, saves may be in flight -------------------

# How long the kit holds the commit of a background save made through `stratagem.checkpoint`:
# a load that does not wait for it reads the checkpoint before it, every time.
_HELD_COMMIT = 0.3


def _hold_commits(stage: str) -> None:
    if stage == "written":
        time.sleep(_HELD_COMMIT)


def _settings(optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Return the hyperparameters of every param group, and the scheduler's state."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {"param_groups": groups, "scheduler": dict(scheduler.state_dict())}


def _wait(handle: object) -> None:
    wait = getattr(handle, "wait", None)
    if callable(wait):
        wait()


def _in_flight(handle: object) -> bool:
    done = getattr(handle, "done", None)
    return callable(done) and not done()


def _resume_rank(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: Any,
    path: str,
    forward: Forward,
) -> dict[str, Any]:
    model = strategy.wrap(fresh_copy(module), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    mine = own_share(batch, ctx)
    window = ctx.extras.get("accumulation")
    micro = window.every if isinstance(window, AccumulationState) else 1

    def train() -> None:
        for _ in range(micro):
            strategy.backward(strategy.step(model, mine, ctx, forward=forward), model, ctx)
            strategy.update(optimizer, model, ctx)
        scheduler.step()

    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 1}
    train()
    _wait(strategy.save(path, state, ctx))  # an earlier checkpoint at the same path
    train()
    optimizer.param_groups[0]["momentum"] = 0.8  # a hyperparameter changed by hand
    promised, settings = snapshot(model, optimizer), _settings(optimizer, scheduler)
    hooks = _checkpoint_directory
    previous, hooks.stage_hook = hooks.stage_hook, _hold_commits
    try:
        handle = strategy.save(path, {**state, "step": 2}, ctx)
        train()  # training goes on at once: the save must hold what was, not what becomes
        optimizer.param_groups[0]["momentum"] = 0.5
        restored = strategy.wrap(fresh_copy(module), ctx)
        restored_optimizer = torch.optim.SGD(restored.parameters(), lr=0.1, momentum=0.9)
        restored_scheduler = torch.optim.lr_scheduler.StepLR(restored_optimizer, 1, gamma=0.5)
        targets = {"model": restored, "optimizer": restored_optimizer,
                   "scheduler": restored_scheduler}  # fmt: skip
        refused = None
        try:
            values = strategy.load(path, targets, ctx)
        except Exception as error:  # failing on an in-flight save is allowed; then wait
            if not _in_flight(handle):
                raise
            refused = type(error).__name__
            _wait(handle)
            values = strategy.load(path, targets, ctx)
        returned_in_flight = _in_flight(handle)
        _wait(handle)
    finally:
        hooks.stage_hook = previous
    return {
        "state": promised,
        "settings": settings,
        "loaded_state": snapshot(restored, restored_optimizer),
        "loaded_settings": _settings(restored_optimizer, restored_scheduler),
        "values": values,
        "part": holds_part(ctx),
        "refused": refused,
        "returned_in_flight": returned_in_flight,
    }


def check_checkpoint_resume(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: Any,
    *,
    directory: str | os.PathLike[str] | None = None,
    contract: Contract | None = None,
    **options: Unpack[LossOptions],
) -> None:
    """Law ``checkpoint-resume``: a load restores what was saved, whatever happened after the save.

    Each rank trains (SGD with momentum under a ``StepLR`` schedule), saves,
    trains and changes a hyperparameter by hand, saves again to the same path,
    and at once, without waiting for that save, trains on and changes the
    hyperparameter again, then loads into fresh objects. The load must restore
    the state of the second save, key by key (parameters, buffers, optimizer
    state), the optimizer's ``param_groups`` settings (``lr``, ``momentum``,
    ...) and the scheduler's state. A save that returns a handle with
    ``wait()``/``done()`` (``save(..., blocking=False)``) may still be in
    flight when ``load`` is called: the load must wait for it, or raise
    (the law then waits and loads again); a background save made through
    `stratagem.checkpoint` has its commit held back a moment, so that a load
    that does not wait reads the first checkpoint every time, never by race.
    ``directory`` and ``contract`` are `check_checkpoint_round_trip`'s;
    ``**options`` (`LossOptions`): ``world``, ``world_size=2``,
    ``forward=squares_mean``.

    Raises:
        LawViolation: the loaded state, settings or scheduler differ from
            what the second save held, or ``load`` returned while that save
            was still in flight.
        TypeError: a keyword the law does not take.
    """
    own = ["directory", "contract"]
    given = settings("check_checkpoint_resume", options, LossOptions, own=own)
    inputs = f"module={summarize(module)}, batch={summarize(batch)}"
    with _directory(directory) as root:
        path = os.path.join(root, "resume")
        results = run_on(
            given.world, given.ranks, _resume_rank, strategy, module, batch, path, given.forward
        )
    first_saved = _first_holder([r["state"] for r in results])
    sharded = contract is not None and contract.optimizer_state == "sharded"
    for rank, result in enumerate(results):
        saved = result["state"]
        promised = results[0]["state"]
        if result["part"]:
            promised = {k: first_saved[k] for k in saved}
        if sharded:
            promised = {
                **{k: v for k, v in results[0]["state"].items() if k.startswith("model.")},
                **{k: v for k, v in saved.items() if k.startswith("optimizer.")},
            }
        found = None
        if result["returned_in_flight"]:
            found = (
                "load returned while the save it reads was still in flight: a load must wait "
                "for a background save to the same path (its handle's wait()) or refuse"
            )
        elif (difference := first_difference(result["loaded_state"], promised, rtol=0.0,
                                              atol=0.0)) is not None:  # fmt: skip
            found = (
                f"after load, {difference.describe('what the last save held')} (a load that "
                "read an earlier checkpoint, not waiting for the save in flight, or a "
                "background save that wrote live tensors after training changed them, gives "
                "this)"
            )
        elif result["loaded_settings"] != result["settings"]:
            found = (
                f"after load, the optimizer's settings and scheduler are "
                f"{result['loaded_settings']!r}, but the save held {result['settings']!r} (a "
                "resume that restores optimizer state but keeps the live hyperparameters, or "
                "drops the scheduler, gives this)"
            )
        elif result["values"].get("step") != 2:
            found = f"load returned plain values {result['values']!r}; the last save held step=2"
        if found is not None:
            raise LawViolation("checkpoint-resume", strategy, inputs, f"rank {rank}: {found}")
