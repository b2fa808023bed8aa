"""Rank 0 decides, every rank learns: the two agreements a checkpoint's ranks make.

`on_main` runs a step on rank 0 (lock, rename) and gives every rank its
result or its error; `agree` makes every rank raise when any rank failed.
Shared by blocking saves, background saves and ``resume_or_start``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from stratagem import collectives
from stratagem.env import Context
from stratagem.errors import CheckpointError, UsageError

__all__ = ["agree", "on_main"]

T = TypeVar("T")


def on_main(ctx: Context, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 and return its result on every rank; if it raises, every rank raises.

    Raises:
        Exception: what ``fn`` raised on rank 0 (the others raise the same error).
    """
    outcome: tuple[bool, Any] = (True, None)
    if ctx.is_main:
        try:
            outcome = (True, fn())
        except Exception as error:  # every rank must learn of it, or the others would hang
            outcome = (False, error)
    ok, value = collectives.broadcast(outcome, ctx)
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def agree(
    ctx: Context, error: Exception | None, settings: dict[str, Any] | None = None, *, what: str = ""
) -> None:
    """Raise on every rank if any rank has an error, or the ranks' ``settings`` differ.

    The failing rank raises its own error; the others raise a `CheckpointError`
    that quotes the lowest failing rank's message, so that whichever rank a
    launcher reports names the cause. Differing ``settings`` (a path, ``blocking``)
    would make the ranks take different paths through the collectives that
    follow, and hang: every rank raises a `UsageError` naming each rank's values.
    """
    digest = _digest(settings)
    # One small reduction for both questions; the lowest failing rank wins.
    flags = torch.tensor([-(ctx.world_size if error is None else ctx.rank), digest, -digest])
    reduced = collectives.reduce(flags, "max", ctx).tolist()
    failed, largest, smallest = -reduced[0], reduced[1], -reduced[2]
    if failed == ctx.world_size and largest != smallest:
        everyone = collectives.gather_objects(settings, ctx)
        differing = sorted(k for k in everyone[0] if len({repr(s[k]) for s in everyone}) > 1)
        shown = "; ".join(
            f"rank {rank}: " + ", ".join(f"{k}={s[k]!r}" for k in differing)
            for rank, s in enumerate(everyone)
        )
        raise UsageError(
            f"{what}: every rank must pass the same {', '.join(differing)}, but {shown}. "
            f"Call {what} with the same arguments on every rank."
        )
    if failed == ctx.world_size:
        return
    message = collectives.broadcast(str(error) if error is not None else "", ctx, src=failed)
    if error is not None:
        raise error
    raise CheckpointError(f"rank {failed} could not take part in the checkpoint: {message}")


def _digest(settings: dict[str, Any] | None) -> int:
    """Return a signed 62-bit digest of ``settings``' reprs, equal on ranks that agree."""
    if not settings:
        return 0
    text = repr(sorted((key, repr(value)) for key, value in settings.items()))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 2
