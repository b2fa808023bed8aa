"""Modules split over ranks (a pipeline's stages): who writes each part, what spans the parts.

A strategy whose ``wrap`` returns one rank's part of a module (``pipeline()``'s
stages, keyed by the unsplit module's names) marks it with `hold_part`.
`save` then writes each part once, from the rank the mark names as its
writer, and stores the optimizer of a part flattened per parameter name
(``state.<name>.<slot>``, ``param_groups.<name>.<setting>``): nested, every
rank's ``param_groups`` would sit under the same keys with different
parameters, and one rank's would stand for all. `load` reads on each rank the
keys its part holds; a key counts as unexpected only if no rank holds it.
Clipping by norm reduces the norm over the mark's group, so that it is the
whole module's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import torch

if TYPE_CHECKING:
    from stratagem.env import Context

__all__ = ["Part", "everyones", "everyones_ties", "gather_objects", "hold_part", "part_of"]


@attrs.frozen
class Part:
    """How this rank's part of a module split over ranks is saved.

    Attributes:
        writes: whether this rank writes the part (its first replica does).
        reference: the global rank that writes this part: what ``verify``
            compares this rank's copy with.
        group: the process group of the ranks that hold the other parts: what
            a norm over the whole module (clipping) is reduced over.
    """

    writes: bool
    reference: int
    group: Any = None


# id -> (weak reference, part) of each marked module, removed when the module dies: by id, so a
# program with no pipeline pays a truth test (a WeakKeyDictionary's get makes a weakref each time).
_PARTS: dict[int, tuple[weakref.ref[torch.nn.Module], Part]] = {}


def hold_part(module: torch.nn.Module, part: Part) -> None:
    """Mark ``module`` (what a wrap returned) as this rank's part of a module split over ranks."""
    key = id(module)

    def forget(_: weakref.ref[torch.nn.Module]) -> None:
        _PARTS.pop(key, None)

    _PARTS[key] = (weakref.ref(module, forget), part)


def part_of(module: torch.nn.Module) -> Part | None:
    """Return the `Part` that ``module`` was marked with, or None for a whole module."""
    if not _PARTS:
        return None
    found = _PARTS.get(id(module))
    if found is None or found[0]() is not module:
        return None
    return found[1]


def gather_objects(obj: Any, ctx: Context) -> list[Any]:
    """Return every rank's picklable ``obj``, rank 0's first (over the CPU: `host_group`).

    ``[obj]`` on a world of one. Here, below the collectives, so that this
    module can gather too; `stratagem.collectives` re-exports it.
    """
    if ctx.group is None or ctx.world_size == 1:
        return [obj]
    import torch.distributed as dist

    from stratagem.env import host_group

    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, obj, group=host_group(ctx))
    return everyone


def everyones(mine: Iterable[str], ctx: Context) -> set[str]:
    """Return the union over every rank of ``mine`` (the keys each rank's parts hold)."""
    return {key for theirs in gather_objects(sorted(mine), ctx) for key in theirs}


def everyones_ties(mine: dict[str, dict[str, str]], ctx: Context) -> dict[str, dict[str, str]]:
    """Return every rank's tied keys (``{entry: {alias: original}}``) merged: parts differ."""
    everyone = gather_objects(mine, ctx)
    if len(everyone) == 1:
        return mine
    merged: dict[str, dict[str, str]] = {}
    for theirs in everyone:
        for name, aliases in theirs.items():
            merged.setdefault(name, {}).update(aliases)
    return merged
