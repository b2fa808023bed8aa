"""Callback protocols: the type of each `Strategy` field, its calling convention, `StrategyLike`.

Leading parameters are positional-only, so a user's function may name them as
it likes; keyword parameters (``forward``, ``src``) are part of the contract.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs
import torch

if TYPE_CHECKING:
    from stratagem.env import Context, Env

__all__ = [
    "BackwardFn",
    "BackwardInStep",
    "BarrierFn",
    "BroadcastFn",
    "ForwardFn",
    "GatherFn",
    "LaunchFn",
    "LoadFn",
    "NoSyncFn",
    "ReduceFn",
    "ReduceOp",
    "SaveFn",
    "SetupFn",
    "ShardFn",
    "StepFn",
    "StrategyLike",
    "TeardownFn",
    "UpdateFn",
    "WrapFn",
]

ReduceOp = Literal["sum", "mean", "max", "min"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("sum", "mean", "max", "min")

ForwardFn = Callable[[torch.nn.Module, Any], Any]
"""A user's forward: ``forward(module, batch) -> output`` (a loss, logits, ...)."""


class LaunchFn(Protocol):
    """Start the processes of a world and run ``fn(strategy, ctx, *args)`` on each."""

    def __call__(
        self,
        fn: Callable[..., Any],
        strategy: StrategyLike,
        devices: int,
        args: Sequence[Any],
        /,
    ) -> list[Any]:
        """Return every rank's result, in rank order."""
        ...


class SetupFn(Protocol):
    """Join the world described by an `Env`."""

    def __call__(self, env: Env, /) -> Context:
        """Return the joined world (device, process group)."""
        ...


class TeardownFn(Protocol):
    """Leave the world joined by `setup`."""

    def __call__(self, ctx: Context, /) -> None:
        """Release the process group and anything `setup` acquired."""
        ...


class WrapFn(Protocol):
    """Prepare a module for training: move it, convert it, wrap it."""

    def __call__(self, module: torch.nn.Module, ctx: Context, /) -> torch.nn.Module:
        """Return the module to train (possibly a wrapper around ``module``)."""
        ...


class StepFn(Protocol):
    """Run a forward pass under the strategy's placement and forward context."""

    def __call__(
        self,
        module: torch.nn.Module,
        batch: Any,
        ctx: Context,
        /,
        *,
        forward: ForwardFn | None = None,
    ) -> Any:
        """Return ``forward(module, batch)``, or ``module(batch)`` without ``forward``."""
        ...


class BackwardFn(Protocol):
    """Backpropagate a loss (scaling it where the precision needs that)."""

    def __call__(self, loss: torch.Tensor, module: torch.nn.Module, ctx: Context, /) -> None:
        """Accumulate gradients of ``loss`` into ``module``'s parameters."""
        ...


@attrs.frozen
class BackwardInStep:
    """A backward field whose strategy's ``step`` already ran the backward (a pipeline's schedule).

    It calls ``check`` (which refuses any loss but the one ``step`` returned);
    combinators that change the loss before backward (accumulation, loss
    scaling) find this field and refuse the strategy, since the change would
    reach no gradient.

    Attributes:
        check: the backward field itself: checks its arguments, backpropagates nothing.
        microbatches: the micro-batches one step runs (what accumulation
            should multiply instead).
    """

    check: BackwardFn
    microbatches: int

    def __call__(self, loss: torch.Tensor, module: torch.nn.Module, ctx: Context, /) -> None:
        self.check(loss, module, ctx)


class UpdateFn(Protocol):
    """Apply the accumulated gradients."""

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context, /
    ) -> None:
        """Step the optimizer, then zero the gradients."""
        ...


class NoSyncFn(Protocol):
    """Suspend gradient synchronisation, for accumulation over micro-batches."""

    def __call__(self, module: torch.nn.Module, ctx: Context, /) -> AbstractContextManager[Any]:
        """Return a context manager inside which backward does not synchronise."""
        ...


class ReduceFn(Protocol):
    """Combine a tensor across ranks."""

    def __call__(self, tensor: torch.Tensor, op: ReduceOp, ctx: Context, /) -> torch.Tensor:
        """Return a new tensor holding the reduction; the input is left unchanged."""
        ...


class GatherFn(Protocol):
    """Collect a tensor from every rank."""

    def __call__(self, tensor: torch.Tensor, ctx: Context, /) -> torch.Tensor:
        """Return the tensors stacked along a new first dimension of size world size."""
        ...


class BroadcastFn(Protocol):
    """Send a tensor or a picklable object from one rank to all."""

    def __call__(self, obj: Any, ctx: Context, /, *, src: int = 0) -> Any:
        """Return rank ``src``'s ``obj`` on every rank."""
        ...


class BarrierFn(Protocol):
    """Wait until every rank arrives."""

    def __call__(self, ctx: Context, /) -> None:
        """Return once all ranks have called it."""
        ...


class ShardFn(Protocol):
    """Give this rank its share of a data loader."""

    def __call__(self, loader: Iterable[Any], ctx: Context, /) -> Iterable[Any]:
        """Return an iterable over this rank's batches."""
        ...


class SaveFn(Protocol):
    """Write a checkpoint."""

    def __call__(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], ctx: Context, /
    ) -> object:
        """Save ``state`` (modules, optimizers, plain values) at ``path``.

        What it returns is the caller's: the built-ins return ``None``, or a
        `stratagem.checkpoint.PendingSave` for ``blocking=False``.
        """
        ...


class LoadFn(Protocol):
    """Read a checkpoint into live objects."""

    def __call__(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], ctx: Context, /
    ) -> dict[str, Any]:
        """Restore ``state``'s objects in place and return the plain values."""
        ...


@runtime_checkable
class StrategyLike(Protocol):
    """Anything with a strategy's fields: a `Strategy`, or a user's own record type.

    Members are read-only properties so that frozen records, NamedTuples and
    plain objects all satisfy it.
    """

    @property
    def name(self) -> str: ...
    @property
    def launch(self) -> LaunchFn: ...
    @property
    def setup(self) -> SetupFn: ...
    @property
    def wrap(self) -> WrapFn: ...
    @property
    def step(self) -> StepFn: ...
    @property
    def backward(self) -> BackwardFn: ...
    @property
    def update(self) -> UpdateFn: ...
    @property
    def no_sync(self) -> NoSyncFn: ...
    @property
    def reduce(self) -> ReduceFn: ...
    @property
    def gather(self) -> GatherFn: ...
    @property
    def broadcast(self) -> BroadcastFn: ...
    @property
    def barrier(self) -> BarrierFn: ...
    @property
    def shard(self) -> ShardFn: ...
    @property
    def save(self) -> SaveFn: ...
    @property
    def load(self) -> LoadFn: ...
    @property
    def teardown(self) -> TeardownFn: ...
