"""Collectives on 2 real gloo ranks: arithmetic for every op and dtype, gather, broadcast, errors."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg

pytestmark = pytest.mark.slow

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


def contribution(rank: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank r puts in: values that differ by rank and are exact in every dtype."""
    return torch.tensor([1 + rank, 10 - 3 * rank, 4 * rank], dtype=dtype).reshape(3, 1)


def collective_results(strategy, ctx):
    out: dict[str, object] = {}
    for dtype in FLOATS + INTS:
        mine = contribution(ctx.rank, dtype)
        before = mine.clone()
        ops = ["sum", "max", "min"] + (["mean"] if dtype.is_floating_point else [])
        for op in ops:
            out[f"reduce/{op}/{dtype}"] = strategy.reduce(mine, op, ctx)
        assert torch.equal(mine, before), "reduce changed its input"
        out[f"gather/{dtype}"] = strategy.gather(mine, ctx)
        if dtype.is_floating_point:  # mean is idempotent on values already reduced
            once = strategy.reduce(mine, "mean", ctx)
            out[f"idempotent/{dtype}"] = torch.equal(strategy.reduce(once, "mean", ctx), once)
    try:
        strategy.reduce(contribution(ctx.rank, torch.int64), "mean", ctx)
    except sg.UsageError as error:
        out["int-mean"] = str(error)
    for src in range(ctx.world_size):
        out[f"broadcast-tensor/{src}"] = strategy.broadcast(
            torch.full((2,), float(ctx.rank)), ctx, src=src
        )
        out[f"broadcast-object/{src}"] = strategy.broadcast(
            {"from": ctx.rank, "items": [ctx.rank] * 3}, ctx, src=src
        )
    out["scalar-gather"] = strategy.gather(torch.tensor(float(ctx.rank)), ctx)
    try:  # shapes differ across ranks: an error on every rank, not a hang
        strategy.gather(torch.zeros(ctx.rank + 1, 2), ctx)
    except sg.UsageError as error:
        out["gather-mismatch"] = str(error)
    try:
        strategy.gather(torch.zeros(2, dtype=torch.float32 if ctx.rank == 0 else torch.int64), ctx)
    except sg.UsageError as error:
        out["gather-dtype"] = str(error)
    strategy.barrier(ctx)
    return out


@pytest.fixture(scope="module")
def results():
    return sg.launch(collective_results, sg.ddp_spawn(device="cpu"), devices=2)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_reduce_arithmetic(results, dtype):
    a, b = contribution(0, torch.float64), contribution(1, torch.float64)
    expected = {
        "sum": a + b,
        "max": torch.maximum(a, b),
        "min": torch.minimum(a, b),
        "mean": (a + b) / 2,
    }
    for rank, out in enumerate(results):
        for op, value in expected.items():
            key = f"reduce/{op}/{dtype}"
            if op == "mean" and not dtype.is_floating_point:
                assert key not in out
                continue
            got = out[key]
            assert got.dtype == dtype, (rank, key)
            assert torch.equal(got.double(), value), (rank, key, got)


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
def test_gather_is_in_rank_order_with_a_new_first_dimension(results, dtype):
    for out in results:
        gathered = out[f"gather/{dtype}"]
        assert gathered.shape == (2, 3, 1)
        assert torch.equal(gathered[0], contribution(0, dtype))
        assert torch.equal(gathered[1], contribution(1, dtype))


def test_mean_is_idempotent(results):
    assert all(out[f"idempotent/{d}"] for out in results for d in FLOATS)


def test_broadcast_from_every_source(results):
    for out in results:
        for src in (0, 1):
            assert torch.equal(out[f"broadcast-tensor/{src}"], torch.full((2,), float(src)))
            assert out[f"broadcast-object/{src}"] == {"from": src, "items": [src] * 3}


def test_scalars_gather_to_a_vector(results):
    for out in results:
        assert torch.equal(out["scalar-gather"], torch.tensor([0.0, 1.0]))


def test_mismatched_gathers_fail_on_every_rank_naming_ranks_and_shapes(results):
    for out in results:
        assert (
            "rank 0: (1, 2) torch.float32; rank 1: (2, 2) torch.float32" in out["gather-mismatch"]
        )
        assert "rank 0: (2,) torch.float32; rank 1: (2,) torch.int64" in out["gather-dtype"]


def test_integer_mean_is_a_clear_error_on_every_rank(results):
    for out in results:
        assert "cast to a floating dtype first" in out["int-mean"]
