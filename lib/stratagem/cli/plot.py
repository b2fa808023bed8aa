"""``stratagem demo --plot``: the runs' loss curves as a PNG, drawn by matplotlib (an extra).

matplotlib is imported only here and only when asked for, so the library and
the rest of the command work without it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

from stratagem.errors import UsageError

__all__ = ["NEEDS_MATPLOTLIB", "check", "write"]

NEEDS_MATPLOTLIB = (
    "--plot needs matplotlib, which is not installed; "
    "run pip install 'stratagem[plot]', or leave --plot out."
)

Curve = Sequence[tuple[float, float]]


def check(path: str) -> Path:
    """Refuse a ``--plot`` path that could not be written, before any rank trains.

    Raises:
        UsageError: not a ``.png`` path, a missing directory, or no matplotlib.

    Example:
        >>> check("loss.pdf")
        Traceback (most recent call last):
        ...
        stratagem.errors.UsageError: --plot loss.pdf: the plot is a PNG; pass a path ending in .png.
    """
    target = Path(path)
    if target.suffix.lower() != ".png":
        raise UsageError(f"--plot {path}: the plot is a PNG; pass a path ending in .png.")
    if not target.parent.is_dir():
        raise UsageError(
            f"--plot {path}: there is no directory {str(target.parent)!r}; create it first."
        )
    try:
        import matplotlib  # noqa: F401  (whether it imports is the question)
    except ImportError:
        raise UsageError(NEEDS_MATPLOTLIB) from None
    return target


def write(path: Path, curves: Mapping[str, Curve], title: str) -> None:
    """Draw each named ``(epoch, loss)`` curve on one set of axes and save it as a PNG."""
    # The object API on an Agg canvas: no pyplot, no global backend, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    drawn = [(name, curve) for name, curve in curves.items() if curve]
    # Dashed over solid: runs that agree (the point of --compare) stay visible on top of each other.
    for (name, curve), style in zip(drawn, itertools.cycle(("-", "--", ":")), strict=False):
        epochs, losses = zip(*curve, strict=True)
        axes.plot(epochs, losses, style, label=name, linewidth=1.2)
    if drawn:
        axes.legend()
        if all(loss > 0 for _, curve in drawn for _, loss in curve):
            axes.set_yscale("log")  # cross-entropy falls by orders of magnitude
    axes.set_xlabel("epoch")
    axes.set_ylabel("training loss (mean over ranks)")
    axes.set_title(title)
    figure.savefig(path, format="png")
