"""hsdp on 4 real gloo ranks (2 replicas x 2 shards): it trains as one process, and accumulation
skips both of its collectives until the window's last micro-batch.

The collectives are counted as they happen: the rank wraps the two functions
FSDP2 calls for them (``reduce_scatter_single`` within a shard group and
``all_reduce`` across them) with counters that call the real ones.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from helpers import make_model

MICRO = 2
STEPS = 2
ROWS = 4  # per rank and micro-batch


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    rows = 4 * ROWS  # 4 ranks' worth
    return [
        (torch.randn(rows, 6, generator=generator), torch.randn(rows, 2, generator=generator))
        for _ in range(STEPS * MICRO)
    ]


def mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def counting(counts: collections.Counter, name: str):
    real = getattr(dist, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return real(*args, **kwargs)

    return real, counted


def train_counting(strategy, ctx) -> dict[str, object]:
    model = strategy.wrap(make_model(seed=ctx.rank), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counts: collections.Counter = collections.Counter()
    patched = {n: counting(counts, n) for n in ("reduce_scatter_single", "all_reduce")}
    per_micro_batch = []
    rank, size = ctx.data_parallel
    for batch in batches():
        mine = tuple(t.chunk(size)[rank] for t in batch)
        loss = strategy.step(model, mine, ctx, forward=mse)
        for name, (_, counted) in patched.items():
            setattr(dist, name, counted)
        try:
            strategy.backward(loss, model, ctx)
        finally:
            for name, (real, _) in patched.items():
                setattr(dist, name, real)
        per_micro_batch.append(dict(counts))
        counts.clear()
        strategy.update(optimizer, model, ctx)
    state = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"collectives": per_micro_batch, "state": state, "mesh": tuple(ctx.mesh.shape)}


def reference() -> dict[str, torch.Tensor]:
    strategy = sg.accumulate(sg.single_device("cpu"), MICRO)
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(make_model(seed=0), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in batches():
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_hsdp_accumulates_without_any_collective_until_the_last_micro_batch():
    strategy = sg.accumulate(sg.spawned(sg.hsdp(replicate=2, shard=2, device="cpu")), MICRO)
    results = sg.launch(train_counting, strategy, devices=4)
    expected = reference()
    for rank, result in enumerate(results):
        assert result["mesh"] == (2, 2)
        for index, counts in enumerate(result["collectives"]):
            if index % MICRO < MICRO - 1:
                assert counts == {}, f"rank {rank}, micro-batch {index}: {counts}"
            else:  # the window's last: reduce-scatter in the shard group, all-reduce across
                assert counts.get("reduce_scatter_single", 0) >= 1, (rank, index, counts)
                assert counts.get("all_reduce", 0) >= 1, (rank, index, counts)
        for name, value in expected.items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-6)


def test_hsdp_checks_its_sizes_against_the_world_before_joining():
    strategy = sg.hsdp(replicate=3, shard=2, device="cpu")
    with pytest.raises(sg.UsageError, match=r"replicate=3 x shard=2 is 6 ranks, but the world"):
        strategy.setup(sg.Env(rank=0, world_size=4, local_world_size=4))
    with pytest.raises(sg.UsageError, match=r"hsdp: 'replicate' must be a positive int"):
        sg.hsdp(replicate=0, shard=2, device="cpu")
    with pytest.raises(sg.UsageError, match=r"hsdp: 'shard' must be a positive int"):
        sg.hsdp(replicate=2, shard="2", device="cpu")
