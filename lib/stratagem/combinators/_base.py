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

import attrs
import torch

from stratagem.errors import CombinatorError, UsageError, describe
from stratagem.layers import peel, rebased
from stratagem.meshes import JoinMesh
from stratagem.optimizer_hooks import root_optimizer
from stratagem.strategy import Strategy, applied, not_a_strategy
from stratagem.validators import decision

__all__ = [
    "CombinatorError",
    "check_once",
    "check_strategy",
    "gradients",
    "mesh_under",
    "outermost_picks",
    "waited",
    "with_mesh",
]


def outermost_picks(
    module: torch.nn.Module, policy: Callable[[torch.nn.Module], bool], who: str
) -> list[torch.nn.Module]:
    """Return the submodules (not the root) ``policy`` picks, asking none inside a pick.

    A pick's descendants are not asked: recomputing or compiling the outer
    module covers them. ``who`` names the policy in the error for a non-bool answer.

    Raises:
        UsageError: ``policy`` returned something other than True or False.
    """
    picked: dict[str, torch.nn.Module] = {}
    for name, child in module.named_modules():
        if not name or any(name.startswith(f"{p}.") for p in picked):
            continue
        if decision(policy, child, who, name):
            picked[name] = child
    return list(picked.values())


def check_strategy(strategy: object, combinator: str) -> Strategy:
    """Return ``strategy`` if it is a `Strategy`: combinators derive only from the record itself.

    Raises:
        UsageError: it is not.
    """
    if not isinstance(strategy, Strategy):
        raise UsageError(not_a_strategy(strategy, combinator))
    return strategy


def check_once(
    strategy: Strategy, layer: type, combinator: str, state: str, fix: str = "apply it once"
) -> None:
    """Refuse a combinator applied twice: ``layer`` (its own) is already in ``strategy``.

    Raises:
        CombinatorError: "<combinator>: strategy <name> <state>; <fix>."
    """
    if applied(strategy, layer) is not None:
        raise CombinatorError(f"{combinator}: strategy {strategy.name!r} {state}; {fix}.")


def mesh_under(
    strategy: Strategy, combinator: str, layer: type, not_on_a_mesh: str
) -> tuple[list[Any], JoinMesh]:
    """Return the setup layers of other combinators over ``strategy``'s `JoinMesh`, and it.

    A combinator that adds a mesh dimension evolves the `JoinMesh` and rebuilds
    the layers around it (`with_mesh`), so it applies on either side of the others.

    Raises:
        CombinatorError: ``layer`` (the combinator's) is already applied, or
            the setup builds no mesh (``not_on_a_mesh``, formatted with the
            strategy's ``name`` and its ``setup``).
    """
    check_once(strategy, layer, combinator, f"is already {combinator.replace('_', ' ')}")
    layers, joins = peel(strategy.setup)
    if not isinstance(joins, JoinMesh):
        raise CombinatorError(not_on_a_mesh.format(name=strategy.name, setup=describe(joins)))
    return layers, joins


def with_mesh(
    strategy: Strategy, under: tuple[list[Any], JoinMesh], suffix: str, mesh: dict[str, Any],
    **fields: Any,
) -> Strategy:  # fmt: skip
    """Return ``strategy`` named ``+suffix``, its `JoinMesh` evolved by ``mesh``, ``fields`` set."""
    layers, joins = under
    setup = rebased(layers, attrs.evolve(joins, **mesh))
    return attrs.evolve(strategy, name=f"{strategy.name}+{suffix}", setup=setup, **fields)


def waited(tensor: torch.Tensor) -> torch.Tensor:
    """Return a functional collective's result (an ``AsyncCollectiveTensor``), waited for."""
    wait = getattr(tensor, "wait", None)
    return wait() if callable(wait) else tensor


def gradients(optimizer: Any) -> list[torch.Tensor]:
    """Every gradient the optimizer will apply."""
    params = (p for group in root_optimizer(optimizer).param_groups for p in group["params"])
    return [p.grad for p in params if p.grad is not None]
