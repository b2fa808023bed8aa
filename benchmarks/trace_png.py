"""Draw a Chrome trace that ``traced()`` wrote as a timeline PNG (one row per rank).

``python -m benchmarks.trace_png`` records the example trace of the docs (a
``ddp_spawn()`` loop on 2 gloo ranks, traced to a `ChromeTraceSink`) to
``docs/images/traced_ddp_2ranks.json`` and draws it to
``docs/images/traced_ddp_2ranks.png``. ``python -m benchmarks.trace_png
TRACE.json --out PNG`` draws any such trace. Needs matplotlib (the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

import stratagem as sg
from benchmarks import steps
from stratagem.combinators.tracing import LAUNCH_PID, ChromeTraceSink

IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
EXAMPLE = IMAGES / "traced_ddp_2ranks.json"
COLORS = {"step": "tab:blue", "collective": "tab:orange", "lifecycle": "tab:grey"}
STEPS = 5


def example_loop(strategy: sg.StrategyLike, ctx: sg.Context) -> None:
    """A few steps of the medium MLP, each followed by a loss reduce; a barrier at the end."""
    torch.set_num_threads(1)
    model = strategy.wrap(steps.copies(lambda: steps.mlp(512, 2048, 512), 1)[0], ctx)
    optimizer = steps.sgd(model)
    batch = steps.random_batch(64, 512, 512, seed=1 + ctx.rank)
    for _ in range(STEPS):
        loss = strategy.step(model, batch, ctx, forward=steps.mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        strategy.reduce(loss.detach(), "mean", ctx)
    strategy.barrier(ctx)


def record(path: Path) -> None:
    """Write the example trace to ``path`` (replacing it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    sg.launch(example_loop, sg.traced(sg.ddp_spawn(), ChromeTraceSink(path)), devices=2)


def _row(axis: Any, spans: list[dict[str, Any]], row: int, origin: float, label_ms: float) -> None:
    for span in spans:
        start, width = (span["ts"] - origin) / 1e3, span["dur"] / 1e3  # milliseconds
        color = COLORS.get(span["cat"], "tab:green")
        axis.broken_barh([(start, width)], (row - 0.35, 0.7), facecolors=color, edgecolor="white")
        if width > label_ms:  # label the spans wide enough to hold a name
            axis.text(start + width / 2, row, span["name"], ha="center", va="center", size=7)


def draw(trace: dict[str, Any], out: Path, title: str) -> Path:
    """Draw every rank's spans, one row per rank: the whole run, then its steps enlarged.

    The lower panel runs from the second ``step`` (the first one warms up)
    to the end of the last step or collective.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] != LAUNCH_PID]
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    pids = sorted({s["pid"] for s in spans})
    origin = min(s["ts"] for s in spans)
    starts = sorted(s["ts"] for s in spans if s["name"] == "step")
    busy = [s for s in spans if s["cat"] != "lifecycle"]
    zoom = (starts[min(len(starts) - 1, len(pids))], max(s["ts"] + s["dur"] for s in busy))
    figure, (whole, steps_axis) = plt.subplots(2, 1, figsize=(12, 2.0 + 1.6 * len(pids)))
    width_ms = (zoom[1] - zoom[0]) / 1e3
    for row, pid in enumerate(pids):
        mine = sorted((s for s in spans if s["pid"] == pid), key=lambda s: s["ts"])
        _row(whole, mine, row, origin, label_ms=(mine[-1]["ts"] - origin) / 1e3 / 40)
        inside = [s for s in mine if s["ts"] + s["dur"] > zoom[0] and s["ts"] < zoom[1]]
        _row(steps_axis, inside, row, zoom[0], label_ms=width_ms / 40)
    for axis in (whole, steps_axis):
        axis.set_yticks(range(len(pids)), [names.get(pid, f"pid {pid}") for pid in pids])
        axis.set_ylim(len(pids) - 0.5, -0.5)
    steps_axis.set_xlim(0, width_ms)
    whole.set_xlabel("milliseconds since the first call")
    steps_axis.set_xlabel("milliseconds since the second step began (the steps, enlarged)")
    whole.legend(
        handles=[Patch(color=c, label=cat) for cat, c in COLORS.items()],
        loc="upper center",
        fontsize=8,
        ncols=3,
    )
    whole.set_title(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trace_png", description=__doc__)
    parser.add_argument("trace", nargs="?", type=Path, help="a trace JSON (default: record one)")
    parser.add_argument("--out", type=Path, help="the PNG (default: beside the trace)")
    options = parser.parse_args(argv)
    path = options.trace
    if path is None:
        path = EXAMPLE
        record(path)
        title = f"traced(ddp_spawn()), 2 gloo ranks, MLP 512-2048-512, {STEPS} steps"
    else:
        title = path.name
    with open(path, encoding="utf-8") as file:
        trace = json.load(file)
    out = draw(trace, options.out or path.with_suffix(".png"), title)
    print(f"{path} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
