"""What combinators share: their checks, the modules a policy picks, the gradients to step.

A combinator that must act just before the optimizer steps (unscaling,
clipping) does not replace ``update``: it passes the inner ``update`` an
`OptimizerHook` whose ``step`` runs the combinator's code around the real
step. The inner update (DDP's, or the Horovod-style one that all-reduces
first) keeps its own order, and hooks run in the order combinators were applied.
How a layer describes itself (peeling, the reference, fields it holds) is
`stratagem.layers`; finding one in a record is `stratagem.strategy.applied`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from stratagem.errors import CombinatorError, UsageError, describe
from stratagem.optimizer_hooks import root_optimizer
from stratagem.strategy import Strategy, not_a_strategy

__all__ = ["CombinatorError", "check_strategy", "gradients", "outermost_picks"]


def outermost_picks(
    module: torch.nn.Module, policy: Callable[[torch.nn.Module], bool], who: str
) -> list[torch.nn.Module]:
    """Return the submodules (not the root) ``policy`` picks, asking none inside a pick.

    A pick's descendants are not asked: recomputing or compiling the outer
    module covers them. ``who`` names the policy in the error for a non-bool answer.

    Raises:
        UsageError: ``policy`` returned something other than True or False.
    """
    picked: list[str] = []
    found: list[torch.nn.Module] = []
    for name, child in module.named_modules():
        if not name or any(name.startswith(f"{p}.") for p in picked):
            continue
        decision = policy(child)
        if not isinstance(decision, bool):
            raise UsageError(
                f"wrap: {who} must return True or False, but returned {describe(decision)} "
                f"for {name!r} (a {type(child).__name__})."
            )
        if decision:
            picked.append(name)
            found.append(child)
    return found


def check_strategy(strategy: object, combinator: str) -> Strategy:
    """Return ``strategy`` if it is a `Strategy`: combinators derive only from the record itself.

    Raises:
        UsageError: it is not.
    """
    if not isinstance(strategy, Strategy):
        raise UsageError(not_a_strategy(strategy, combinator))
    return strategy


def gradients(optimizer: Any) -> list[torch.Tensor]:
    """Every gradient the optimizer will apply."""
    params = (p for group in root_optimizer(optimizer).param_groups for p in group["params"])
    return [p.grad for p in params if p.grad is not None]
