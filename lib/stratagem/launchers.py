"""`launch`: run a training function on every rank of a world, and the in-place launcher.

``stratagem.launch(fn, strategy, devices=...)`` hands over to the strategy's
own ``launch`` field, which decides how processes start: in place (this
process, or each process torchrun / SLURM started) or spawned on this host.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar

import torch.distributed as dist

from stratagem.env import detect_env
from stratagem.errors import LaunchError, UsageError, describe
from stratagem.strategy import StrategyLike

__all__ = ["check_field_arguments", "in_place", "launch"]

R = TypeVar("R")


def _check_devices(devices: object) -> int | Literal["auto"]:
    if isinstance(devices, str) and devices == "auto":
        return "auto"
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UsageError(
            f"launch: 'devices' must be a positive int or 'auto' (got {describe(devices)})."
        )
    return devices


def check_field_arguments(fn: object, devices: object, args: object) -> None:
    """Check what a launch field receives, for callers that skip `launch` (which resolves 'auto').

    Raises:
        UsageError: ``fn`` is not callable, ``devices`` not a positive int, or
            ``args`` not a tuple or list.
    """
    if not callable(fn):
        raise UsageError(f"launch: 'fn' must be callable (got {describe(fn)}).")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise UsageError(
            f"launch: 'devices' must be a positive int (got {describe(devices)}); "
            "stratagem.launch also accepts 'auto'."
        )
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise UsageError(f"launch: 'args' must be a tuple or list (got {describe(args)}).")


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
        raise UsageError(
            f"launch: 'strategy' must be a Strategy or have every Strategy field "
            f"(got {describe(strategy)})."
        )
    checked = _check_devices(devices)
    if checked == "auto":
        env = detect_env(os.environ)
        checked = env.local_world_size if env.is_distributed else 1
    # Checked here too, not only in the built-in launch fields: a user's field may not.
    check_field_arguments(fn, checked, args)
    return strategy.launch(fn, strategy, checked, tuple(args))


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
        result = fn(strategy, ctx, *args)
        if ctx.world_size == 1 or ctx.group is None:
            results = [result]
        else:
            dist.all_gather_object(results, result, group=ctx.group)
    finally:
        strategy.teardown(ctx)
    return results
