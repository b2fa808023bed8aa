"""`seed_everything`: one call seeds every generator a training script draws from."""

from __future__ import annotations

import random

import numpy as np
import torch

from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.validators import is_int, require

__all__ = ["seed_everything"]

_MAX_SEED = 2**32 - 1  # numpy's legacy generator takes seeds below 2**32


def seed_everything(seed: int, ctx: Context | None = None, *, per_rank: bool = False) -> int:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and every CUDA device).

    The same seed on every rank gives every rank the same initial weights
    (what `wrap` would otherwise broadcast) and the same dropout masks; with
    ``per_rank=True`` rank ``r`` takes ``seed + r``, for augmentation or
    noise that should differ between ranks. Data order is `shard`'s business:
    it shuffles with its own seed, the same on every rank.

    Args:
        seed: an int in ``[0, 2**32 - 1]``.
        ctx: the joined world; needed for ``per_rank``.
        per_rank: add the rank to the seed.

    Returns:
        The seed this rank used.

    Raises:
        UsageError: ``seed`` is not an int in range, or ``per_rank`` without a ``ctx``.

    Example:
        >>> import torch, stratagem as sg
        >>> sg.seed_everything(7)
        7
        >>> first = torch.rand(2)
        >>> _ = sg.seed_everything(7)
        >>> torch.equal(first, torch.rand(2))
        True
    """
    ok = is_int(seed, 0) and seed <= _MAX_SEED
    require(ok, "seed_everything: 'seed'", f"an int in [0, {_MAX_SEED}]", seed)
    if per_rank:
        if ctx is None:
            raise UsageError(
                "seed_everything: per_rank=True needs the context: seed_everything(seed, ctx, "
                "per_rank=True)."
            )
        seed = (seed + check_context(ctx, "seed_everything").rank) % (_MAX_SEED + 1)
    elif ctx is not None:
        check_context(ctx, "seed_everything")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too, lazily where CUDA is not yet up
    return seed
