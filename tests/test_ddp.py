"""ddp(): K steps on 2 ranks equal K steps of single_device() on the whole batches."""

from __future__ import annotations

import contextlib

import pytest
import torch

import stratagem as sg
from helpers import make_batches, make_model

pytestmark = pytest.mark.slow

STEPS = 5
BATCH = 8
MICRO = 2  # micro-batches per optimizer step in the accumulation run
TOLERANCE = {"rtol": 0, "atol": 1e-6}


def mean_loss(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def global_mean_loss(global_size: int, world_size: int):
    """Sum over this rank's samples, scaled so that DDP's gradient average is the global mean."""

    def forward(model, batch):
        inputs, targets = batch
        squared = (model(inputs) - targets).pow(2).mean(dim=1)
        return squared.sum() * world_size / global_size

    return forward


def split(batch, sizes):
    return [tuple(part) for part in zip(*(t.split(sizes) for t in batch), strict=True)]


def train(strategy, ctx, piece_of, forward, micro=1):
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for batch in make_batches(steps=STEPS, size=BATCH):
        mine = piece_of(batch, ctx)
        pieces = split(mine, [len(mine[0]) // micro] * micro)
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1  # only the last micro-batch synchronises
            with contextlib.nullcontext() if last else strategy.no_sync(model, ctx):
                loss = strategy.step(model, piece, ctx, forward=forward)
                strategy.backward(loss / micro, model, ctx)
        strategy.update(optimizer, model, ctx)
    return [p.detach().clone() for p in sg.unwrap(model).parameters()]


def half(batch, ctx):
    return split(batch, [BATCH // ctx.world_size] * ctx.world_size)[ctx.rank]


def uneven(batch, ctx):
    return split(batch, [5, 3])[ctx.rank]


def whole(batch, ctx):
    return batch


def equivalence_runs(strategy, ctx):
    return {
        "even": train(strategy, ctx, half, mean_loss),
        "uneven": train(strategy, ctx, uneven, global_mean_loss(BATCH, ctx.world_size)),
        "accumulated": train(strategy, ctx, half, mean_loss, micro=MICRO),
    }


def single_runs():
    strategy = sg.single_device("cpu")
    [result] = sg.launch(
        lambda s, ctx: {
            "even": train(s, ctx, whole, mean_loss),
            "uneven": train(s, ctx, whole, mean_loss),
            "accumulated": train(s, ctx, whole, mean_loss),
        },
        strategy,
    )
    return result


def test_two_ranks_equal_one_rank_on_the_whole_batch():
    ranks = sg.launch(equivalence_runs, sg.ddp_spawn(device="cpu"), devices=2)
    reference = single_runs()
    initial = list(make_model().parameters())
    for case in ("even", "uneven", "accumulated"):
        for rank, result in enumerate(ranks):
            for ours, theirs, start in zip(result[case], reference[case], initial, strict=True):
                torch.testing.assert_close(
                    ours, theirs, **TOLERANCE, msg=lambda m, c=case, r=rank: f"{c}, rank {r}: {m}"
                )
                assert not torch.allclose(ours, start.detach())  # training moved the parameters
