"""`joined`: the world for top-level script code, as torchrun runs most research scripts.

``sg.launch(train, strategy)`` asks for the loop in a function; a script that
torchrun starts can instead keep its loop at the top level::

    with sg.joined(sg.ddp()) as ctx:
        model = strategy.wrap(build(), ctx)
        ...

Spawning strategies (``ddp_spawn()``) start processes that must import the
function they run, which a top-level loop is not: they need `launch`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from stratagem.env import Context, Env, check_env, detect_env
from stratagem.errors import UsageError
from stratagem.launching import Spawn
from stratagem.layers import peel
from stratagem.strategy import StrategyLike, not_a_strategy

__all__ = ["joined"]


@contextlib.contextmanager
def joined(strategy: StrategyLike, *, env: Env | None = None) -> Iterator[Context]:
    """Join the world this process belongs to for the ``with`` block, and leave it at the end.

    The world is what ``env`` describes (default: ``detect_env(os.environ)``):
    each process torchrun or SLURM started, or a world of one in a plain
    ``python`` process. ``teardown`` runs when the block ends, also when it
    raises. Use it at the top level of a script, under torchrun; with
    `launch`, stratagem joins for you.

    Args:
        strategy: the strategy whose ``setup`` and ``teardown`` join and leave.
        env: the world to join, if not this process's environment.

    Yields:
        The joined `Context`.

    Raises:
        UsageError: ``strategy`` is not strategy-like, or ``env`` not an `Env`.

    Example:
        >>> import torch, stratagem as sg
        >>> strategy = sg.single_device("cpu")
        >>> with sg.joined(strategy) as ctx:
        ...     strategy.reduce(torch.tensor([ctx.rank + 1.0]), "sum", ctx)
        tensor([1.])
    """
    if not isinstance(strategy, StrategyLike):
        raise UsageError(not_a_strategy(strategy, "joined"))
    world = detect_env(os.environ) if env is None else check_env(env, "joined")
    if isinstance(peel(strategy.launch)[1], Spawn) and not world.is_distributed:
        raise UsageError(
            f"joined: {getattr(strategy, 'name', 'the strategy')!r} spawns its ranks, which a "
            "block of top-level code cannot be sent to; run the script under torchrun with "
            "the in-place strategy (ddp(), fsdp()), or put the loop in a function for "
            "sg.launch(train, strategy, devices=N)."
        )
    ctx = strategy.setup(world)
    try:
        yield ctx
    finally:
        strategy.teardown(ctx)
