"""Launching: `launch`, the two launch fields (`in_place`, `Spawn`) and `spawned`.

``stratagem.launch(fn, strategy, devices=...)`` hands over to the strategy's
own ``launch`` field, which decides how processes start: in place (this
process, or each process torchrun / SLURM started) or spawned on this host.
``spawned(strategy)`` is the one substitution that turns an in-place strategy
into one that starts its own ranks: ``ddp_spawn()`` is ``spawned(ddp())``.
The processes themselves (pipes, signals, the rendezvous store) are
`stratagem._processes`'s business.

The spawn launcher hosts the rendezvous store on a socket it bound to
127.0.0.1 (no port race, nothing listening on other interfaces), starts one
``spawn`` process per rank, and reads one message per rank from a pipe: the
result, or the exception with its traceback. A rank that fails stops the
others within ``stop_grace`` seconds; a rank that does not exit after sending
its result is killed after ``exit_timeout`` seconds, so a hang in
process-group teardown cannot hang the caller.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import attrs
import torch.distributed as dist

from stratagem._processes import SpawnedWorld, pack, ran, refuse_launch_at_import, rendezvous
from stratagem.devices import asked_device, warn_fallback
from stratagem.env import detect_env, host_group
from stratagem.errors import CombinatorError, LaunchError, UsageError
from stratagem.strategy import Strategy, StrategyLike, not_a_strategy
from stratagem.validators import MAX_SECONDS, is_int, positive_number, require

__all__ = ["Spawn", "SpawnVariant", "check_field_arguments", "in_place", "launch", "spawned"]

R = TypeVar("R")


def check_field_arguments(fn: object, devices: object, args: object) -> None:
    """Check what a launch field receives, for callers that skip `launch` (which resolves 'auto').

    Raises:
        UsageError: ``fn`` is not callable, ``devices`` not a positive int, or
            ``args`` not a tuple or list.
    """
    require(callable(fn), "launch: 'fn'", "callable", fn)
    hint = "; stratagem.launch also accepts 'auto'"
    require(is_int(devices, 1), "launch: 'devices'", "a positive int", devices, hint=hint)
    sequence = isinstance(args, Sequence) and not isinstance(args, (str, bytes))
    require(sequence, "launch: 'args'", "a tuple or list", args)


def launch(
    fn: Callable[..., R],
    strategy: StrategyLike,
    *,
    devices: int | Literal["auto"] = 1,
    args: Sequence[Any] = (),
) -> list[R]:
    """Run ``fn(strategy, ctx, *args)`` on every rank and return the results in rank order.

    Inside a world that torchrun or SLURM started, each process runs ``fn`` in
    place and ``devices`` must equal the number of processes on this node.
    Otherwise the strategy's ``launch`` field decides: single-process
    strategies run here, ``ddp_spawn()`` starts ``devices`` local processes.

    Args:
        fn: the training function, ``fn(strategy, ctx, *args) -> result``.
            To run in spawned processes it must be importable (defined at
            module level), and so must ``args`` and the result be picklable.
        strategy: a `Strategy` or any `StrategyLike` record.
        devices: processes on this node; ``"auto"`` means as many as the
            launcher started, or 1 outside a launcher.
        args: extra positional arguments for ``fn``.

    Returns:
        One result per rank, rank 0 first (every process receives the whole list).

    Raises:
        UsageError: an argument is malformed.
        LaunchError: ``devices`` disagrees with the world the environment describes.
        RankError: a spawned rank raised or died.

    Example:
        >>> import stratagem as sg
        >>> def hello(strategy, ctx, greeting):
        ...     return f"{greeting} from rank {ctx.rank} of {ctx.world_size}"
        >>> sg.launch(hello, sg.single_device("cpu"), args=("hi",))
        ['hi from rank 0 of 1']
    """
    if not isinstance(strategy, StrategyLike):
        raise UsageError(not_a_strategy(strategy, "launch"))
    if isinstance(devices, str) and devices == "auto":
        env = detect_env(os.environ)
        devices = env.local_world_size if env.is_distributed else 1
    require(is_int(devices, 1), "launch: 'devices'", "a positive int or 'auto'", devices)
    # Checked here too, not only in the built-in launch fields: a user's field may not.
    check_field_arguments(fn, devices, args)
    return strategy.launch(fn, strategy, devices, tuple(args))


def in_place(
    fn: Callable[..., Any], strategy: StrategyLike, devices: int, args: Sequence[Any]
) -> list[Any]:
    """Launch field that runs ``fn`` in this process (a world of one, or a rank torchrun started).

    Raises:
        UsageError: an argument is malformed (see `check_field_arguments`).
        LaunchError: ``devices`` differs from the processes on this node.
    """
    check_field_arguments(fn, devices, args)
    env = detect_env(os.environ)
    if devices != env.local_world_size:
        if env.is_distributed:
            hint = f"pass devices={env.local_world_size} (or 'auto')"
        else:
            hint = (
                "start it with torchrun --nproc-per-node "
                f"{devices}, or use a strategy that spawns (ddp_spawn())"
            )
        raise LaunchError(
            f"launch: devices={devices} but {env.source!r} started {env.local_world_size} "
            f"process(es) on this node; {hint}."
        )
    ctx = strategy.setup(env)
    results: list[Any] = [None] * ctx.world_size
    try:
        result = ran(fn, strategy, ctx, args)
        if ctx.world_size == 1 or ctx.group is None:
            results = [result]
        else:
            dist.all_gather_object(results, result, group=host_group(ctx))
    finally:
        strategy.teardown(ctx)
    return results


_SECONDS = positive_number("Spawn.{name}", unit="seconds", at_most=MAX_SECONDS)


@attrs.frozen(kw_only=True)
class Spawn:
    """Launch field that starts ``devices`` processes on this host.

    Inside a world torchrun or SLURM started, or for ``devices=1``, it runs in
    place instead: a launcher never starts processes inside another launcher's world.

    Attributes:
        stop_grace: seconds the surviving ranks get to exit after SIGTERM when
            a rank failed, before SIGKILL.
        exit_timeout: seconds a rank gets to exit after it sent its result,
            before it is killed (its result is kept).
        store_timeout: seconds the rendezvous store waits for a rank to connect.

    Raises:
        UsageError: a setting is not a positive number of seconds up to `MAX_SECONDS`.
    """

    stop_grace: float = attrs.field(default=5.0, validator=_SECONDS)
    exit_timeout: float = attrs.field(default=30.0, validator=_SECONDS)
    store_timeout: float = attrs.field(default=300.0, validator=_SECONDS)

    def __call__(
        self, fn: Callable[..., Any], strategy: StrategyLike, devices: int, args: Sequence[Any]
    ) -> list[Any]:
        check_field_arguments(fn, devices, args)
        if devices == 1 or detect_env(os.environ).is_distributed:
            return in_place(fn, strategy, devices, args)
        # Only where ranks would start: an in-place launch a rank re-runs at import is slow, not
        # wrong, and pages of examples that spawn later hold such launches at top level.
        refuse_launch_at_import()
        payload = pack(fn, strategy, args)
        # Decided here, once, for the ranks about to start: they resolve "auto" alike.
        warn_fallback(asked_device(strategy.setup), devices, stacklevel=3)
        with rendezvous(self.store_timeout) as port:
            return SpawnedWorld(self, devices, port, payload).run()


def spawned(strategy: Strategy, start: Spawn | None = None) -> Strategy:
    """Return ``strategy`` with ranks started on this host: its launch field becomes a `Spawn`.

    The whole difference between ``ddp()`` (run in place, in each process
    torchrun or SLURM started) and ``ddp_spawn()`` is this one field, so
    ``spawned(ddp()) == ddp_spawn()``. Inside a launcher's world, or for
    ``devices=1``, a `Spawn` runs in place, so a spawned strategy also works
    under torchrun. The record is renamed ``<name>_spawn``.

    Args:
        strategy: a `Strategy` whose setup joins a multi-process world (``ddp()``,
            ``fsdp()``, ``allreduce_grads()``, or your own).
        start: the spawn launcher and its timeouts (default ``Spawn()``).

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, or ``start`` not a `Spawn`.
        CombinatorError: ``strategy`` already spawns.

    Example:
        >>> import stratagem as sg
        >>> sg.spawned(sg.ddp(), sg.Spawn(stop_grace=10)).launch
        Spawn(stop_grace=10, exit_timeout=30.0, store_timeout=300.0)
    """
    if not isinstance(strategy, Strategy):
        raise UsageError(not_a_strategy(strategy, "spawned"))
    if start is None:
        start = Spawn()
    hint = ", e.g. Spawn(stop_grace=10)"
    require(isinstance(start, Spawn), "spawned: 'start'", "None or a Spawn", start, hint=hint)
    if isinstance(strategy.launch, Spawn):
        raise CombinatorError(
            f"spawned: {strategy.name!r} already starts its own ranks; pass the strategy "
            "before spawned() was applied, with the Spawn you want."
        )
    return attrs.evolve(strategy, name=f"{strategy.name}_spawn", launch=start)


@attrs.frozen(repr=False)
class SpawnVariant:
    """A factory's ``_spawn`` variant: ``ddp_spawn(**options)`` is ``spawned(ddp(**options))``.

    ``ddp_spawn``, ``fsdp_spawn`` and ``allreduce_grads_spawn`` are this
    record around their built-in: one field substituted, stated once.

    Attributes:
        factory: the built-in whose strategies the variant spawns.

    Example:
        >>> import stratagem as sg
        >>> sg.ddp_spawn(bucket_cap_mb=8) == sg.spawned(sg.ddp(bucket_cap_mb=8))
        True
        >>> sg.fsdp_spawn(start=sg.Spawn(stop_grace=1)).launch
        Spawn(stop_grace=1, exit_timeout=30.0, store_timeout=300.0)
    """

    factory: Callable[..., Strategy]

    @property
    def __name__(self) -> str:  # what an error names when the variant is passed uncalled
        return f"{getattr(self.factory, '__name__', 'factory')}_spawn"

    def __repr__(self) -> str:
        return self.__name__

    def __call__(self, *, start: Spawn | None = None, **options: Any) -> Strategy:
        """Return ``spawned(factory(**options), start)``."""
        return spawned(self.factory(**options), start)
