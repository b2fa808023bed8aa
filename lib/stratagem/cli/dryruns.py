"""``stratagem dry-run MODULE:FUNCTION --world-size N ...``: `dry_run` tables from the command line.

``FUNCTION(world_size)`` describes the run to plan at that size, as a mapping
of `dry_run`'s arguments: ``strategy``, ``model`` (a factory), ``batch``, and
optionally ``forward``, ``optimizer`` and ``micro_batches``. A function, not
a fixed stack, because a stack often depends on the size (``hsdp``'s
replicas).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from stratagem.errors import UsageError

__all__ = ["configure", "run"]

_ALLOWED = {"strategy", "model", "batch", "forward", "optimizer", "micro_batches"}


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the plan function and the world sizes."""
    parser.add_argument(
        "spec",
        metavar="MODULE:FUNCTION",
        help="a function of the world size returning dry_run's arguments as a mapping "
        "(strategy, model, batch, and optionally forward, optimizer, micro_batches)",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        nargs="+",
        default=[8],
        metavar="N",
        help="simulated world sizes, one table each (default: 8)",
    )


def _function(spec: str) -> Callable[[int], Any]:
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise UsageError(
            f"dry-run: {spec!r} is not MODULE:FUNCTION; name a module and a function in it, "
            "e.g. my_model:plan."
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as python -m does: the working directory's modules
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise UsageError(
            f"dry-run: cannot import {module_name!r} ({error}); run from the directory that "
            "holds it, or install it."
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UsageError(f"dry-run: {module_name!r} has no function {name!r}.")
    return function  # type: ignore[no-any-return]  # checked callable just above


def run(options: argparse.Namespace) -> int:
    """Print one `DryRun` table per world size.

    Raises:
        UsageError: the spec cannot be imported, a size is not positive, or the
            function returns no mapping of dry_run's arguments.
    """
    from stratagem.planning.dry_run import dry_run

    function = _function(options.spec)
    for world_size in options.world_size:
        if world_size < 1:
            raise UsageError(f"dry-run: --world-size must be positive (got {world_size}).")
        arguments = function(world_size)
        if not isinstance(arguments, Mapping) or not {"strategy", "model", "batch"} <= set(
            arguments
        ):
            raise UsageError(
                f"dry-run: {options.spec}({world_size}) must return a mapping with strategy, "
                f"model and batch (got {type(arguments).__name__})."
            )
        unknown = sorted(set(arguments) - _ALLOWED)
        if unknown:
            raise UsageError(
                f"dry-run: {options.spec}({world_size}) returned {unknown}, which dry_run does "
                f"not take; it takes {sorted(_ALLOWED)}."
            )
        given: dict[str, Any] = dict(arguments)
        print(
            dry_run(
                given.pop("strategy"),
                given.pop("model"),
                given.pop("batch"),
                world_size=world_size,
                **given,
            )
        )
        print()
    return 0
