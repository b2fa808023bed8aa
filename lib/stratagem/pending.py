"""Work that must finish before a world's process group goes: saves still writing.

`stratagem.checkpoint.background` registers here what its saves need at the
end (wait for the save in flight, drop the gloo group it wrote over); the
teardown fields call `settle` first. It sits below both, so that leaving a
process group does not import the checkpoint package.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["at_teardown", "settle"]

_finishers: list[Callable[[], None]] = []


def at_teardown(finish: Callable[[], None]) -> None:
    """Call ``finish`` at the next `settle` (once, whatever the others do)."""
    if finish not in _finishers:
        _finishers.append(finish)


def settle() -> None:
    """Run every registered finisher; re-raise the first error after all have run."""
    first: BaseException | None = None
    while _finishers:
        finish = _finishers.pop(0)
        try:
            finish()
        except BaseException as error:  # the others must still run: a save left behind is lost
            first = first or error
    if first is not None:
        raise first
