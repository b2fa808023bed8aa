"""Results: the records a benchmark returns, their JSON files, the markdown summary, plots."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.timing import THREADS, Stats


@dataclass(frozen=True)
class Case:
    """One comparison: stratagem against plain PyTorch, in seconds, paired by round."""

    name: str
    unit: str  # what one value measures, e.g. "s/step"
    stratagem: Stats
    plain: Stats
    added: Stats  # stratagem - plain, per round
    ratio: Stats  # stratagem / plain, per round
    target: float | None = None  # the median ratio should not exceed this
    notes: str = ""

    @property
    def meets_target(self) -> bool | None:
        return None if self.target is None else self.ratio.median <= self.target


def compare(
    name: str,
    unit: str,
    stratagem: Sequence[float],
    plain: Sequence[float],
    *,
    target: float | None = None,
    notes: str = "",
) -> Case:
    """Summarise two series timed round by round (``interleave``) as a `Case`."""
    pairs = list(zip(stratagem, plain, strict=True))
    return Case(
        name=name,
        unit=unit,
        stratagem=Stats.of(stratagem),
        plain=Stats.of(plain),
        added=Stats.of([a - b for a, b in pairs]),
        ratio=Stats.of([a / b for a, b in pairs]),
        target=target,
        notes=notes,
    )


@dataclass(frozen=True)
class Result:
    """What one benchmark measured, and how."""

    benchmark: str
    description: str
    config: dict[str, Any]
    cases: list[Case]
    quick: bool = False
    machine: dict[str, Any] = field(default_factory=lambda: machine())


def machine() -> dict[str, Any]:
    """Describe where the numbers come from: they are only comparable as ratios."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads_per_process": THREADS,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def save(result: Result, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result.benchmark}.json"
    data = dataclasses.asdict(result)
    for case, record in zip(result.cases, data["cases"], strict=True):
        record["meets_target"] = case.meets_target
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    return path


def load(path: Path) -> Result:
    data = json.loads(path.read_text())
    cases = [
        Case(
            name=record["name"],
            unit=record["unit"],
            stratagem=Stats(**record["stratagem"]),
            plain=Stats(**record["plain"]),
            added=Stats(**record["added"]),
            ratio=Stats(**record["ratio"]),
            target=record["target"],
            notes=record["notes"],
        )
        for record in data.pop("cases")
    ]
    return Result(**data, cases=cases)


def seconds(value: float, *, signed: bool = False) -> str:
    """Format seconds with a readable unit: ``0.000123`` is ``123 µs``."""
    size = abs(value)
    scale, unit = next(
        ((s, u) for s, u in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")) if size >= s), (1e-9, "ns")
    )
    text = f"{value / scale:{'+' if signed else ''}.3g} {unit}"
    return text


def size_in_bytes(value: float, *, signed: bool = False) -> str:
    """Format bytes with a binary unit: ``1572864`` is ``1.5 MiB``."""
    scale, unit = next(
        ((s, u) for s, u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if abs(value) >= s),
        (1, "B"),
    )
    return f"{value / scale:{'+' if signed else ''}.3g} {unit}"


def table(results: Sequence[Result]) -> str:
    """One markdown row per case of every result."""
    lines = [
        "| benchmark | case | stratagem | plain | added (IQR) | ratio | ratio IQR | target "
        "| notes |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for result in results:
        name = result.benchmark + (" (quick)" if result.quick else "")
        for case in result.cases:
            per = "" if case.unit == "B" else case.unit.removeprefix("s")  # "s/step" -> "/step"
            show = size_in_bytes if case.unit == "B" else seconds
            if case.target is None:
                target = "—"
            else:
                target = f"≤ {case.target:g} {'✓' if case.meets_target else '✗ missed'}"
            added = (
                f"{show(case.added.median, signed=True)}{per} "
                f"({show(case.added.q1, signed=True)} .. {show(case.added.q3, signed=True)})"
            )
            lines.append(
                f"| {name} | {case.name} | {show(case.stratagem.median)}{per} "
                f"| {show(case.plain.median)}{per} | {added} | {case.ratio.median:.3f} "
                f"| {case.ratio.q1:.3f} .. {case.ratio.q3:.3f} | {target} | {case.notes} |"
            )
    return "\n".join(lines)


def summary(results: Sequence[Result]) -> str:
    """The markdown document written to ``summary.md``."""
    machines = {(r.machine["cpu"], r.machine["cores"], r.machine["torch"]) for r in results}
    where = "; ".join(f"{cpu}, {cores} cores, torch {version}" for cpu, cores, version in machines)
    return (
        "# stratagem benchmark summary\n\n"
        f"Machine: {where}; {THREADS} torch thread per process.\n\n"
        "Ratio = stratagem / plain PyTorch per round (median, interquartile range); "
        "added = stratagem - plain. Absolute times vary between machines; only the "
        "ratios are comparable.\n\n" + table(results) + "\n"
    )


def plot(result: Result, directory: Path) -> Path | None:
    """Plot ratio and added time per case to ``<benchmark>.png``; skip without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [case.name for case in result.cases]
    rows = range(len(names))
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.6 * len(names)), sharey=True)
    for axis, metric, scale, label in (
        (left, "ratio", 1.0, "stratagem / plain"),
        (right, "added", 1e6, "added µs (stratagem - plain)"),
    ):
        stats = [getattr(case, metric) for case in result.cases]
        medians = [s.median * scale for s in stats]
        errors = [
            [(s.median - s.q1) * scale for s in stats],
            [(s.q3 - s.median) * scale for s in stats],
        ]
        axis.errorbar(medians, rows, xerr=errors, fmt="o", capsize=4)
        axis.axvline(1.0 if metric == "ratio" else 0.0, color="grey", linewidth=0.8)
        axis.set_xlabel(label)
    for case in result.cases:
        if case.target is not None:
            left.axvline(case.target, color="red", linestyle="--", linewidth=0.8)
    left.set_yticks(list(rows), names)
    left.invert_yaxis()
    figure.suptitle(f"{result.benchmark}: median and interquartile range")
    figure.tight_layout()
    path = directory / f"{result.benchmark}.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
