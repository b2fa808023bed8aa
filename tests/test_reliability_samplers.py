"""shard() deals out what the user's own sampler yields, never the whole dataset in its place (#23)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.utils.data import (
    DataLoader,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import stratagem as sg
from helpers import rank_ctx
from stratagem.sharding import shard_loader

HELD_OUT = range(10, 20)
KEPT = [i for i in range(40) if i not in HELD_OUT]


def dataset(size: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(size))  # each sample is its own index


def passes(loader: DataLoader, world_size: int, epochs: int = 1) -> list[list[list[int]]]:
    """``[epoch][rank]``: the samples each rank's shard yields, every rank in its own global RNG.

    Each rank's global generator is seeded differently first, as in separate processes, so
    a sampler that drew from it would deal the ranks different permutations.
    """
    seen: list[list[list[int]]] = [[] for _ in range(epochs)]
    for rank in range(world_size):
        torch.manual_seed(1000 + rank)
        sharded = shard_loader(loader, rank_ctx(rank, world_size))
        for epoch in range(epochs):
            seen[epoch].append([int(x) for (batch,) in sharded for x in batch])
    return seen


def dealt(shares: list[list[int]]) -> list[int]:
    """The global order the ranks' shares were dealt from (rank r took positions r, r + N, ...)."""
    order = []
    for position in range(max(map(len, shares))):
        order += [share[position] for share in shares if position < len(share)]
    return order


def test_a_subset_random_sampler_never_trains_on_the_held_out_samples():
    loader = DataLoader(dataset(), batch_size=3, sampler=SubsetRandomSampler(KEPT))
    epochs = passes(loader, world_size=2, epochs=3)
    for shares in epochs:
        assert sorted(shares[0] + shares[1]) == KEPT  # every kept sample once, no held-out one
        assert len(shares[0]) == len(shares[1])
    assert epochs[0][0] != epochs[1][0]  # and the sampler reshuffles every epoch


def test_the_ranks_deal_exactly_what_the_users_sampler_draws():
    def sampler() -> SubsetRandomSampler:
        return SubsetRandomSampler(KEPT, generator=torch.Generator().manual_seed(5))

    loader = DataLoader(dataset(), batch_size=3, sampler=sampler())
    [first, second] = passes(loader, world_size=2, epochs=2)
    # Epoch e is the sampler's own draw from its seed + e: epoch 0 what one process would see.
    assert dealt(first) == list(sampler())
    assert dealt(second) == list(
        SubsetRandomSampler(KEPT, generator=torch.Generator().manual_seed(6))
    )


def test_a_weighted_random_sampler_keeps_its_weights():
    weights = torch.tensor([0.0 if i in HELD_OUT else 1.0 + (i % 3) for i in range(40)])
    generator = torch.Generator().manual_seed(3)
    sampler = WeightedRandomSampler(weights, num_samples=400, generator=generator)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    [shares] = passes(loader, world_size=2)
    drawn = shares[0] + shares[1]
    expected = WeightedRandomSampler(
        weights, num_samples=400, generator=torch.Generator().manual_seed(3)
    )
    assert Counter(drawn) == Counter(expected)  # the same 400 draws, with replacement
    assert not set(drawn) & set(HELD_OUT)  # weight 0: never drawn
    counts = Counter(i % 3 for i in drawn)
    assert counts[2] > counts[1] > counts[0]  # weights 3 > 2 > 1 still show


def test_a_random_sampler_with_replacement_keeps_its_number_of_samples():
    sampler = RandomSampler(dataset(), replacement=True, num_samples=12)
    loader = DataLoader(dataset(), batch_size=2, sampler=sampler)
    [shares] = passes(loader, world_size=2)
    assert len(shares[0]) == len(shares[1]) == 6


def test_a_plain_list_of_indices_as_sampler_is_dealt_in_its_order():
    loader = DataLoader(dataset(), batch_size=2, sampler=[7, 3, 31, 5, 0, 8, 2, 9])
    [shares] = passes(loader, world_size=2)
    assert shares == [[7, 31, 0, 2], [3, 5, 8, 9]]


class EpochShuffled(Sampler[int]):
    """A user's sampler that reshuffles from its epoch with Python's own generator."""

    def __init__(self, indices: list[int]) -> None:
        self.indices, self.epoch = indices, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(self.indices)
        random.Random(self.epoch).shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return len(self.indices)


def test_a_custom_sampler_is_told_the_epoch_and_dealt_as_it_shuffles():
    user = EpochShuffled(KEPT)
    loader = DataLoader(dataset(), batch_size=3, sampler=user)
    epochs = passes(loader, world_size=2, epochs=2)
    assert user.epoch == 0  # shard told a copy, not the user's own sampler
    for epoch, shares in enumerate(epochs):
        expected = EpochShuffled(KEPT)
        expected.set_epoch(epoch)
        assert dealt(shares) == list(expected)
    assert epochs[0] != epochs[1]


class Unseeded(Sampler[int]):
    """A sampler drawing from a generator shard cannot seed alike on every rank."""

    def __iter__(self):
        order = list(KEPT)
        random.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return len(KEPT)


def test_a_sampler_whose_draws_ranks_cannot_agree_on_is_refused():
    loader = DataLoader(dataset(), batch_size=3, sampler=Unseeded())
    with pytest.raises(sg.UsageError, match="Unseeded.*differ.*generator"):
        shard_loader(loader, rank_ctx(0, 2))


class Growing(Sampler[int]):
    """A sampler that yields one more index every epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(10 + self.epoch))


def test_a_sampler_whose_length_changes_between_epochs_is_refused():
    sharded = shard_loader(DataLoader(dataset(), batch_size=2, sampler=Growing()), rank_ctx(0, 2))
    assert len(list(sharded)) == 3  # epoch 0: 10 indices, 5 per rank
    with pytest.raises(sg.UsageError, match="Growing.*yielded 11 indices in epoch 1 but 10"):
        list(sharded)


def test_a_resumed_pass_continues_the_samplers_draw():
    loader = DataLoader(dataset(), batch_size=2, sampler=SubsetRandomSampler(KEPT))
    [whole] = passes(loader, world_size=2)
    resumed = []
    for rank in range(2):
        torch.manual_seed(rank)
        first = shard_loader(loader, rank_ctx(rank, 2))
        taken = []
        for step, (batch,) in enumerate(first):
            taken += batch.tolist()
            if step == 2:
                break
        state = first.state_dict()
        torch.manual_seed(50 + rank)
        second = shard_loader(loader, rank_ctx(rank, 2))
        second.load_state_dict(state)
        resumed.append(taken + [int(x) for (batch,) in second for x in batch])
    assert resumed == whole


def share_of_a_real_world(strategy: sg.StrategyLike, ctx: sg.Context) -> list[int]:
    torch.manual_seed(ctx.rank)  # the ranks' global generators differ, as they may in real runs
    loader = DataLoader(dataset(), batch_size=3, sampler=SubsetRandomSampler(KEPT))
    return [int(x) for (batch,) in strategy.shard(loader, ctx) for x in batch]


def test_on_two_real_ranks_the_held_out_samples_stay_out():
    shares = sg.launch(share_of_a_real_world, sg.ddp_spawn(timeout=60, device="cpu"), devices=2)
    assert sorted(shares[0] + shares[1]) == KEPT
