"""What combinators share: finding an applied combinator, and the optimizer-step pipeline.

A combinator that must act just before the optimizer steps (unscaling,
clipping) does not replace ``update``: it passes the inner ``update`` an
`OptimizerHook` whose ``step`` runs the combinator's code around the real
step. The inner update (DDP's, or the Horovod-style one that all-reduces
first) keeps its own order, and hooks run in the order combinators were applied.

A layer is an attrs callable with an ``inner`` field, stratagem's or a
user's: nothing here, nor in the kit, tells the two apart. A layer that
distributes (splits over a mesh, registers a communication hook) or only
records says so with a class attribute ``in_reference = False``: the kit's
derived reference, which is the stack without its distribution, leaves it
out (`in_reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from stratagem.errors import CombinatorError, UsageError, describe
from stratagem.optimizer_hooks import root_optimizer
from stratagem.strategy import FIELD_SIGNATURES, Strategy, StrategyLike, not_a_strategy

__all__ = [
    "CombinatorError",
    "applied",
    "check_strategy",
    "gradients",
    "in_reference",
    "outermost_picks",
    "peel",
    "rebased",
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


def _layers(value: object) -> list[object]:
    out = [value]
    while hasattr(value, "inner"):
        value = value.inner
        out.append(value)
    return out


def _is_layer(value: object) -> bool:
    kind = type(value)
    return attrs.has(kind) and "inner" in attrs.fields_dict(kind)


def peel(field: Any) -> tuple[list[Any], Any]:
    """Split a field into its combinator layers (outermost first) and the function they wrap.

    A layer is an attrs callable with an ``inner`` field, as every combinator
    makes; the first value that is not one is the base (a built-in's field, or
    the user's own function).

    Example:
        >>> import stratagem as sg
        >>> layers, base = peel(sg.with_clipping(sg.ddp(), max_norm=1.0).update)
        >>> [type(layer).__name__ for layer in layers], base is sg.ddp().update
        (['ClipUpdate'], True)
    """
    layers = []
    while _is_layer(field):
        layers.append(field)
        field = field.inner
    return layers, field


def in_reference(layer: object) -> bool:
    """Whether the kit's derived reference keeps ``layer``: unless its class says it distributes.

    Example:
        >>> import stratagem as sg
        >>> in_reference(sg.with_clipping(sg.ddp(), max_norm=1.0).update)
        True
        >>> in_reference(sg.traced(sg.ddp(), print).update)
        False
    """
    return getattr(type(layer), "in_reference", True) is not False


def rebased(layers: list[Any], base: Any) -> Any:
    """Return ``layers`` (as `peel` gave them) rebuilt around another ``base``."""
    for layer in reversed(layers):
        base = attrs.evolve(layer, inner=base)
    return base


def applied(strategy: StrategyLike, kind: type[Any]) -> Any | None:
    """Return the first field wrapper of type ``kind`` found in ``strategy``, or None."""
    for name in FIELD_SIGNATURES:
        for layer in _layers(getattr(strategy, name)):
            if isinstance(layer, kind):
                return layer
    return None


def gradients(optimizer: Any) -> list[torch.Tensor]:
    """Every gradient the optimizer will apply."""
    params = (p for group in root_optimizer(optimizer).param_groups for p in group["params"])
    return [p.grad for p in params if p.grad is not None]
