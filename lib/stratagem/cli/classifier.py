"""The demo's training function, written as a user of stratagem writes one.

`train` is plain PyTorch with a strategy in the middle; it is defined at
module level so that spawned ranks can import it, and it runs unchanged under
every built-in strategy and combinator.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sized
from typing import Any, cast

import attrs
import torch
from torch.utils.data import DataLoader, TensorDataset

from stratagem.checkpoint.entries import unwrap
from stratagem.cli.data import Data
from stratagem.cli.progress import Progress
from stratagem.env import Context
from stratagem.strategy import StrategyLike

__all__ = ["Config", "Result", "train"]


@attrs.frozen
class Config:
    """How to train.

    Attributes:
        epochs: the epoch to end at (a resumed run trains only the missing ones).
        batch_size: samples per rank and step.
        accumulate: micro-batches per optimizer step (as ``accumulate`` was given).
        lr: SGD learning rate.
        checkpoint: directory to save to at every epoch's end, or ``None``.
        resume: start from the checkpoint in ``checkpoint``.
        shown: whether rank 0 shows progress.
        labels: more plain values to save in each checkpoint (how the run was configured).
    """

    epochs: int
    batch_size: int
    accumulate: int = 1
    lr: float = 0.1
    checkpoint: str | None = None
    resume: bool = False
    shown: bool = True
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class Result:
    """What a run ends with.

    Attributes:
        loss: the last epoch's mean loss, over its steps and over the ranks.
        accuracy: the test accuracy at the end.
        samples_per_s: training throughput over all ranks.
        curve: ``(epoch, loss)`` for every step trained in this run, the loss a mean over
            the ranks; ``epoch`` counts fractions (1.5 is halfway through the second epoch).
        parameters: the full, unsharded values (rank 0 only).
    """

    loss: float
    accuracy: float
    samples_per_s: float
    curve: tuple[tuple[float, float], ...]
    parameters: dict[str, torch.Tensor] | None


def build_model(features: int, classes: int) -> torch.nn.Module:
    """Build a small MLP, with the same initial weights on every rank and in every run."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(features, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, 128),
        torch.nn.ReLU(),
        torch.nn.Linear(128, classes),
    )


def cross_entropy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Return the loss; passed to ``strategy.step``, so autocast and wrappers stay around it."""
    inputs, targets = batch
    return torch.nn.functional.cross_entropy(model(inputs).float(), targets)


def epoch_loader(data: Data, epoch: int, batch_size: int) -> DataLoader[Any]:
    """Return this epoch's batches, in an order drawn from the epoch number alone.

    Shuffled here rather than by the loader, so that any world size deals the
    same global batches (``shard`` gives rank r positions r, r + N, ...) and a
    resumed run sees what the uninterrupted run would have seen.
    """
    order = torch.randperm(len(data.train_inputs), generator=torch.Generator().manual_seed(epoch))
    dataset = TensorDataset(data.train_inputs[order], data.train_targets[order])
    return DataLoader(dataset, batch_size=batch_size, drop_last=True)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, on the CPU in float32 (FSDP's shards are gathered: a collective)."""
    full = {}
    for name, parameter in unwrap(model).named_parameters():
        value = parameter.detach()
        if hasattr(value, "full_tensor"):  # a DTensor, sharded by fsdp()
            value = value.full_tensor()
        full[name] = value.float().cpu()
    return full


def accuracy(strategy: StrategyLike, model: torch.nn.Module, data: Data, ctx: Context) -> float:
    """Return the test accuracy, each rank scoring its share of the test set."""
    inputs = data.test_inputs[ctx.rank :: ctx.world_size]
    targets = data.test_targets[ctx.rank :: ctx.world_size]
    with torch.no_grad():
        logits = strategy.step(model, inputs, ctx)
    correct = (logits.argmax(dim=1).cpu() == targets).sum()
    return strategy.reduce(correct, "sum", ctx).item() / len(data.test_targets)


def train(strategy: StrategyLike, ctx: Context, data: Data, config: Config) -> Result:
    """Train a classifier on ``data``; return the final loss, test accuracy and throughput."""
    torch.set_num_threads(1)  # a model this small runs slower on more threads per rank
    model = strategy.wrap(build_model(data.features, data.classes), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    first, loss = 0, float("nan")
    if config.resume and config.checkpoint is not None:
        saved = strategy.load(config.checkpoint, state, ctx)
        first, loss = saved["epoch"], saved["loss"]
        if ctx.is_main and config.shown:
            left = (
                ""
                if first < config.epochs
                else f"; nothing left to train for --epochs {config.epochs}"
            )
            print(f"resumed from {config.checkpoint} at epoch {first}{left}", flush=True)
    seen, elapsed, curve = 0, 0.0, list[tuple[float, float]]()
    for epoch in range(first, config.epochs):
        loader = strategy.shard(epoch_loader(data, epoch, config.batch_size), ctx)
        # Whole accumulation windows only: no gradients are left half-summed at a checkpoint.
        steps = len(cast(Sized, loader)) // config.accumulate * config.accumulate
        total = steps * config.batch_size * ctx.world_size
        label = f"epoch {epoch + 1:>{len(str(config.epochs))}}/{config.epochs}"
        progress = Progress(label, total, ctx.is_main and config.shown)
        start, losses = time.perf_counter(), list[float]()
        for batch in itertools.islice(loader, steps):
            step_loss = strategy.step(model, batch, ctx, forward=cross_entropy)
            strategy.backward(step_loss, model, ctx)
            strategy.update(optimizer, model, ctx)
            losses.append(step_loss.item())
            progress.advance(config.batch_size * ctx.world_size, losses[-1])
        elapsed += time.perf_counter() - start
        seen += total
        # One collective per epoch, as for a scalar: every step's loss, averaged over the ranks.
        means = strategy.reduce(torch.tensor(losses or [0.0]), "mean", ctx)
        loss = means.mean().item()
        curve += [
            (epoch + (i + 1) / steps, value) for i, value in enumerate(means[:steps].tolist())
        ]
        progress.close(loss)
        if config.checkpoint is not None:
            values = {"epoch": epoch + 1, "loss": loss, "data": data.name, **config.labels}
            strategy.save(config.checkpoint, {**state, **values}, ctx)
    score = accuracy(strategy, model, data, ctx)
    parameters = full_parameters(model)
    return Result(
        loss=loss,
        accuracy=score,
        samples_per_s=seen / elapsed if elapsed else 0.0,
        curve=tuple(curve),
        parameters=parameters if ctx.is_main else None,
    )
