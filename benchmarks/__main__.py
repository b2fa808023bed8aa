"""Run the benchmarks: ``python -m benchmarks [NAME ...] [--quick] [--out DIR]``."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import (
    allreduce_step,
    async_save,
    checked_cost,
    checkpoint_checksums,
    compiled_step,
    ddp_step,
    ddp_torchrun,
    dry_run,
    fsdp_step,
    import_time,
    launch_startup,
    memory,
    mesh_step,
    overhead_us,
    overhead_vs_params,
    pipeline_step,
    report,
    restart_time,
    scaling,
    single_step,
    world_examples,
)

BENCHMARKS: dict[str, Callable[[bool], report.Result]] = {
    module.NAME: module.run
    for module in (
        import_time,
        single_step,
        ddp_step,
        ddp_torchrun,
        fsdp_step,
        overhead_vs_params,
        overhead_us,
        checked_cost,
        world_examples,
        allreduce_step,
        memory,
        scaling,
        compiled_step,
        launch_startup,
        checkpoint_checksums,
        async_save,
        restart_time,
        mesh_step,
        pipeline_step,
        dry_run,
    )
}
RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"any of {', '.join(BENCHMARKS)} (default: all)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="few rounds: a smoke test, not a measurement"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="results folder (default: results/, or results/quick/ with --quick)",
    )
    options = parser.parse_args(argv)
    unknown = [name for name in options.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    out = options.out or (RESULTS / "quick" if options.quick else RESULTS)
    for name in options.names or BENCHMARKS:
        print(f"{name} ...", end=" ", flush=True)
        start = time.perf_counter()
        result = BENCHMARKS[name](options.quick)
        path = report.save(result, out)
        drawn = report.plot(result, out)
        print(
            f"{time.perf_counter() - start:.0f} s -> {path}" + (f", {drawn.name}" if drawn else "")
        )
    # The summary covers every result in the folder, so running one benchmark keeps the others.
    results = [
        report.load(out / f"{name}.json") for name in BENCHMARKS if (out / f"{name}.json").exists()
    ]
    text = report.summary(results)
    (out / "summary.md").write_text(text)
    print()
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
