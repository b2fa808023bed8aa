"""``accumulate``: gradient accumulation over micro-batches, synchronising only on the last."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Literal

import attrs
import torch

from stratagem.combinators._base import CombinatorError, applied, check_strategy
from stratagem.env import Context, Env, check_context
from stratagem.errors import UsageError, describe
from stratagem.fields import BackwardFn, ForwardFn, NoSyncFn, SetupFn, StepFn, UpdateFn
from stratagem.strategy import Strategy
from stratagem.training import check_loss, check_module, check_optimizer

__all__ = ["AccumulationState", "Normalize", "accumulate"]

Normalize = Literal["mean", "sum", "count"]


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
    state = check_context(ctx, function).extras.get("accumulation")
    if not isinstance(state, AccumulationState):
        raise UsageError(
            "accumulate: ctx has no accumulation state; pass the Context that this strategy's "
            "setup returned."
        )
    return state


@attrs.frozen
class AccumulationSetup:
    """Setup: add the per-run `AccumulationState`."""

    inner: SetupFn
    every: int

    def __call__(self, env: Env) -> Context:
        return self.inner(env).with_extras(accumulation=AccumulationState(self.every))


@attrs.frozen
class AccumulationStep:
    """Step: enter the inner ``no_sync`` before each forward but a window's last (DDP needs it)."""

    inner: StepFn
    no_sync: NoSyncFn

    def __call__(
        self, module: torch.nn.Module, batch: Any, ctx: Context, *, forward: ForwardFn | None = None
    ) -> Any:
        check_module(module, "step")
        state = _state(ctx, "step")
        if torch.is_grad_enabled() and not state.last and state.pending is None:
            state.pending = self.no_sync(module, ctx)
            state.pending.__enter__()
        return self.inner(module, batch, ctx, forward=forward)


@attrs.frozen
class AccumulationBackward:
    """Backward: normalise the loss, backpropagate, leave ``no_sync``, count the micro-batch."""

    inner: BackwardFn
    normalize: Normalize

    def __call__(self, loss: torch.Tensor, module: torch.nn.Module, ctx: Context) -> None:
        check_loss(loss, "backward")
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
        check_optimizer(optimizer, "update")  # every call: a bad one fails at once, not at N
        state = _state(ctx, "update")
        if state.index % state.every == 0:
            self.inner(optimizer, module, ctx)
            state.count = None


def accumulate(strategy: Strategy, every: int, *, normalize: Normalize = "mean") -> Strategy:
    """Accumulate gradients over ``every`` micro-batches; the loop calls each field per micro-batch.

    Gradient synchronisation is suspended (the inner ``no_sync``) for all but
    the last micro-batch of a window, and ``update`` steps once per window. The
    loss of each micro-batch is divided explicitly, never by a hidden rule:

    - ``"mean"``: by ``every`` (equal micro-batches then equal one big batch of a mean loss);
    - ``"sum"``: not at all (for a loss that is a sum over the window);
    - ``"count"``: by ``ctx.extras["accumulation"].count``, a total you set per
      window (e.g. the tokens in it).

    Fields touched: ``setup`` (an `AccumulationState` in
    ``ctx.extras["accumulation"]``), ``step``, ``backward``, ``update``.

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, ``every`` is not a positive
            int, or ``normalize`` is unknown.
        CombinatorError: the strategy already accumulates.
    """
    check_strategy(strategy, "accumulate")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise UsageError(f"accumulate: 'every' must be a positive int (got {describe(every)}).")
    if not isinstance(normalize, str) or normalize not in ("mean", "sum", "count"):
        raise UsageError(
            f"accumulate: 'normalize' must be 'mean', 'sum' or 'count' (got {describe(normalize)})."
        )
    if applied(strategy, AccumulationUpdate) is not None:
        raise CombinatorError(
            f"accumulate: strategy {strategy.name!r} already accumulates; apply it once."
        )
    return attrs.evolve(
        strategy,
        name=f"{strategy.name}+accumulate{every}",
        setup=AccumulationSetup(strategy.setup, every),
        step=AccumulationStep(strategy.step, strategy.no_sync),
        backward=AccumulationBackward(strategy.backward, normalize),
        update=AccumulationUpdate(strategy.update),
    )
