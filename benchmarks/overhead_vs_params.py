"""overhead_vs_params: stratagem's added time per step as the number of parameter tensors grows.

A model of ``count`` parameter tensors of 4 numbers each, used in one
``torch.stack``, so that the step stays short (and the measurement sharp)
while the optimizer and autograd handle many tensors. stratagem's step,
backward and update do a fixed amount of work around the user's; the added
time should stay flat while the step itself grows.
"""

from __future__ import annotations

import torch

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result
from benchmarks.timing import fixed_threads

NAME = "overhead_vs_params"
DESCRIPTION = "Added time per single-device step for 10, 100 and 1000 parameter tensors."
COUNTS = {10: 40, 100: 10, 1000: 1}  # parameter tensors: steps per block (about 25 ms)


class Tensors(torch.nn.Module):
    """``count`` parameter tensors of shape (4,), summed and applied to the input."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(torch.randn(4) for _ in range(count))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * torch.stack(tuple(self.weights)).sum(0)


def measure(count: int, rounds: int) -> list[Case]:
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    ours, plain, control = steps.contenders(strategy, ctx, lambda: Tensors(count))
    batch = steps.random_batch(8, 4, 4)
    cases = steps.compare_steps(
        f"{count} parameter tensors",
        ours,
        plain,
        control,
        batch,
        calls=COUNTS[count],
        rounds=rounds,
    )
    strategy.teardown(ctx)
    return cases


def run(quick: bool = False) -> Result:
    rounds = 5 if quick else 100
    with fixed_threads():
        cases = [case for count in COUNTS for case in measure(count, rounds)]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            "rounds": rounds,
            "steps_per_block": COUNTS,
            "batch": 8,
            "optimizer": "SGD(lr=1e-4)",
        },
        cases=cases,
        quick=quick,
    )
