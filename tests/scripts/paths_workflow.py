"""A representative stratagem workflow confined to one directory, for tests/test_paths.py.

Usage: ``python paths_workflow.py DIRECTORY [--spawn]``. Trains a few steps on
one device, traces them to a file in DIRECTORY, saves, loads, describes and
lists checkpoints there; with ``--spawn``, also a 2-rank ``ddp_spawn`` launch
whose ranks train and save into DIRECTORY. Prints ``done`` at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.checkpoint import describe, latest


def squares(model: torch.nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def train(strategy: sg.Strategy, ctx: sg.Context, directory: str) -> float:
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = strategy.shard(DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2), ctx)
    for batch in loader:
        loss = strategy.step(model, batch, ctx, forward=squares)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    state = {"model": model, "optimizer": optimizer, "step": 4}
    if isinstance(loader, sg.ShardedLoader):
        state["loader"] = loader  # its position: a checkpointable object
    strategy.save(Path(directory, "checkpoints", "a"), state, ctx)
    strategy.save(Path(directory, "checkpoints", "a"), state, ctx)  # replaces: renames, removals
    strategy.save(Path(directory, "checkpoints", "b"), state, ctx, keep_last=1)
    values = strategy.load(Path(directory, "checkpoints", "b"), state, ctx)
    assert values == {"step": 4}
    return float(strategy.reduce(loss.detach(), "mean", ctx))


def main(directory: str, spawn: bool) -> None:
    sink = sg.JsonLinesSink(Path(directory, "trace.jsonl"))
    [loss] = sg.launch(train, sg.traced(sg.single_device("cpu"), sink), args=(directory,))
    assert loss >= 0 and sink.events()
    assert latest(Path(directory, "checkpoints")) == Path(directory, "checkpoints", "b")
    assert describe(Path(directory, "checkpoints", "b")).values["step"] == 4
    if spawn:
        results = sg.launch(
            train, sg.ddp_spawn(device="cpu"), devices=2, args=(str(Path(directory, "ddp")),)
        )
        assert results[0] == results[1]
        assert describe(Path(directory, "ddp", "checkpoints", "b")).world_size == 2
    print("done")


if __name__ == "__main__":
    main(sys.argv[1], "--spawn" in sys.argv[2:])
