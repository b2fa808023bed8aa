"""``resume_or_start``: the one call a loop makes to survive restarts.

A world that torchrun restarted (``--max-restarts``), a job that SLURM
requeued, or a run started again by hand all begin the same way: find the
newest complete checkpoint in the run's directory, load it, and go on from
the step it recorded. The first run finds none and starts from ``state`` as
it is. See docs/launching.md ("Restarts").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stratagem.checkpoint.directory import latest, run_directory
from stratagem.checkpoint.entries import VALUE_KINDS, capture_rng, classify, restore_rng
from stratagem.checkpoint.rank_zero import on_main
from stratagem.env import Context, check_context
from stratagem.fields import StrategyLike
from stratagem.validators import require

__all__ = ["resume_or_start"]

logger = logging.getLogger("stratagem.checkpoint")


def resume_or_start(
    directory: str | os.PathLike[str],
    state: Mapping[str, Any],
    strategy: StrategyLike,
    ctx: Context,
    *,
    rng: bool = True,
) -> dict[str, Any]:
    """Load the newest complete checkpoint in ``directory`` into ``state``, if there is one.

    Rank 0 looks for it (`stratagem.checkpoint.latest`: a save that was
    interrupted is never chosen) and every rank loads the same one with
    ``strategy.load``, so modules, optimizers, RNG states and `per_rank`
    entries (a loader's position) are restored as a resumed run needs them.

    Args:
        directory: where the run saves its checkpoints, one subdirectory each
            (``directory/step_100``, ...); it need not exist yet.
        state: what the run saves, by name, as it passes it to ``save``.
        strategy: the strategy whose ``load`` reads the checkpoint.
        ctx: the joined world; every rank must call it.
        rng: restore the checkpoint's RNG states (default). ``False`` keeps this
            run's, for a script that re-seeds after loading (as ``load(...,
            rng=False)`` does), whatever ``strategy.load`` restores.

    Returns:
        The plain values (and this rank's per-rank values) of the checkpoint
        loaded; with none to load, those of ``state`` as given. Either way the
        loop reads its position from the same keys (``values["step"]``).

    Raises:
        UsageError: an argument is malformed.
        CheckpointError: the newest checkpoint does not match ``state`` or is
            unreadable (it is not skipped: a damaged checkpoint is news).

    Example:
        >>> import tempfile, torch, stratagem as sg
        >>> strategy = sg.single_device("cpu")
        >>> ctx = strategy.setup(sg.Env())
        >>> model = torch.nn.Linear(2, 1)
        >>> run = tempfile.mkdtemp()
        >>> sg.resume_or_start(run, {"model": model, "step": 0}, strategy, ctx)
        {'step': 0}
        >>> sg.checkpoint.save(f"{run}/step_5", {"model": model, "step": 5}, ctx)
        >>> sg.resume_or_start(run, {"model": model, "step": 0}, strategy, ctx)
        {'step': 5}
    """
    run_directory(directory, "resume_or_start")  # here, so that every rank raises its error
    hint = "; the arguments are (directory, state, strategy, ctx)"
    ok = isinstance(strategy, StrategyLike)
    require(ok, "resume_or_start: 'strategy'", "a Strategy", strategy, hint=hint)
    check_context(ctx, "resume_or_start")
    require(isinstance(rng, bool), "resume_or_start: 'rng'", "True or False", rng)
    entries = classify(state, "resume_or_start")
    found = on_main(ctx, lambda: latest(directory))
    if found is None:
        if ctx.is_main:
            logger.info("resume_or_start: no checkpoint in %s; starting afresh", directory)
        return {e.name: e.target for e in entries if e.kind in VALUE_KINDS}
    if ctx.is_main:
        logger.info("resume_or_start: resuming from %s", found)
    kept = None if rng else capture_rng(ctx.device)
    values: dict[str, Any] = strategy.load(Path(found), state, ctx)
    if kept is not None:
        restore_rng(kept, ctx.device)
    return values
