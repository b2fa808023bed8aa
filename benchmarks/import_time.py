"""import_time: ``import stratagem`` vs ``import torch``, each in a fresh interpreter.

stratagem imports torch, so the difference is what stratagem adds on top of
it. Each probe times its imports inside the child (interpreter start-up is
not counted), and the two probes alternate so that disk caches and machine
load affect both alike. The torch import varies by tens of milliseconds
from one process to the next, so the stratagem probe also times its own
part alone: ``import torch`` first, then ``import stratagem`` (and attrs).
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
    "import stratagem; print(u - t, time.perf_counter() - u)"
)


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
    own: list[float] = []

    def with_stratagem() -> float:
        torch_part, stratagem_part = probe(STRATAGEM, environ)
        own.append(stratagem_part)
        return torch_part + stratagem_part

    ours, torch_only = interleave(
        with_stratagem, lambda: probe(TORCH, environ)[0], rounds=rounds, warmup=1
    )
    own = own[-rounds:]  # drop the warm-up
    alone = Stats.of(own)
    notes = (
        f"stratagem's own part, after torch: {seconds(alone.median)} "
        f"({seconds(alone.q1)} .. {seconds(alone.q3)})"
    )
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={"rounds": rounds, "python": sys.executable, "own_part": dataclasses.asdict(alone)},
        cases=[compare("import stratagem vs import torch", "s", ours, torch_only, notes=notes)],
        quick=quick,
    )
