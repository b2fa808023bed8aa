"""single_step: time per training step through ``sg.single_device("cpu")`` vs plain PyTorch.

A tiny model shows the per-step overhead (the step itself costs little); a
medium MLP shows what is left of it when compute dominates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result
from benchmarks.timing import fixed_threads

NAME = "single_step"
DESCRIPTION = (
    "Per-step time (step, backward, update) through single_device('cpu') vs plain PyTorch."
)


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], torch.nn.Module]
    batch: int
    features_in: int
    features_out: int
    steps_per_block: int  # about 25 ms of work: short blocks pair up well under load
    target: float  # the ceiling on the median ratio


WORKLOADS = (
    Workload("tiny: Linear(16, 16), batch 8", lambda: torch.nn.Linear(16, 16), 8, 16, 16, 50, 1.05),
    Workload(
        "medium: MLP 512-2048-512, batch 64",
        lambda: steps.mlp(512, 2048, 512),
        64,
        512,
        512,
        1,
        1.02,
    ),
)


@dataclass(frozen=True)
class Precision:
    """A precision variant: how to derive the strategy, and the hand-written step it replaces."""

    name: str
    strategy: Callable[[sg.Strategy], sg.Strategy]
    plain_step: Callable[[torch.nn.Module, torch.optim.Optimizer, torch.device], steps.Step]
    max_rounds: int = 100  # bf16 matmuls are slow on CPUs without bf16 units: fewer rounds


def autocast_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    clip: float | None = None,
) -> steps.Step:
    """The hand-written bf16-mixed step: forward and loss under autocast, the rest outside.

    With ``clip``, ``clip_grad_norm_(model.parameters(), clip)`` before the optimizer steps.
    """

    def train_step(batch: steps.Batch) -> None:
        inputs, targets = batch
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = steps.mse(model, (inputs, targets))
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


PRECISIONS = (
    Precision("32-true", lambda strategy: strategy, steps.plain_step),
    Precision(
        "bf16-mixed",
        lambda strategy: sg.with_precision(strategy, "bf16-mixed"),
        autocast_step,
        max_rounds=30,
    ),
)


def measure(workload: Workload, precision: Precision, rounds: int) -> list[Case]:
    """Stratagem vs plain, then plain vs plain on a third copy: the noise floor of the ratio."""
    strategy = precision.strategy(sg.single_device("cpu"))
    ctx = strategy.setup(sg.Env())
    ours, plain, control = steps.contenders(
        strategy, ctx, workload.build, write_step=precision.plain_step
    )
    batch = steps.random_batch(workload.batch, workload.features_in, workload.features_out)
    case, control = steps.compare_steps(
        f"{workload.name}, {precision.name}",
        ours,
        plain,
        control,
        batch,
        calls=workload.steps_per_block,
        rounds=min(rounds, precision.max_rounds),
    )
    strategy.teardown(ctx)
    return [dataclasses.replace(case, target=workload.target), control]


def run(quick: bool = False) -> Result:
    rounds = 5 if quick else 100
    with fixed_threads():
        cases = [
            case
            for precision in PRECISIONS
            for workload in WORKLOADS
            for case in measure(workload, precision, rounds)
        ]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            "rounds": rounds,
            "steps_per_block": {w.name: w.steps_per_block for w in WORKLOADS},
            "optimizer": "SGD(lr=1e-4)",
            "loss": "mse",
        },
        cases=cases,
        quick=quick,
    )
