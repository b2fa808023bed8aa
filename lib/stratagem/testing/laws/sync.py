"""Law ``ranks-in-sync``: after each synchronising update every rank holds the same state.

Written with the helpers a user's own law uses (see docs/testing.md): run a
function on every rank (`run_on`), take the whole state by key (`snapshot`),
compare with tolerances (`first_difference`), report (`LawViolation`).
"""

from __future__ import annotations

from typing import Any, Unpack

import torch

from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import LawViolation, holds_part, own_share, run_on, summarize
from stratagem.testing.laws.options import Forward, OptimizerFactory, TrainingOptions, settings
from stratagem.testing.laws.parallel import perturbed
from stratagem.testing.laws.state import first_difference, snapshot
from stratagem.testing.tolerances import law_tolerances

__all__ = ["check_ranks_in_sync"]


def _states(
    strategy: StrategyLike,
    ctx: Any,
    module: torch.nn.Module,
    batch: torch.Tensor,
    updates: int,
    make_optimizer: OptimizerFactory,
    synced_init: bool,
    forward: Forward,
) -> tuple[list[dict[str, torch.Tensor]], bool]:
    model = strategy.wrap(perturbed(module, 0 if synced_init else ctx.rank), ctx)
    optimizer = make_optimizer(model.parameters())
    mine = own_share(batch, ctx)
    states = []
    for _ in range(updates):
        loss = strategy.step(model, mine, ctx, forward=forward)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        states.append(snapshot(model, optimizer))
    return states, holds_part(ctx)


def check_ranks_in_sync(
    strategy: StrategyLike,
    module: torch.nn.Module,
    batch: torch.Tensor,
    **options: Unpack[TrainingOptions],
) -> None:
    """Law ``ranks-in-sync``: after every k-th update (``contract.sync_every``) ranks agree.

    Parameters and optimizer state must be equal on every rank within the
    contract's tolerances (with ``sync_every > 1`` or ``optimizer_state`` other
    than ``"replicated"``, the parameters only: each rank keeps its own
    optimizer state). Buffers are left to ``data-parallel-step``: even
    broadcast ones differ between two forwards. A pipeline's stages compare
    the keys they share (the same stage of another data-parallel replica).
    ``**options`` (`TrainingOptions`): ``world``, ``world_size=2``,
    ``optimizer=sgd_momentum``, ``forward=squares_mean``, ``contract``.

    Raises:
        LawViolation: a rank's state differs from rank 0's at a synchronisation point.
        TypeError: a keyword the law does not take.
    """
    given = settings("check_ranks_in_sync", options, TrainingOptions)
    terms, size = given.terms(), given.ranks
    updates = 2 * terms.sync_every
    runs = run_on(
        given.world, size, _states, strategy, module, batch, updates, given.optimizer,
        terms.synced_init, given.forward,
    )  # fmt: skip
    results = [states for states, _ in runs]
    partial = any(part for _, part in runs)
    rtol, atol = terms.tolerances(law_tolerances(strategy, "ranks-in-sync"))
    inputs = f"module={summarize(module)}, batch={summarize(batch)}, updates={updates}"
    buffers = {f"model.{name}" for name, _ in module.named_buffers()}
    for index in range(terms.sync_every - 1, updates, terms.sync_every):
        reference = results[0][index]
        # Local SGD averages parameters; each rank's optimizer state is its own. Sharded
        # optimizer state (ZeRO-1) is each rank's own too.
        own_optimizer = terms.per_rank_optimizer or terms.optimizer_state == "sharded"
        keys = tuple(
            k
            for k in reference
            if k not in buffers and (not own_optimizer or k.startswith("model."))
        )
        for rank in range(1, size):
            held = keys if not partial else tuple(k for k in keys if k in results[rank][index])
            difference = first_difference(
                results[rank][index], reference, rtol=rtol, atol=atol, keys=held
            )
            if difference is not None:
                raise LawViolation(
                    "ranks-in-sync",
                    strategy,
                    inputs,
                    f"after update {index + 1}, rank {rank}: {difference.describe('rank 0')}; "
                    "the ranks should agree here (a missing broadcast, or an update that "
                    "does not synchronise, gives this)",
                )
