"""The one walk over batches and state trees: `map_tensors`, `tensors_in`, `map_leaves`.

A tree is a tensor, a tuple (named ones keep their type), a list, a mapping
(its type kept where it can be rebuilt from a dict), a dataclass instance (its
``init`` fields), or anything else, which is a leaf left as it is. Moving a
batch, casting it, tracing it and sending an optimizer's state all walk trees
this way, so a batch type one of them understands, all of them do.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

__all__ = ["leaves_in", "map_leaves", "map_tensors", "tensors_in"]

T = TypeVar("T")


def _mapping(tree: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    kind = type(tree)
    if kind is dict:
        return items
    if isinstance(tree, defaultdict):
        return defaultdict(tree.default_factory, items)
    try:
        return kind(items)  # type: ignore[call-arg]
    except TypeError:  # a mapping type that is not built from a dict: a plain dict instead
        return items


def _init_fields(instance: Any) -> dict[str, Any]:
    """Return the fields of a dataclass instance that ``dataclasses.replace`` takes, by name."""
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance) if f.init}


def map_leaves(fn: Callable[[T], Any], tree: Any, kind: type[T]) -> Any:
    """Return ``tree`` with every leaf of type ``kind`` replaced by ``fn(leaf)``.

    Containers are rebuilt, in order (a mapping's in its iteration order), so
    two trees of the same structure are visited leaf for leaf alike.

    Args:
        fn: what to make of each leaf.
        tree: the tree to walk (see the module's docstring for what is looked into).
        kind: the type of the leaves ``fn`` is given; a ``kind`` is never looked into.

    Returns:
        A tree of the same structure; everything that is not a ``kind`` and not a
        container is the same object as in ``tree``.
    """
    if isinstance(tree, kind):
        return fn(tree)
    shape = type(tree)
    # A plain tuple or list (the usual batch) is found by type alone; any tuple or list has its
    # tensor leaves mapped without a call each.
    if shape is tuple or shape is list or isinstance(tree, (tuple, list)):
        mapped = [fn(v) if isinstance(v, kind) else map_leaves(fn, v, kind) for v in tree]
        if shape is tuple:
            return tuple(mapped)
        if isinstance(tree, list):
            return mapped
        return type(tree)(*mapped) if hasattr(tree, "_fields") else tuple(mapped)
    if isinstance(tree, Mapping):
        return _mapping(tree, {k: map_leaves(fn, v, kind) for k, v in tree.items()})
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {name: map_leaves(fn, v, kind) for name, v in _init_fields(tree).items()}
        return dataclasses.replace(tree, **changes)
    return tree


def leaves_in(tree: Any, kind: type[T]) -> Iterator[T]:
    """Yield every leaf of type ``kind`` in ``tree``, in the order `map_leaves` visits them.

    Args:
        tree: the tree to walk; nothing is rebuilt.
        kind: the type of the leaves to yield.

    Returns:
        An iterator over the leaves.
    """
    if isinstance(tree, kind):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for value in tree:
            yield from leaves_in(value, kind)
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from leaves_in(value, kind)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for value in _init_fields(tree).values():
            yield from leaves_in(value, kind)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Return ``tree`` with every tensor replaced by ``fn(tensor)``.

    Args:
        fn: what to make of each tensor.
        tree: the batch or state to walk.

    Returns:
        A tree of the same structure (`map_leaves` with ``kind=torch.Tensor``).

    Example:
        >>> import torch
        >>> map_tensors(lambda t: t.double(), {"x": (torch.ones(1), "label")})["x"][0].dtype
        torch.float64
    """
    return map_leaves(fn, tree, torch.Tensor)


def tensors_in(tree: Any) -> Iterator[torch.Tensor]:
    """Yield every tensor in ``tree``, in the order `map_tensors` visits them.

    Args:
        tree: the batch or state to walk; nothing is rebuilt.

    Returns:
        An iterator over the tensors (`leaves_in` with ``kind=torch.Tensor``).

    Example:
        >>> import torch
        >>> [tuple(t.shape) for t in tensors_in([torch.ones(2), {"y": torch.ones(3, 1)}])]
        [(2,), (3, 1)]
    """
    return leaves_in(tree, torch.Tensor)
