"""import_time: ``import stratagem`` vs ``import torch``, each in a fresh interpreter.

Each probe times its imports inside the child (interpreter start-up is not
counted), and the two probes alternate so that disk caches and machine load
affect both alike. The torch import varies by tens of milliseconds from one
process to the next, so the stratagem probe also times its own parts alone,
after ``import torch``: the import itself, then the first use of
``single_device`` (which loads the modules a strategy needs, attrs among them,
since the package's re-exports are lazy), then every other public name.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import stratagem
from benchmarks.report import Result, compare, seconds
from benchmarks.timing import Stats, interleave

NAME = "import_time"
DESCRIPTION = "import stratagem vs import torch, in fresh subprocesses (python -c)."
TORCH = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
STRATAGEM = (
    "import time; t = time.perf_counter(); import torch; u = time.perf_counter(); "
    "import stratagem; v = time.perf_counter(); stratagem.single_device; "
    "w = time.perf_counter(); [getattr(stratagem, n) for n in stratagem.__all__]; "
    "x = time.perf_counter(); print(u - t, v - u, w - v, x - w)"
)
PARTS = ("import stratagem", "first use: stratagem.single_device", "every other public name")


def probe(code: str, environ: dict[str, str]) -> list[float]:
    """The seconds that ``code`` prints, run in a new interpreter."""
    completed = subprocess.run(
        [sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True
    )
    return [float(word) for word in completed.stdout.split()]


def run(quick: bool = False) -> Result:
    rounds = 3 if quick else 15
    # Both probes get the same path, the one this process found stratagem on.
    where = str(Path(stratagem.__file__).resolve().parent.parent)
    path = os.pathsep.join(filter(None, [where, os.environ.get("PYTHONPATH")]))
    environ = {**os.environ, "PYTHONPATH": path}
    parts: list[list[float]] = []

    def with_stratagem() -> float:
        torch_part, *own = probe(STRATAGEM, environ)
        parts.append(own)
        return torch_part + own[0]

    ours, torch_only = interleave(
        with_stratagem, lambda: probe(TORCH, environ)[0], rounds=rounds, warmup=1
    )
    by_part = [Stats.of(column) for column in zip(*parts[-rounds:], strict=True)]  # no warm-up
    notes = "; ".join(
        f"{name}: {seconds(stats.median)} ({seconds(stats.q1)} .. {seconds(stats.q3)})"
        for name, stats in zip(PARTS, by_part, strict=True)
    )
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            "rounds": rounds,
            "python": sys.executable,
            "own_part": dataclasses.asdict(by_part[0]),
            "parts_after_torch": {
                name: dataclasses.asdict(stats) for name, stats in zip(PARTS, by_part, strict=True)
            },
        },
        cases=[compare("import stratagem vs import torch", "s", ours, torch_only, notes=notes)],
        quick=quick,
    )
