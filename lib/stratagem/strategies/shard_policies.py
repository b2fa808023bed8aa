"""Shard policies for ``fsdp()``: plain functions ``shard_when(module) -> bool``.

Any callable with that signature is a policy; these are the ready-made ones,
as frozen attrs callables so that a strategy holding them pickles to spawned
ranks and prints readably.
"""

from __future__ import annotations

import sys
from typing import Protocol

import attrs
import torch

from stratagem.errors import UsageError, describe

__all__ = [
    "AboveParameters",
    "EveryModuleOf",
    "ShardPolicy",
    "above_parameters",
    "every_module_of",
    "is_sharded",
]


class ShardPolicy(Protocol):
    """Which submodules get their own ``fully_shard`` group."""

    def __call__(self, module: torch.nn.Module, /) -> bool:
        """Return whether to shard ``module`` (its sharded descendants are already sharded)."""
        ...


def _module_types(
    instance: object, attribute: attrs.Attribute[tuple[type, ...]], value: tuple[object, ...]
) -> None:
    bad = [t for t in value if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
    if not value or bad:
        shown = describe(bad[0]) if bad else "nothing"
        raise UsageError(
            f"every_module_of: pass one or more torch.nn.Module subclasses (got {shown}), "
            "e.g. every_module_of(torch.nn.TransformerEncoderLayer)."
        )


@attrs.frozen(repr=False)
class EveryModuleOf:
    """Shard policy: shard every module that is an instance of one of ``types``."""

    types: tuple[type[torch.nn.Module], ...] = attrs.field(validator=_module_types)

    def __call__(self, module: torch.nn.Module) -> bool:
        return isinstance(module, self.types)

    def __repr__(self) -> str:
        return f"every_module_of({', '.join(t.__qualname__ for t in self.types)})"


def every_module_of(*types: type[torch.nn.Module]) -> EveryModuleOf:
    """Return a policy that shards every module of the given types (a transformer's blocks).

    Raises:
        UsageError: no types, or one is not a ``torch.nn.Module`` subclass.

    Example:
        >>> policy = every_module_of(torch.nn.Linear)
        >>> policy(torch.nn.Linear(2, 2)), policy(torch.nn.ReLU())
        (True, False)
    """
    return EveryModuleOf(types)


def _count(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(
            f"above_parameters: 'count' must be a non-negative int (got {describe(value)})."
        )


def _unsharded_numel(module: torch.nn.Module) -> int:
    """Parameter elements of ``module`` that no sharded descendant already holds."""
    seen: set[int] = set()
    total, stack = 0, [module]
    while stack:
        current = stack.pop()
        for parameter in current.parameters(recurse=False):
            if id(parameter) not in seen:  # a shared parameter counts once
                seen.add(id(parameter))
                total += parameter.numel()
        stack.extend(child for child in current.children() if not is_sharded(child))
    return total


@attrs.frozen
class AboveParameters:
    """Shard policy: shard a module holding more than ``count`` parameter elements.

    Elements already held by a sharded descendant do not count, as in FSDP1's
    size-based policy, so parents of sharded blocks stay in the root's group.
    """

    count: int = attrs.field(validator=_count)

    def __call__(self, module: torch.nn.Module) -> bool:
        return _unsharded_numel(module) > self.count

    def __repr__(self) -> str:
        return f"above_parameters({self.count})"


def above_parameters(count: int) -> AboveParameters:
    """Return a policy that shards modules with more than ``count`` unsharded parameter elements.

    Raises:
        UsageError: ``count`` is not a non-negative int.

    Example:
        >>> policy = above_parameters(100)
        >>> policy(torch.nn.Linear(10, 10)), policy(torch.nn.Linear(9, 9))  # 110 and 90 elements
        (True, False)
    """
    return AboveParameters(count)


def is_sharded(module: torch.nn.Module) -> bool:
    fsdp_module = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    return fsdp_module is not None and isinstance(module, fsdp_module.FSDPModule)
