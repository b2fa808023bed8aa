"""Text read from a file, made safe to print: control characters shown as escapes, never obeyed.

A checkpoint's entry names, keys and values are whatever its writer chose; printed raw, an
ANSI escape would recolour or clear the terminal and a newline would forge a line of output.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs

if TYPE_CHECKING:  # imported where used: the checkpoint package is loaded only when needed
    from stratagem.checkpoint import Description
    from stratagem.checkpoint.entries import Kind

__all__ = ["printable", "printable_description"]


def _escape(character: str) -> str:
    return character.encode("unicode_escape").decode("ascii")


def printable(text: object, *, lines: bool = False) -> str:
    r"""Return ``str(text)`` with every non-printable character escaped as Python writes it.

    Args:
        text: what to show; anything but a ``str`` is shown as ``str()`` gives it.
        lines: keep newlines, for text whose lines were laid out by the caller.

    Example:
        >>> print(printable("\x1b[2Jmodel\nforged"))
        \x1b[2Jmodel\nforged
    """
    return "".join(c if c.isprintable() or (lines and c == "\n") else _escape(c) for c in str(text))


def _keys_escaped(value: Any) -> Any:
    """Return ``value`` with the string keys of its mappings escaped.

    Their values are shown by ``repr``, which escapes already.
    """
    if not isinstance(value, Mapping):
        return value
    return {printable(k) if isinstance(k, str) else k: _keys_escaped(v) for k, v in value.items()}


def printable_description(description: Description) -> str:
    """Render what `describe` read, every name, key and value from the file escaped."""
    entries = {printable(k): cast("Kind", printable(v)) for k, v in description.entries.items()}
    escaped = attrs.evolve(
        description,
        path=Path(printable(description.path)),
        entries=entries,
        tensors={printable(k): v for k, v in description.tensors.items()},
        values={printable(k): _keys_escaped(v) for k, v in description.values.items()},
    )
    return printable(escaped, lines=True)  # and whatever else the layout shows
