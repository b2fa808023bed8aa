"""What rank 0 shows while the demo trains: a tqdm bar on a terminal, else a line per epoch."""

from __future__ import annotations

import sys
import time
from typing import Any

import attrs

__all__ = ["Progress", "table"]


def _tqdm(total: int, description: str) -> Any:
    # A bar only where someone watches: logs and captured output get one line per epoch.
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="sample", leave=True, dynamic_ncols=True)


@attrs.define
class Progress:
    """One epoch's display: call `advance` per step and `close` at the epoch's end.

    Attributes:
        description: the bar's label, e.g. ``"epoch 3/10"``.
        total: samples the epoch will see, over all ranks.
        shown: whether this process displays anything (rank 0 of a shown run).
    """

    description: str
    total: int
    shown: bool
    _bar: Any = attrs.field(default=None, init=False)
    _start: float = attrs.field(factory=time.perf_counter, init=False)
    _seen: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if self.shown:
            self._bar = _tqdm(self.total, self.description)

    def rate(self) -> float:
        """Return the samples per second so far in this epoch."""
        return self._seen / max(time.perf_counter() - self._start, 1e-9)

    def advance(self, samples: int, loss: float) -> None:
        """Count ``samples`` more (over all ranks) and show the latest loss."""
        self._seen += samples
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self._bar.update(samples)

    def close(self, loss: float) -> None:
        """End the epoch with its mean loss."""
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}")
            self._bar.close()
        elif self.shown:
            print(f"{self.description}  loss {loss:.4f}  {self.rate():,.0f} samples/s", flush=True)


def table(rows: list[dict[str, str]]) -> str:
    """Format rows of equal keys as a plain text table, a header first.

    Example:
        >>> print(table([{"strategy": "ddp_spawn", "loss": "0.1"}]))
        strategy   loss
        ddp_spawn  0.1
    """
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    lines = [[c.ljust(widths[c]) for c in columns]]
    lines += [[r[c].ljust(widths[c]) for c in columns] for r in rows]
    return "\n".join("  ".join(cells).rstrip() for cells in lines)
