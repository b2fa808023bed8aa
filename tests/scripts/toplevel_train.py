"""A research script's shape: configuration and loop at the top level, run by torchrun.

Each rank writes rank<N>.json (its rank, world size, losses and weights) into the directory
named by argv[1].
"""

import json
import sys
from pathlib import Path

import torch

import stratagem as sg

STEPS, BATCH = 3, 4
print("configuration: steps", STEPS, flush=True)  # top level: once per process torchrun starts

strategy = sg.ddp(device="cpu")
with sg.joined(strategy) as ctx:
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(3, 1), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(ctx.rank)
    losses = []
    for _ in range(STEPS):
        batch = torch.randn(BATCH, 3, generator=generator)
        loss = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).square().mean())
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        losses.append(strategy.reduce(loss.detach(), "mean", ctx).item())
    weight = sg.unwrap(model).weight.detach().flatten().tolist()
    row = {"rank": ctx.rank, "world": ctx.world_size, "losses": losses, "w": weight}
    Path(sys.argv[1], f"rank{ctx.rank}.json").write_text(json.dumps(row))
print("left the world", torch.distributed.is_initialized(), flush=True)
