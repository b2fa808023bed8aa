"""The ``stratagem`` command line: ``demo``, ``env``, ``checkpoint``, ``dry-run``, ``--version``.

A mistake on the command line is one line on stderr and exit code 2; Ctrl-C
stops every rank (the spawn launcher terminates them) and exits with 130.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from stratagem.cli import checkpointinfo, demo, dryruns, envinfo
from stratagem.errors import RankError, StratagemError

__all__ = ["main"]

USAGE_EXIT = 2
INTERRUPTED_EXIT = 130  # 128 + SIGINT, as shells report it

Configure = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]

_COMMANDS: dict[str, tuple[Configure, Run, str]] = {
    "demo": (demo.configure, demo.run, "train a small classifier with a built-in strategy"),
    "env": (
        envinfo.configure,
        envinfo.run,
        "show what detect_env sees, the devices, backends and versions",
    ),
    "checkpoint": (
        checkpointinfo.configure,
        checkpointinfo.run,
        "show what a checkpoint holds, without loading a model",
    ),
    "dry-run": (
        dryruns.configure,
        dryruns.run,
        "plan a stack on a simulated world: memory and collectives per rank",
    ),
}


class _UsageExit(Exception):
    """An argparse error, turned into one line by `main`."""


def _fail(prog: str) -> Callable[[str], NoReturn]:
    def error(message: str) -> NoReturn:
        raise _UsageExit(f"{prog}: error: {message} (see {prog} --help)")

    return error


def version() -> str:
    """Return the installed stratagem's version (its distribution's metadata)."""
    try:
        return importlib.metadata.version("stratagem")
    except importlib.metadata.PackageNotFoundError:  # imported from a tree, not installed
        return "unknown (not installed; pip install -e . gives it a version)"


def parser() -> argparse.ArgumentParser:
    """Build the argument parser; every parser's errors become one line (see `main`)."""
    root = argparse.ArgumentParser(
        prog="stratagem", description="PyTorch training strategies as records of functions."
    )
    # An instance attribute, as argparse offers no hook: its own error() prints usage and exits.
    root.error = _fail(root.prog)  # type: ignore[method-assign, assignment]
    root.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = root.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (configure, _, summary) in _COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        sub.error = _fail(sub.prog)  # type: ignore[method-assign, assignment]
        configure(sub)
    return root


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``stratagem`` command; return its exit code.

    Example:
        >>> main(["demo", "--devices", "0"])
        2
    """
    try:
        options = parser().parse_args(argv)
        _, run, _ = _COMMANDS[options.command]
        return run(options)
    except _UsageExit as error:
        print(error, file=sys.stderr)
    except RankError as error:  # a rank's own failure: its traceback is the useful part
        print(f"stratagem: {error}", file=sys.stderr)
        return 1
    except StratagemError as error:
        print(f"stratagem: error: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print("stratagem: interrupted; every rank was stopped.", file=sys.stderr)
        return INTERRUPTED_EXIT
    return USAGE_EXIT
