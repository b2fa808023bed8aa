"""ddp_torchrun: ``sg.ddp()`` under a real torchrun vs hand-written DistributedDataParallel.

The parent starts ``torchrun`` (2 ranks, c10d rendezvous on 127.0.0.1, the
agent's store) on this module. Each rank calls ``sg.launch(on_rank,
sg.ddp(), devices=2)``, which runs in place: ``ddp()``'s setup reads the
torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``) and joins the default
process group through the agent's store. On each rank, three MLPs with the
same weights: one wrapped by ``strategy.wrap``, two wrapped by hand in
``DistributedDataParallel(model)`` over that default group (the second for
the A/A control). The hand-written side cannot also call
``init_process_group`` itself: a process has one default group, and both
sides must share it to be timed on the same ranks.

Blocks of steps (SGD, MSE) alternate, the order flipping every round; each
block starts after a barrier, so both ranks time the same steps. Rank 0
writes its timings (wall and CPU time per step) as JSON to a file the parent
reads back. Reported: the median of the per-round ratio, its IQR, and a 95 %
bootstrap interval of the median (in the notes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.nn.parallel import DistributedDataParallel

import stratagem as sg
from benchmarks import steps
from benchmarks.ddp_step import timed_block
from benchmarks.launch_startup import free_port
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, bootstrap_median, fixed_threads, interleave

NAME = "ddp_torchrun"
DESCRIPTION = (
    "Time per DDP step on 2 gloo ranks started by torchrun: sg.ddp() (its setup joins "
    "torchrun's world) vs plain DistributedDataParallel on the same default process group."
)
TARGET = 1.01  # issue 21
RANKS = 2
ROOT = Path(__file__).resolve().parent.parent
CLOCKS = ("wall", "CPU")


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (256, 1024, 1024, 256)
    batch: int = 32  # per rank
    steps_per_block: int = 5  # short blocks: load changes hit both sides alike
    rounds: int = 150


def on_rank(
    strategy: sg.StrategyLike, ctx: sg.Context, config: Config, out: str
) -> dict[str, object]:
    """Body of each torchrun rank: time ``strategy``'s DDP against two hand-made ones."""
    assert ctx.group is not None
    group = ctx.group
    with fixed_threads(THREADS):
        ours, plain, control = steps.contenders(
            strategy,
            ctx,
            lambda: steps.mlp(*config.widths),
            # What a torchrun script writes: DDP over the default process group.
            wrap_by_hand=lambda module: DistributedDataParallel(module.to(ctx.device)),
        )
        batch = steps.random_batch(
            config.batch, config.widths[0], config.widths[-1], seed=1 + ctx.rank
        )

        def timed(step: steps.Step) -> Callable[[], tuple[float, float]]:
            return lambda: timed_block(step, batch, config.steps_per_block, group)

        timings: dict[str, object] = {
            "launcher": ctx.env.source,
            "agent_store": ctx.env.agent_store,
            "world_size": ctx.world_size,
        }
        for label, first in (("ours", ours), ("control", control)):
            timings[label], timings[f"plain vs {label}"] = interleave(
                timed(first), timed(plain), rounds=config.rounds
            )
    if ctx.is_main:
        Path(out).write_text(json.dumps(timings) + "\n")
    return timings


def torchrun(config: Config, out: Path) -> float:
    """Run this module's ``main`` under torchrun; return the seconds the whole run took."""
    path = os.pathsep.join([str(ROOT / "lib"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "OMP_NUM_THREADS": str(THREADS)}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={RANKS}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=bench-{uuid.uuid4().hex[:8]}",
        "--module",
        "benchmarks.ddp_torchrun",
        str(out),
        "--config",
        json.dumps(dataclasses.asdict(config)),
    ]
    start = time.perf_counter()
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=env,
        text=True,
        timeout=600,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}")
    return time.perf_counter() - start


def interval_note(firsts: Sequence[float], seconds: Sequence[float]) -> str:
    low, high = bootstrap_median([a / b for a, b in zip(firsts, seconds, strict=True)])
    return f"median ratio 95% bootstrap interval {low:.3f} .. {high:.3f}"


def cases_of(timings: dict[str, list[list[float]]], config: Config) -> list[Case]:
    name = f"MLP {'-'.join(map(str, config.widths))}, batch {config.batch}/rank, {RANKS} ranks"
    cases = []
    for label, key in ((f"ddp() vs DistributedDataParallel: {name}", "ours"),
                       (f"{name}: A/A control, plain vs plain", "control")):  # fmt: skip
        for index, clock in enumerate(CLOCKS):
            firsts = [times[index] for times in timings[key]]
            plains = [times[index] for times in timings[f"plain vs {key}"]]
            notes = interval_note(firsts, plains)
            timed_wall = key == "ours" and clock == "wall"
            if timed_wall:
                rates = f"{1 / min(firsts):.1f} vs {1 / min(plains):.1f} steps/s at best"
                notes = f"{notes}; {rates}"
            cases.append(
                compare(
                    f"{label}, {clock} time",
                    "s/step",
                    firsts,
                    plains,
                    target=TARGET if timed_wall else None,
                    notes=notes,
                )
            )
    return cases


def run(quick: bool = False) -> Result:
    config = Config(rounds=4) if quick else Config()
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as scratch:
        out = Path(scratch, "rank0.json")
        elapsed = torchrun(config, out)
        timings = json.loads(out.read_text())
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            **dataclasses.asdict(config),
            "ranks": RANKS,
            "backend": "gloo",
            "launcher": f"torchrun, c10d rendezvous on 127.0.0.1 ({timings['launcher']} env, "
            f"agent store: {timings['agent_store']})",
            "clock": "wall (the target) and CPU time per step, rank 0",
            "run_seconds": elapsed,
        },
        cases=cases_of(timings, config),
        quick=quick,
    )


def main(argv: list[str] | None = None) -> int:
    """The torchrun side: ``python -m benchmarks.ddp_torchrun OUT --config JSON`` on each rank."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ddp_torchrun")
    parser.add_argument("out", help="file rank 0 writes its timings to")
    parser.add_argument("--config", required=True, help="a Config as JSON")
    options = parser.parse_args(argv)
    fields = json.loads(options.config)
    config = Config(**{**fields, "widths": tuple(fields["widths"])})
    sg.launch(on_rank, sg.ddp(), devices=RANKS, args=(config, options.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
