"""A sharded loader's position: resumed mid-epoch, it yields what the uninterrupted loader would."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stratagem as sg
from helpers import rank_ctx
from stratagem.sharding import shard_loader


def user_loader(size: int, batch_size: int, shuffle: bool, drop_last: bool) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.arange(size)),
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(5),
    )


def flat(batches) -> list[int]:
    return [int(x) for (batch,) in batches for x in batch]


def stream(loader):
    while True:
        yield from loader


@settings(max_examples=80, deadline=None)
@given(
    size=st.integers(1, 40),
    world_size=st.integers(1, 4),
    batch_size=st.integers(1, 6),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    taken=st.integers(0, 25),
)
def test_a_resumed_loader_continues_exactly_where_it_stopped(
    size, world_size, batch_size, shuffle, drop_last, taken
):
    size = max(size, world_size)  # fewer samples than ranks is refused (test_sharding)
    for rank in range(world_size):
        ctx = rank_ctx(rank, world_size)
        original = shard_loader(user_loader(size, batch_size, shuffle, drop_last), ctx)
        batches = stream(original)
        if len(original) == 0:
            return
        head = [next(batches) for _ in range(taken)]
        resumed = shard_loader(user_loader(size, batch_size, shuffle, drop_last), ctx)
        resumed.load_state_dict(original.state_dict())
        rest = stream(resumed)
        following = 2 * len(original) + 1  # the rest of this epoch and two more
        assert flat(itertools.islice(rest, following)) == flat(
            next(batches) for _ in range(following)
        ), f"rank {rank} after {len(head)} batches"


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 40),
    saved_world=st.integers(1, 4),
    loaded_world=st.integers(1, 4),
    batch_size=st.integers(1, 6),
    shuffle=st.booleans(),
    taken=st.integers(0, 8),
)
def test_a_position_loads_into_another_world_size_without_losing_or_repeating_samples(
    size, saved_world, loaded_world, batch_size, shuffle, taken
):
    size = max(size, saved_world, loaded_world)  # fewer samples than ranks is refused
    before = [
        shard_loader(user_loader(size, batch_size, shuffle, False), rank_ctx(r, saved_world))
        for r in range(saved_world)
    ]
    iterators = [iter(loader) for loader in before]
    taken = (
        min(taken, min(len(loader) for loader in before) - 1) if min(map(len, before)) > 0 else 0
    )
    seen = flat(batch for iterator in iterators for batch in itertools.islice(iterator, taken))
    state = before[0].state_dict()
    assert all(loader.state_dict() == state for loader in before)  # written once for all ranks
    after = [
        shard_loader(user_loader(size, batch_size, shuffle, False), rank_ctx(r, loaded_world))
        for r in range(loaded_world)
    ]
    rest = []
    for loader in after:
        loader.load_state_dict(state)
        rest += flat(loader)  # the rest of the epoch
    # Nothing repeats; the resumed world leaves out only a last global batch too small
    # to give each of its ranks one sample (see ShardSampler).
    assert len(seen + rest) == len(set(seen + rest))
    remaining = size - state["consumed"]
    last = remaining % (loaded_world * batch_size)
    assert len(seen + rest) == size - (last if last < loaded_world else 0)
    if not shuffle:
        assert sorted(seen + rest) == list(range(len(seen + rest)))
    assert len({len(loader) for loader in after}) == 1  # ranks take equal steps


def test_a_finished_pass_is_the_start_of_the_next_epoch():
    loader = shard_loader(user_loader(10, 3, True, False), rank_ctx(0, 2))
    assert loader.state_dict() == {"epoch": 0, "consumed": 0}
    list(loader)
    assert loader.state_dict() == {"epoch": 1, "consumed": 0}
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict() == {"epoch": 1, "consumed": 6}  # 2 ranks took 3 samples each


def test_a_users_distributed_sampler_resumes_by_skipping_batches():
    dataset = TensorDataset(torch.arange(24))

    def loader():
        sampler = DistributedSampler(dataset, num_replicas=2, rank=1, shuffle=True, seed=3)
        return shard_loader(DataLoader(dataset, batch_size=2, sampler=sampler), rank_ctx(1, 2))

    original, resumed = loader(), loader()
    batches = stream(original)
    for _ in range(8):  # one epoch (6 batches) and two more
        next(batches)
    resumed.load_state_dict(original.state_dict())
    assert flat(itertools.islice(stream(resumed), 10)) == flat(next(batches) for _ in range(10))


def test_iterating_never_draws_from_the_global_generator():
    loader = shard_loader(user_loader(12, 2, True, False), rank_ctx(0, 1))
    torch.manual_seed(0)
    list(loader)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(0).get_state())


def test_a_malformed_position_is_refused():
    loader = shard_loader(user_loader(12, 2, True, False), rank_ctx(0, 1))
    with pytest.raises(sg.UsageError, match="non-negative ints 'epoch' and 'consumed'"):
        loader.load_state_dict({"epoch": -1, "consumed": 0})
