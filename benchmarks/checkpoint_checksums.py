"""checkpoint_checksums: ``save``/``load`` with a CRC-32 per file against the same without.

The issue's rule: checksums are on by default only if they cost under 5 % of
save time. Both sides save the same state (a model and its Adam state) to
fresh directories on the same disk, alternately, so that page-cache and disk
state affect both alike; wall time, since a save waits on ``fsync``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

import stratagem as sg
from benchmarks.report import Result, compare
from benchmarks.timing import fixed_threads, interleave

NAME = "checkpoint_checksums"
DESCRIPTION = "save and load with checksums vs without (same state, same disk, wall time)."
SIZES = (1024, 2048)  # square Linear layers: 4 MiB and 16 MiB of weights, 3x with Adam state


def state(size: int) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Linear(size, size)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, size)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "step": 1}


def run(quick: bool = False) -> Result:
    rounds = 3 if quick else 15
    ctx = sg.single_device("cpu").setup(sg.Env())
    root = Path(tempfile.mkdtemp(prefix="stratagem-bench-"))
    cases = []
    try:
        with fixed_threads():
            for size in SIZES:
                saved = state(size)
                count = iter(range(10**6))

                def save(checksums: bool, saved: dict[str, object] = saved, count=count) -> float:
                    path = root / f"c{next(count)}"
                    start = time.perf_counter()
                    sg.checkpoint.save(path, saved, ctx, checksums=checksums)
                    elapsed = time.perf_counter() - start
                    shutil.rmtree(path)
                    return elapsed

                with_sums, without = interleave(
                    lambda: save(True), lambda: save(False), rounds=rounds
                )
                megabytes = 3 * 4 * size * size / 2**20
                cases.append(
                    compare(f"save, {megabytes:.0f} MiB", "s", with_sums, without, target=1.05)
                )
                for checksums in (True, False):
                    sg.checkpoint.save(root / f"load-{checksums}", saved, ctx, checksums=checksums)
                live = state(size)

                def load(checksums: bool, live: dict[str, object] = live) -> float:
                    start = time.perf_counter()
                    sg.checkpoint.load(root / f"load-{checksums}", live, ctx)
                    return time.perf_counter() - start

                checked, unchecked = interleave(
                    lambda: load(True), lambda: load(False), rounds=rounds
                )
                cases.append(compare(f"load, {megabytes:.0f} MiB", "s", checked, unchecked))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={"rounds": rounds, "sizes": list(SIZES), "directory": str(root.parent)},
        cases=cases,
        quick=quick,
    )
