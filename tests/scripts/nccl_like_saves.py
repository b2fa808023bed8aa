"""Under torchrun, in a world with no CPU backend (``cuda:gloo``): background saves, a resume
and the results gathered by `launch` in place, all over the CPU group setup adds.

Usage: torchrun --standalone --nproc-per-node 2 nccl_like_saves.py DIRECTORY
"""

import json
import os
import sys

import torch

import stratagem as sg


def train(strategy, ctx, directory):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    state = {"model": model, "step": 0}
    resumed = sg.checkpoint.resume_or_start(directory, state, strategy, ctx)
    for step in range(resumed["step"] + 1, resumed["step"] + 3):
        with torch.no_grad():
            model.weight.add_(1.0)
        state["step"] = step
        sg.checkpoint.save(os.path.join(directory, f"step_{step}"), state, ctx, blocking=False)
    stop = strategy.reduce(torch.tensor([float(ctx.rank)]), "max", ctx).item()
    return {
        "rank": ctx.rank,
        "step": state["step"],
        "weight": model.weight.sum().item(),
        "max": stop,
    }


if __name__ == "__main__":
    results = sg.launch(
        train, sg.ddp(device="cpu", backend="cuda:gloo"), devices="auto", args=(sys.argv[1],)
    )
    if int(os.environ["RANK"]) == 0:
        print("RESULTS " + json.dumps(results), flush=True)
