"""Train a small classifier on generated data with ``single_device()``: the README's first command.

Run: ``python examples/single_device.py [--epochs N] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg


def make_data(samples: int, seed: int) -> TensorDataset:
    """Two interleaved spirals in 2-D, a task a linear model cannot solve."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (samples,), generator=generator)
    radius = torch.rand(samples, generator=generator) * 3 + 0.2
    angle = radius * 2.5 + labels * torch.pi
    points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)
    points += 0.05 * torch.randn(points.shape, generator=generator)
    return TensorDataset(points, labels)


def cross_entropy(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return torch.nn.functional.cross_entropy(model(inputs), labels)


def train(strategy: sg.StrategyLike, ctx: sg.Context, epochs: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = strategy.wrap(
        torch.nn.Sequential(
            torch.nn.Linear(2, 64),
            torch.nn.Tanh(),
            torch.nn.Linear(64, 64),
            torch.nn.Tanh(),
            torch.nn.Linear(64, 2),
        ),
        ctx,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = strategy.shard(DataLoader(make_data(4096, seed=1), batch_size=128, shuffle=True), ctx)
    start, seen = time.perf_counter(), 0
    loss = torch.zeros(())
    for epoch in range(epochs):
        for batch in loader:
            loss = strategy.step(model, batch, ctx, forward=cross_entropy)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
            seen += len(batch[0])
        mean_loss = strategy.reduce(loss.detach(), "mean", ctx).item()
        if ctx.is_main:
            print(f"epoch {epoch + 1:>2}/{epochs}  loss {mean_loss:.4f}")
    elapsed = time.perf_counter() - start
    test_inputs, test_labels = make_data(1024, seed=2).tensors
    with torch.no_grad():
        logits = strategy.step(model, test_inputs, ctx)
    accuracy = (logits.argmax(dim=1).cpu() == test_labels).float().mean().item()
    return {"loss": mean_loss, "accuracy": accuracy, "samples_per_s": seen / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    options = parser.parse_args()
    strategy = sg.single_device(options.device)
    [result] = sg.launch(train, strategy, args=(options.epochs,))
    print(
        f"{strategy.name}: final loss {result['loss']:.4f}, test accuracy "
        f"{result['accuracy']:.1%}, {result['samples_per_s']:.0f} samples/s"
    )


if __name__ == "__main__":
    main()
