"""``accumulate``: gradient accumulation over micro-batches, synchronising only on the last."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Literal

import attrs
import torch

from stratagem.combinators._base import CombinatorError, check_once, check_strategy
from stratagem.env import Context, Env, check_context, check_env
from stratagem.errors import UsageError, describe
from stratagem.fields import (
    BackwardFn,
    BackwardInStep,
    ForwardFn,
    NoSyncFn,
    SaveFn,
    SetupFn,
    StepFn,
    UpdateFn,
)
from stratagem.strategy import Strategy, applied
from stratagem.training import backward, check_loss, check_module, check_update, no_sync
from stratagem.validators import is_int, require

__all__ = ["AccumulationState", "Every", "Normalize", "accumulate", "resolved_every"]

Normalize = Literal["mean", "sum", "count"]
Every = int | Callable[[int], int]
"""Micro-batches per optimizer step on each rank, or a function of the world size giving them."""


@attrs.define
class AccumulationState:
    """Per-run accumulation state in ``ctx.extras["accumulation"]``.

    Attributes:
        every: micro-batches per optimizer step.
        index: micro-batches backpropagated so far in this run.
        count: with ``normalize="count"``, what to divide each micro-batch's
            loss by (e.g. the tokens of the whole window); set it before the
            window's first backward.
    """

    every: int
    index: int = 0
    count: float | None = None
    pending: AbstractContextManager[Any] | None = None

    @property
    def last(self) -> bool:
        """Whether the next backward ends the window (and so synchronises)."""
        return self.index % self.every == self.every - 1


def _state(ctx: Context, function: str) -> AccumulationState:
    # Each field first tries ctx.extras itself (one test a micro-batch); this is the slow path.
    state = check_context(ctx, function).extras.get("accumulation")
    if not isinstance(state, AccumulationState):
        raise UsageError(
            "accumulate: ctx has no accumulation state; pass the Context that this strategy's "
            "setup returned."
        )
    return state


def resolved_every(every: Every, world_size: int) -> int:
    """Return the micro-batches per optimizer step that ``every`` gives a world of ``world_size``.

    Raises:
        UsageError: a function ``every`` returned no positive int.
    """
    if isinstance(every, int):
        return every
    value = every(world_size)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(
            f"accumulate: 'every' returned {value!r} ({type(value).__name__}) for world size "
            f"{world_size}; it must return a positive int, the micro-batches per optimizer step "
            "on each rank, e.g. max(1, global_micro_batches // world_size)."
        )
    return value


@attrs.frozen
class AccumulationSetup:
    """Setup: add the per-run `AccumulationState`, resolving a function ``every`` by world size."""

    inner: SetupFn
    every: Every

    def __call__(self, env: Env) -> Context:
        # Resolved before the inner setup joins the world: a bad count fails every rank alike,
        # with no process group left behind.
        every = resolved_every(self.every, check_env(env, "setup").world_size)
        return self.inner(env).with_extras(accumulation=AccumulationState(every))


@attrs.frozen
class AccumulationStep:
    """Step: enter the record's ``no_sync`` before each forward but a window's last (DDP needs it).

    ``no_sync`` is the record's own field, held (``holds``): the record re-points
    it whenever it is rebuilt, so a ``no_sync`` substituted after ``accumulate``
    (``traced``'s, a user's) is the one entered (`stratagem.layers`).
    """

    inner: StepFn
    no_sync: NoSyncFn
    holds: ClassVar[tuple[str, ...]] = ("no_sync",)

    def __call__(
        self, module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
    ) -> Any:
        # One process's no_sync does nothing: there is nothing to enter, and the inner step
        # checks its arguments (backward and update find the window's state).
        if self.no_sync is no_sync:
            return self.inner(module, batch, ctx, forward=forward)
        state = ctx.extras.get("accumulation") if ctx.__class__ is Context else None
        if not (state.__class__ is AccumulationState and isinstance(module, torch.nn.Module)):
            check_module(module, "step")
            state = _state(ctx, "step")
        if state.pending is None and torch.is_grad_enabled() and not state.last:
            state.pending = self.no_sync(module, ctx)
            state.pending.__enter__()
        return self.inner(module, batch, ctx, forward=forward)


@attrs.frozen
class AccumulationBackward:
    """Backward: normalise the loss, backpropagate, leave ``no_sync``, count the micro-batch."""

    inner: BackwardFn
    normalize: Normalize

    def __call__(self, loss: torch.Tensor, module: torch.nn.Module, ctx: Context) -> None:
        if self.inner is not backward:  # the plain backward checks the divided loss the same way
            check_loss(loss, "backward")
        state = ctx.extras.get("accumulation") if ctx.__class__ is Context else None
        if state.__class__ is not AccumulationState:
            state = _state(ctx, "backward")
        if self.normalize == "mean":
            loss = loss / state.every
        elif self.normalize == "count":
            if state.count is None or not state.count > 0:
                raise UsageError(
                    "accumulate(normalize='count'): set ctx.extras['accumulation'].count to the "
                    f"window's total count (e.g. tokens) before backward (got {state.count!r})."
                )
            loss = loss / state.count
        try:
            self.inner(loss, module, ctx)
        finally:
            pending, state.pending = state.pending, None
            if pending is not None:
                pending.__exit__(None, None, None)
            state.index += 1


@attrs.frozen
class AccumulationUpdate:
    """Update: step only when the window is complete; until then gradients accumulate."""

    inner: UpdateFn

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context
    ) -> None:
        check_update(optimizer, module, ctx)  # every call: a bad optimizer fails at once, not at N
        state = ctx.extras.get("accumulation") if ctx.__class__ is Context else None
        if state.__class__ is not AccumulationState:
            state = _state(ctx, "update")
        if state.index % state.every == 0:
            self.inner(optimizer, module, ctx)
            state.count = None


@attrs.frozen
class AccumulationSave:
    """Save: refused inside a window, whose gradients no checkpoint holds; else the inner save."""

    inner: SaveFn

    def __call__(self, path: Any, state: Any, ctx: Context, **options: Any) -> Any:
        # A context without a window (one built by hand) has none to lose: the save checks it.
        window = ctx.extras.get("accumulation") if isinstance(ctx, Context) else None
        if isinstance(window, AccumulationState) and window.index % window.every:
            raise UsageError(
                f"save: {window.index % window.every} of accumulate's {window.every} "
                "micro-batches are backpropagated but not yet stepped; their gradients would be "
                "in no checkpoint, and a resumed run would step after other micro-batches than "
                "this one. Save right after an update that steps (when the micro-batches so far "
                f"are a multiple of {window.every})."
            )
        return self.inner(path, state, ctx, **options)


def _takes_the_world_size(every: Callable[..., Any]) -> bool:
    try:
        inspect.signature(every).bind(1)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins): let setup call it and see
        return True
    return True


def _check_every(every: Every) -> Every:
    if callable(every):
        if not _takes_the_world_size(every):
            raise UsageError(
                f"accumulate: 'every' must be a positive int or a function of the world size, "
                f"called as every(world_size) (got {describe(every)}, which cannot take one "
                "argument); e.g. every=lambda world_size: max(1, 8 // world_size)."
            )
        return every
    wanted = "a positive int or a function of the world size"
    require(is_int(every, 1), "accumulate: 'every'", wanted, every)
    return every


def accumulate(strategy: Strategy, every: Every, *, normalize: Normalize = "mean") -> Strategy:
    """Accumulate gradients over ``every`` micro-batches; the loop calls each field per micro-batch.

    Gradient synchronisation is suspended (the inner ``no_sync``) for all but
    the last micro-batch of a window, and ``update`` steps once per window. The
    loss of each micro-batch is divided explicitly, never by a hidden rule:

    - ``"mean"``: by ``every`` (equal micro-batches then equal one big batch of a mean loss);
    - ``"sum"``: not at all (for a loss that is a sum over the window);
    - ``"count"``: by ``ctx.extras["accumulation"].count``, a total you set per
      window (e.g. the tokens in it).

    Fields touched: ``setup`` (an `AccumulationState` in
    ``ctx.extras["accumulation"]``), ``step``, ``backward``, ``update``, and
    ``save``, which refuses a save inside a window (its gradients would be in
    no checkpoint, and a resumed run would count its windows from another
    micro-batch): save right after an update that steps.

    Args:
        strategy: the strategy to accumulate over.
        every: micro-batches per optimizer step on each rank; or a function
            ``every(world_size) -> int`` that setup calls with its `Env`'s world
            size, for a count derived from a global batch (64 sequences, 8 per
            rank per micro-batch: ``lambda world_size: 64 // (8 * world_size)``).
            Spawned ranks receive it pickled: there, pass a module-level function.
        normalize: what each micro-batch's loss is divided by (above).

    Returns:
        The strategy with the five fields wrapped.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, ``every`` is neither a
            positive int nor a function of one argument, or ``normalize`` is
            unknown; at setup, the function ``every`` returned no positive int.
        CombinatorError: the strategy already accumulates, or its step runs
            the backward (a pipeline: raise its ``microbatches`` instead).

    Example:
        >>> import stratagem as sg
        >>> strategy = sg.accumulate(sg.single_device("cpu"), lambda world_size: 8 // world_size)
        >>> strategy.setup(sg.Env()).extras["accumulation"].every
        8
    """
    check_strategy(strategy, "accumulate")
    every = _check_every(every)
    known = isinstance(normalize, str) and normalize in ("mean", "sum", "count")
    require(known, "accumulate: 'normalize'", "'mean', 'sum' or 'count'", normalize)
    check_once(strategy, AccumulationUpdate, "accumulate", "already accumulates")
    in_step = applied(strategy, BackwardInStep)
    if in_step is not None:
        more = in_step.microbatches * every if isinstance(every, int) else "more"
        raise CombinatorError(
            f"accumulate: strategy {strategy.name!r} runs the backward in its step (a "
            "pipeline's schedule), so a loss divided by the window would reach no gradient; a "
            f"pipeline accumulates over its micro-batches: use microbatches={more} (and a "
            "batch that many times larger) instead."
        )
    shown = every if isinstance(every, int) else "(by world size)"
    return attrs.evolve(
        strategy,
        name=f"{strategy.name}+accumulate{shown}",
        setup=AccumulationSetup(strategy.setup, every),
        step=AccumulationStep(strategy.step, strategy.no_sync),
        backward=AccumulationBackward(strategy.backward, normalize),
        update=AccumulationUpdate(strategy.update),
        save=AccumulationSave(strategy.save),
    )
