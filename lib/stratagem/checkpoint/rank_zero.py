"""Rank 0 decides, every rank learns: the two agreements a checkpoint's ranks make.

`on_main` runs a step on rank 0 (lock, rename) and gives every rank its
result or its error; `agree` makes every rank raise when any rank failed.
Shared by blocking saves, background saves and ``resume_or_start``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from stratagem import collectives
from stratagem.env import Context
from stratagem.errors import CheckpointError

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
    outcome = collectives.broadcast(outcome, ctx)
    ok, value = outcome
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def agree(ctx: Context, error: Exception | None) -> None:
    """Raise on every rank if any rank has an error (the failing rank raises its own).

    The others raise a `CheckpointError` that quotes the lowest failing rank's
    message, so that whichever rank a launcher reports names the cause.
    """
    # On the context's device: NCCL reduces CUDA tensors only. The lowest failing rank wins.
    flag = torch.tensor([ctx.world_size if error is None else ctx.rank], device=ctx.device)
    failed = int(collectives.reduce(flag, "min", ctx))
    if failed == ctx.world_size:
        return
    message = collectives.broadcast(str(error) if error is not None else "", ctx, src=failed)
    if error is not None:
        raise error
    raise CheckpointError(f"rank {failed} could not take part in the checkpoint: {message}")
