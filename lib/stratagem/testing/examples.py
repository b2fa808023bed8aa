"""Tiny rank functions used by the kit's own docstrings (importable, so spawned ranks find them)."""

from __future__ import annotations

from stratagem.env import Context
from stratagem.strategy import StrategyLike

__all__ = ["rank_and_size"]


def rank_and_size(strategy: StrategyLike, ctx: Context) -> tuple[int, int]:
    """Return this rank and the world size."""
    return ctx.rank, ctx.world_size
