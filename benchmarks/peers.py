"""peers: one step through stratagem, Lightning Fabric and Accelerate, each vs plain PyTorch.

Not one of ``python -m benchmarks``: the peers are never dependencies of
stratagem or its tests. ``nox -s bench_peers`` installs them in its own
environment and runs both modes::

    python -m benchmarks.peers                                     # single device (CPU)
    torchrun --standalone --nproc-per-node 2 -m benchmarks.peers   # 2-rank DDP, gloo

Every contender trains its own copy of the same model (same weights, SGD,
MSE) and is timed against the hand-written step in its own interleaved
pairing, so each ratio is "this library / plain PyTorch" and the libraries
can be read side by side. Under torchrun, stratagem's ``ddp()`` joins the
process group first; Fabric and Accelerate find it initialised and use it,
and the plain side wraps its copy in ``DistributedDataParallel`` over it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stratagem as sg
from benchmarks import report, steps
from benchmarks.report import Case, Result, compare
from benchmarks.timing import fixed_threads, interleave, per_call

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS: dict[str, tuple[Callable[[], torch.nn.Module], tuple[int, int, int], int]] = {
    # name: (build, (batch, features in, features out), steps per timed block)
    "tiny: Linear(16, 16), batch 8": (lambda: torch.nn.Linear(16, 16), (8, 16, 16), 50),
    "medium: MLP 512-2048-512, batch 64": (lambda: steps.mlp(512, 2048, 512), (64, 512, 512), 1),
}


def fabric_step(model: torch.nn.Module, distributed: bool) -> steps.Step:
    from lightning_fabric import Fabric  # a peer: only bench_peers installs it

    fabric = Fabric(
        accelerator="cpu",
        devices=dist.get_world_size() if distributed else 1,
        strategy="ddp" if distributed else "auto",
    )
    if distributed:
        fabric.launch()  # torchrun started the processes; the group exists, so this only checks
    module, optimizer = fabric.setup(model, steps.sgd(model))

    def train_step(batch: steps.Batch) -> None:
        loss = steps.mse(module, fabric.to_device(batch))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def accelerate_step(model: torch.nn.Module, distributed: bool) -> steps.Step:
    from accelerate import Accelerator  # a peer: only bench_peers installs it

    del distributed  # Accelerate reads torchrun's environment itself
    accelerator = Accelerator(cpu=True)
    module, optimizer = accelerator.prepare(model, steps.sgd(model))

    def train_step(batch: steps.Batch) -> None:
        inputs, targets = (tensor.to(accelerator.device) for tensor in batch)
        loss = steps.mse(module, (inputs, targets))
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def contenders(
    build: Callable[[], torch.nn.Module], ctx: sg.Context, strategy: sg.Strategy
) -> dict[str, steps.Step]:
    """Plain first (its allocation order is the reference), then each library's copy."""
    plain_model, ours_model, fabric_model, accelerate_model = steps.copies(build, 4)
    distributed = ctx.world_size > 1
    plain_model = plain_model.to(ctx.device)
    if distributed:
        plain_model = DistributedDataParallel(plain_model, process_group=ctx.group)
    ours = strategy.wrap(ours_model, ctx)
    return {
        "plain": steps.plain_step(plain_model, steps.sgd(plain_model), ctx.device),
        "stratagem": steps.stratagem_step(strategy, ctx, ours, steps.sgd(ours)),
        "Lightning Fabric": fabric_step(fabric_model, distributed),
        "Accelerate": accelerate_step(accelerate_model, distributed),
    }


def measure(ctx: sg.Context, strategy: sg.Strategy, rounds: int) -> list[Case]:
    distributed = ctx.world_size > 1
    # Wall time across ranks (they wait on each other); CPU time in one process.
    clock = time.perf_counter if distributed else time.process_time
    cases = []
    for name, (build, shape, calls) in WORKLOADS.items():
        sides = contenders(build, ctx, strategy)
        batch = steps.random_batch(*shape, seed=1 + ctx.rank)
        plain = sides.pop("plain")

        def block(
            step: steps.Step, batch: steps.Batch = batch, calls: int = calls
        ) -> Callable[[], float]:
            timed = per_call(lambda: step(batch), calls, clock)
            if not distributed:
                return timed

            def together() -> float:
                dist.barrier()
                return timed()

            return together

        for library, step in sides.items():
            mine, theirs = interleave(block(step), block(plain), rounds=rounds)
            cases.append(compare(f"{name}: {library}", "s/step", mine, theirs))
    return cases


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "lightning-fabric", "lightning", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            continue
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few rounds: a smoke test")
    options = parser.parse_args(argv)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    strategy = sg.ddp() if distributed else sg.single_device("cpu")
    ctx = strategy.setup(sg.detect_env(os.environ))
    rounds = 4 if options.quick else (30 if distributed else 60)
    with fixed_threads():
        cases = measure(ctx, strategy, rounds)
    name = f"peers_{'ddp' if distributed else 'single'}"
    result = Result(
        benchmark=name,
        description=(
            f"Per-step time through stratagem, Lightning Fabric and Accelerate vs plain PyTorch, "
            f"{f'{ctx.world_size} gloo ranks, DDP' if distributed else 'single CPU device'}."
        ),
        config={"rounds": rounds, "world_size": ctx.world_size, "versions": versions()},
        cases=cases,
        quick=options.quick,
    )
    strategy.teardown(ctx)
    if ctx.rank == 0:
        out = RESULTS / "quick" if options.quick else RESULTS
        report.save(result, out)
        report.plot(result, out)
        print(report.table([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
