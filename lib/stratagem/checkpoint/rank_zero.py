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
    """Raise on every rank if any rank has an error (the failing rank raises its own)."""
    # On the context's device: NCCL reduces CUDA tensors only.
    flag = torch.tensor([0 if error is None else 1 + ctx.rank], device=ctx.device)
    failed = collectives.reduce(flag, "max", ctx)
    if error is not None:
        raise error
    if int(failed) > 0:
        raise CheckpointError(
            f"rank {int(failed) - 1} could not take part in the checkpoint; see its error."
        )
