"""``stratagem checkpoint PATH``: what a checkpoint holds, read without a model or process group."""

from __future__ import annotations

import argparse

from stratagem.cli.escaping import printable, printable_description
from stratagem.errors import UsageError

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the checkpoint directory argument."""
    parser.add_argument("path", metavar="PATH", help="a checkpoint directory that save() wrote")


def run(options: argparse.Namespace) -> int:
    """Print the checkpoint's description, every name and value from the file escaped.

    Raises:
        UsageError: there is no readable checkpoint at the path.
    """
    from stratagem import checkpoint

    describe = getattr(checkpoint, "describe", None)
    if describe is None:
        raise UsageError(
            "checkpoint: inspecting checkpoints is not available yet in this version of stratagem."
        )
    try:
        description = describe(options.path)
    except FileNotFoundError:
        raise UsageError(
            f"checkpoint: there is no checkpoint at {options.path!r}; pass the directory "
            "that save() (or stratagem demo --checkpoint DIR) wrote."
        ) from None
    except checkpoint.CheckpointError as error:
        raise UsageError(f"checkpoint: {printable(error)}") from None
    print(printable_description(description))
    return 0
