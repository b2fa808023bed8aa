"""Layers: how a combinator's field wraps another, described by the layer itself.

A layer is an attrs record with an ``inner`` field, callable as the field it
wraps; a combinator substitutes a field with a layer over the old one. The
same rules hold for stratagem's layers and a user's, and nothing here tells
the two apart. A layer class may say two things about itself, as class attributes:

- ``in_reference = False``: it distributes (splits over a mesh, registers a
  communication hook) or only records, so the kit's derived reference (the
  stack without its distribution) leaves it out (`in_reference`). Every other
  layer stays, with its arithmetic.
- ``holds = ("no_sync",)``: besides ``inner``, it holds other fields of the
  record, each in an attribute of the field's name (``accumulate``'s step
  enters the record's ``no_sync``). The record keeps these current: whenever a
  `stratagem.Strategy` is built (by a factory, a combinator or
  ``attrs.evolve``), each held field is re-pointed to the record's own
  (`repointed`), so a field substituted later (traced, a user's ``no_sync``)
  is the one the layer calls, whatever order they were applied in.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["held", "in_reference", "is_layer", "peel", "rebased", "repointed"]


def is_layer(value: object) -> bool:
    """Whether ``value`` is a layer: an attrs record with an ``inner`` field."""
    kind = type(value)
    return attrs.has(kind) and "inner" in attrs.fields_dict(kind)


def peel(field: Any) -> tuple[list[Any], Any]:
    """Split a field into its layers (outermost first) and the function they wrap.

    The first value that is not a layer is the base (a built-in's field, or
    the user's own function).

    Example:
        >>> import stratagem as sg
        >>> layers, base = peel(sg.with_clipping(sg.ddp(), max_norm=1.0).update)
        >>> [type(layer).__name__ for layer in layers], base is sg.ddp().update
        (['ClipUpdate'], True)
    """
    layers = []
    while is_layer(field):
        layers.append(field)
        field = field.inner
    return layers, field


def rebased(layers: list[Any], base: Any) -> Any:
    """Return ``layers`` (as `peel` gave them) rebuilt around another ``base``."""
    for layer in reversed(layers):
        base = attrs.evolve(layer, inner=base)
    return base


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


def held(layer: object) -> tuple[str, ...]:
    """Return the fields of the record ``layer`` holds besides ``inner`` (its class's ``holds``).

    Example:
        >>> import stratagem as sg
        >>> held(sg.accumulate(sg.ddp(), 4).step), held(sg.ddp().step)
        (('no_sync',), ())
    """
    return tuple(getattr(type(layer), "holds", ()))


def repointed(field: Any, fields: Mapping[str, Any]) -> Any:
    """Return ``field`` with every held field of its layers replaced by the one in ``fields``.

    ``field`` itself is returned when nothing changes (the usual case: a
    layer holds the record's own field), so a record compares equal to itself.
    """
    layers, base = peel(field)
    out = []
    for layer in layers:
        swaps = {
            name: fields[name]
            for name in held(layer)
            if name in fields and getattr(layer, name) is not fields[name]
        }
        out.append(attrs.evolve(layer, **swaps) if swaps else layer)
    return rebased(out, base) if any(map(operator.is_not, out, layers)) else field
