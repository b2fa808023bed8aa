"""One training step, written twice: through a stratagem strategy, and by hand in plain PyTorch.

Both do the same work: move the batch to the device, forward, MSE loss,
backward, SGD step, gradients set to ``None``. Benchmarks time one against the other.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch.nn import functional

import stratagem as sg
from benchmarks.report import Case, compare
from benchmarks.timing import interleave, per_call

Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], None]


def mse(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    inputs, targets = batch
    return functional.mse_loss(model(inputs), targets)


def stratagem_step(
    strategy: sg.StrategyLike,
    ctx: sg.Context,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> Step:
    """A step through the strategy's ``step``, ``backward`` and ``update`` fields."""

    def train_step(batch: Batch) -> None:
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)

    return train_step


def plain_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> Step:
    """The same step as a device-agnostic hand-written loop has it."""

    def train_step(batch: Batch) -> None:
        inputs, targets = batch
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        loss = functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-4)


def copies(
    build: Callable[[], torch.nn.Module], count: int, seed: int = 0
) -> list[torch.nn.Module]:
    """``count`` modules with identical architecture and initial weights."""
    modules = []
    for _ in range(count):
        torch.manual_seed(seed)
        modules.append(build())
    return modules


def random_batch(batch: int, features_in: int, features_out: int, seed: int = 1) -> Batch:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, features_in, generator=generator),
        torch.randn(batch, features_out, generator=generator),
    )


def mlp(*widths: int) -> torch.nn.Module:
    """Linear layers of the given widths with ReLU between them."""
    layers: list[torch.nn.Module] = []
    for index, (width_in, width_out) in enumerate(itertools.pairwise(widths)):
        if index:
            layers.append(torch.nn.ReLU())
        layers.append(torch.nn.Linear(width_in, width_out))
    return torch.nn.Sequential(*layers)


def contenders(
    strategy: sg.StrategyLike,
    ctx: sg.Context,
    build: Callable[[], torch.nn.Module],
    *,
    wrap_by_hand: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
    write_step: Callable[[torch.nn.Module, torch.optim.Optimizer, torch.device], Step] = plain_step,
    write_ours: Callable[
        [sg.StrategyLike, sg.Context, torch.nn.Module, torch.optim.Optimizer], Step
    ] = stratagem_step,
) -> tuple[Step, Step, Step]:
    """Steps on three copies of ``build()``: by hand, through ``strategy``, and by hand again.

    Returns ``(ours, plain, control)``. ``wrap_by_hand`` prepares the
    hand-written copies (default: move to the device); ``write_step`` writes
    their step, ``write_ours`` the strategy's. The reference (plain) copy is
    built and prepared first, and ours and the control after it in the same
    way: the order in which models are allocated shifts their step time by a
    percent or two, and this way it shifts both ratios alike, so the control
    shows it.
    """
    plain_model, ours_model, control_model = copies(build, 3)
    prepare = wrap_by_hand or (lambda module: module.to(ctx.device))
    plain_model = prepare(plain_model)
    model = strategy.wrap(ours_model, ctx)
    control_model = prepare(control_model)
    return (
        write_ours(strategy, ctx, model, sgd(model)),
        write_step(plain_model, sgd(plain_model), ctx.device),
        write_step(control_model, sgd(control_model), ctx.device),
    )


def compare_steps(
    name: str,
    ours: Step,
    plain: Step,
    control: Step,
    batch: Batch,
    *,
    calls: int,
    rounds: int,
) -> list[Case]:
    """Time ``ours`` against ``plain``, then ``control`` (a second plain copy) against ``plain``.

    The second case, an A/A comparison, shows the ratio that noise alone
    produces. Each block is ``calls`` steps, timed in CPU time (`per_call`).
    """

    def block(step: Step) -> Callable[[], float]:
        return per_call(lambda: step(batch), calls)

    cases = []
    for label, first in ((name, ours), (f"{name}: A/A control, plain vs plain", control)):
        times_first, times_plain = interleave(block(first), block(plain), rounds=rounds)
        cases.append(compare(label, "s/step", times_first, times_plain))
    return cases
