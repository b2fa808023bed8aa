"""Train a small model with ``stratagem.ddp()`` on the ranks that torchrun started.

Run it under torchrun, on one node or many; every process writes the list that
``launch`` returned (one entry per rank, rank 0 first) to ``OUT_DIR/rank{RANK}.json``::

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \
        --rdzv-endpoint HOST:PORT --rdzv-id JOB multinode_train.py OUT_DIR

Each entry holds the rank's place in the world, the samples it trained on and a
checksum of its final parameters (equal on every rank when DDP kept them in sync).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

SAMPLES = 48
BATCH_SIZE = 4
EPOCHS = 2


def make_dataset() -> TensorDataset:
    """The same samples on every rank: (index, inputs, label)."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, 8, generator=generator)
    labels = torch.randint(0, 3, (SAMPLES,), generator=generator)
    return TensorDataset(torch.arange(SAMPLES), inputs, labels)


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    _, inputs, labels = batch
    return torch.nn.functional.cross_entropy(model(inputs), labels)


def checksum(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes, in order."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train(strategy: sg.StrategyLike, ctx: sg.Context) -> dict[str, Any]:
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = strategy.shard(
        DataLoader(make_dataset(), batch_size=BATCH_SIZE, shuffle=True, drop_last=True), ctx
    )
    seen: list[int] = []
    steps = 0
    for _ in range(EPOCHS):
        for batch in loader:
            seen += batch[0].tolist()
            loss = strategy.step(model, batch, ctx, forward=loss_fn)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
            steps += 1
    mean_loss = strategy.reduce(loss.detach(), "mean", ctx).item()
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "node_rank": ctx.env.node_rank,
        "source": ctx.env.source,
        "steps": steps,
        "seen": seen,
        "loss": mean_loss,
        "checksum": checksum(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="where to write rank{RANK}.json")
    out_dir = parser.parse_args().out_dir
    results = sg.launch(train, sg.ddp(device="cpu"), devices="auto")
    rank = sg.detect_env(os.environ).rank
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"rank{rank}.json"
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(results))
    partial.replace(path)


if __name__ == "__main__":
    main()
