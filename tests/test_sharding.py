"""shard(): every sample to exactly one rank per epoch, the user's choices kept, epochs differ."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stratagem as sg
from helpers import rank_ctx
from stratagem.sharding import shard_loader


def samples_per_rank(loader: DataLoader, world_size: int) -> list[list[int]]:
    """One pass of every rank's shard; the dataset holds its own indices."""
    seen = []
    for rank in range(world_size):
        sharded = shard_loader(loader, rank_ctx(rank, world_size))
        seen.append([int(x) for (batch,) in sharded for x in batch])
    return seen


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 60),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 7),
    shuffle=st.booleans(),
)
def test_without_drop_last_every_sample_goes_to_one_rank_and_ranks_take_equal_steps(
    size, world_size, batch_size, shuffle
):
    if size < world_size:
        return  # refused: see test_fewer_samples_than_ranks_is_refused
    loader = DataLoader(TensorDataset(torch.arange(size)), batch_size=batch_size, shuffle=shuffle)
    seen = samples_per_rank(loader, world_size)
    flat = [x for share in seen for x in share]
    assert len(flat) == len(set(flat))  # never twice
    # Every sample, except a last global batch too small to give each rank one.
    last = size % (world_size * batch_size)
    left_out = last if last < world_size else 0
    assert len(flat) == size - left_out
    assert max(map(len, seen)) - min(map(len, seen)) <= 1
    batches = {-(-len(share) // batch_size) for share in seen}
    assert len(batches) == 1  # no rank waits in a collective for a batch the others lack
    lengths = {len(shard_loader(loader, rank_ctx(r, world_size))) for r in range(world_size)}
    assert lengths == batches


def test_fewer_samples_than_ranks_is_refused():
    loader = DataLoader(TensorDataset(torch.arange(2)), batch_size=4)
    with pytest.raises(sg.UsageError, match="2 sample\\(s\\), fewer than the 3 ranks"):
        shard_loader(loader, rank_ctx(0, 3))


def equal_steps(strategy: sg.StrategyLike, ctx: sg.Context) -> int:
    """An epoch of real DDP steps over 5 samples in batches of 2 on 2 ranks."""
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(1, 1), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.arange(5.0).unsqueeze(1), torch.ones(5, 1))
    steps = 0
    for batch in strategy.shard(DataLoader(data, batch_size=2), ctx):
        loss = strategy.step(
            model, batch, ctx, forward=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        )
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        steps += 1
    return steps


def test_an_uneven_last_batch_does_not_leave_a_rank_waiting_under_ddp():
    # Dealt plainly, rank 0 would get samples [0, 2, 4] (2 batches) and rank 1 [1, 3] (1):
    # rank 0's second backward would wait for rank 1's gradients until the timeout.
    strategy = sg.ddp_spawn(device="cpu", timeout=60)
    assert sg.launch(equal_steps, strategy, devices=2) == [1, 1]


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 60),
    world_size=st.integers(1, 5),
    batch_size=st.integers(1, 7),
    shuffle=st.booleans(),
)
def test_with_drop_last_ranks_get_equal_whole_batches_and_no_sample_twice(
    size, world_size, batch_size, shuffle
):
    if size < world_size:
        return  # refused: see test_fewer_samples_than_ranks_is_refused
    loader = DataLoader(
        TensorDataset(torch.arange(size)), batch_size=batch_size, shuffle=shuffle, drop_last=True
    )
    seen = samples_per_rank(loader, world_size)
    flat = [x for share in seen for x in share]
    assert len(flat) == len(set(flat))
    per_rank = size // world_size
    assert all(len(share) == per_rank - per_rank % batch_size for share in seen)
    lengths = {len(shard_loader(loader, rank_ctx(r, world_size))) for r in range(world_size)}
    assert lengths == {per_rank // batch_size}


def test_epochs_differ_when_shuffling_and_agree_across_ranks():
    loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, shuffle=True)
    shards = [shard_loader(loader, rank_ctx(r, 2)) for r in range(2)]
    epochs = [[[int(x) for (b,) in shard for x in b] for _ in range(2)] for shard in shards]
    assert epochs[0][0] != epochs[0][1]  # rank 0 sees a new order in epoch 2
    for epoch in range(2):  # and the ranks still partition the data in each epoch
        assert sorted(epochs[0][epoch] + epochs[1][epoch]) == list(range(40))


def test_without_shuffle_order_is_kept_and_the_seed_carries_over():
    plain = DataLoader(TensorDataset(torch.arange(10)), batch_size=5)
    assert samples_per_rank(plain, 2) == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]

    def order(seed: int) -> list[int]:
        loader = DataLoader(
            TensorDataset(torch.arange(30)),
            batch_size=3,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        return samples_per_rank(loader, 2)[0]

    assert order(5) == order(5)
    assert order(5) != order(6)


def test_batch_size_collate_and_workers_are_kept():
    def collate(items):
        return torch.stack([x for (x,) in items]) * 10

    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2, collate_fn=collate)
    sharded = shard_loader(loader, rank_ctx(1, 2))
    assert [b.tolist() for b in sharded] == [[10, 30], [50, 70]]


def test_a_distributed_sampler_is_left_alone():
    dataset = TensorDataset(torch.arange(8))
    sampler = DistributedSampler(dataset, num_replicas=2, rank=0, shuffle=True)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    sharded = shard_loader(loader, rank_ctx(0, 2))
    assert sharded.loader is loader
    list(sharded)
    list(sharded)
    assert sampler.epoch == 1  # advanced by the wrapper at each pass


@pytest.mark.parametrize(
    ("loader", "message"),
    [
        ([1, 2, 3], "must be a torch DataLoader"),
        (
            DataLoader(TensorDataset(torch.arange(4)), batch_sampler=[[0, 1], [2, 3]]),
            "batch_sampler",
        ),
    ],
)
def test_what_cannot_be_sharded_says_how_to_do_it_by_hand(loader, message):
    with pytest.raises(sg.UsageError, match=message):
        shard_loader(loader, rank_ctx(0, 2))


def test_numpy_integers_are_accepted_where_ints_are():
    numpy = pytest.importorskip("numpy")
    sampler = sg.ShardSampler(size=numpy.int64(10), rank=numpy.int64(1), world_size=2)
    sampler.set_epoch(numpy.int64(3))
    assert (sampler.size, sampler.rank, sampler.epoch) == (10, 1, 3)
    assert type(sampler.epoch) is int


def test_the_largest_generator_seed_shuffles_epoch_after_epoch():
    generator = torch.Generator().manual_seed(2**64 - 1)
    loader = DataLoader(TensorDataset(torch.arange(6)), shuffle=True, generator=generator)
    sharded = shard_loader(loader, rank_ctx(0, 2))
    epochs = [[int(x) for (batch,) in sharded for x in batch] for _ in range(3)]
    assert all(len(epoch) == 3 for epoch in epochs)
