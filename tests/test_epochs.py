"""The script keeps the epoch: ``shard()`` honours ``set_epoch`` and a peek is not an epoch.

The DDP tutorial (and most scripts derived from it) peeks at one batch, then
sets the epoch itself and iterates::

    b_sz = len(next(iter(train_data))[0])
    train_data.sampler.set_epoch(epoch)
    for source, targets in train_data: ...

Ported to ``strategy.shard`` it must see, on every rank, exactly the batches
that ``DistributedSampler(shuffle=True, seed=0)`` gives the original, from the
first epoch or resumed at any epoch. The loaders here are real; the
distributed test runs two real gloo ranks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import stratagem as sg
from helpers import rank_ctx
from stratagem.sharding import shard_loader

SIZE, BATCH, EPOCHS = 50, 4, 5


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(SIZE), torch.arange(SIZE) * 10)


def indices(batches) -> list[list[int]]:
    return [[int(i) for i in batch[0]] for batch in batches]


def tutorial_epochs(loader, set_epoch, epochs) -> list[list[list[int]]]:
    """The tutorial's loop: peek at one batch, set the epoch, iterate; the batches seen."""
    seen = []
    for epoch in epochs:
        b_sz = len(next(iter(loader))[0])
        assert b_sz == BATCH
        set_epoch(epoch)
        seen.append(indices(loader))
    return seen


def original(rank: int, world_size: int, epochs) -> list[list[list[int]]]:
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, shuffle=False, sampler=sampler)
    return tutorial_epochs(loader, loader.sampler.set_epoch, epochs)


def ports(strategy, ctx, epochs) -> dict[str, list[list[list[int]]]]:
    """Each way a port can keep the tutorial's loop, over ``strategy.shard``."""
    seen = {}
    loader = strategy.shard(DataLoader(dataset(), batch_size=BATCH, shuffle=True), ctx)
    seen["shuffle=True, .sampler.set_epoch"] = tutorial_epochs(
        loader, loader.sampler.set_epoch, epochs
    )
    loader = strategy.shard(DataLoader(dataset(), batch_size=BATCH, shuffle=True), ctx)
    seen["shuffle=True, loader.set_epoch"] = tutorial_epochs(loader, loader.set_epoch, epochs)
    data = dataset()
    own = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=0)
    loader = strategy.shard(DataLoader(data, batch_size=BATCH, sampler=own), ctx)
    seen["own DistributedSampler, .sampler.set_epoch"] = tutorial_epochs(
        loader, loader.sampler.set_epoch, epochs
    )
    return seen


def compare_on_ranks(strategy, ctx) -> dict[str, object]:
    everything = range(EPOCHS)
    resumed = range(3, EPOCHS)  # a run restarted at epoch 3 with a fresh loader
    return {
        "rank": ctx.rank,
        "original": original(ctx.rank, ctx.world_size, everything),
        "original resumed": original(ctx.rank, ctx.world_size, resumed),
        "ports": ports(strategy, ctx, everything),
        "ports resumed": ports(strategy, ctx, resumed),
    }


@pytest.mark.slow
def test_the_ported_ddp_tutorial_sees_the_batches_of_distributed_sampler_on_every_rank():
    results = sg.launch(compare_on_ranks, sg.ddp_spawn(device="cpu"), devices=2)
    assert [r["rank"] for r in results] == [0, 1]
    for result in results:
        assert len(result["original"]) == EPOCHS
        assert result["original"][0] != result["original"][1]  # shuffled epochs differ
        for name, seen in result["ports"].items():
            assert seen == result["original"], f"rank {result['rank']}: {name}"
        for name, seen in result["ports resumed"].items():
            assert seen == result["original resumed"], f"rank {result['rank']}, resumed: {name}"
    # together the ranks see every sample once per epoch, as the original does
    for epoch in range(EPOCHS):
        both = [i for r in results for batch in r["original"][epoch] for i in batch]
        assert sorted(both) == list(range(SIZE))


# --- the rule, on one rank of a world of two (no process group needed) ---------------------


def sharded(shuffle: bool = True):
    return shard_loader(DataLoader(dataset(), batch_size=BATCH, shuffle=shuffle), rank_ctx(0, 2))


def reference_epoch(epoch: int) -> list[list[int]]:
    loader = sharded()
    loader.set_epoch(epoch)
    return indices(loader)


def test_a_peek_is_not_an_epoch():
    loader, fresh = sharded(), sharded()
    first = next(iter(loader))
    assert loader.state_dict() == {"epoch": 0, "consumed": 0}
    whole = indices(loader)
    assert whole == indices(fresh)  # epoch 0, from its first batch
    assert indices([first]) == whole[:1]
    assert loader.state_dict() == {"epoch": 1, "consumed": 0}


def test_without_set_epoch_every_whole_pass_is_the_next_epoch():
    loader = sharded()
    passes = []
    for _ in range(3):
        next(iter(loader))  # a peek between passes changes nothing
        passes.append(indices(loader))
    assert passes == [reference_epoch(e) for e in range(3)]
    assert passes[0] != passes[1] != passes[2]


def test_a_pass_left_after_two_batches_is_an_epoch():
    loader = sharded()
    for _ in itertools.islice(loader, 2):
        pass
    assert indices(loader) == reference_epoch(1)


@pytest.mark.parametrize("where", ["loader", "sampler", "attribute"])
def test_set_epoch_is_honoured_however_often_it_is_called(where):
    loader = sharded()
    set_epoch = {
        "loader": loader.set_epoch,
        "sampler": loader.sampler.set_epoch,
        "attribute": lambda epoch: setattr(loader, "epoch", epoch),
    }[where]
    for epoch in (0, 0, 4, 4, 2):  # repeats too, as torch's DistributedSampler allows
        set_epoch(epoch)
        assert indices(loader) == reference_epoch(epoch), epoch
    assert indices(loader) == reference_epoch(3)  # and then it goes on from there


def test_a_users_distributed_sampler_keeps_the_users_epoch():
    data = dataset()
    own = DistributedSampler(data, num_replicas=2, rank=1, seed=0)
    loader = shard_loader(DataLoader(data, batch_size=BATCH, sampler=own), rank_ctx(1, 2))

    def expected(epoch):
        reference = DistributedSampler(data, num_replicas=2, rank=1, seed=0)
        reference.set_epoch(epoch)
        return indices(DataLoader(data, batch_size=BATCH, sampler=reference))

    own.set_epoch(3)  # before the peek
    next(iter(loader))
    assert indices(loader) == expected(3)
    own.set_epoch(7)  # on the user's own reference, after a pass
    assert indices(loader) == expected(7)
    assert indices(loader) == expected(8)


class Stream(IterableDataset):
    """0..11, reshuffled by the epoch its ``set_epoch`` was told."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(12, generator=torch.Generator().manual_seed(self.epoch))
        return iter(order.tolist())


def test_a_streams_own_set_epoch_is_honoured():
    stream = Stream()
    loader = shard_loader(DataLoader(stream, batch_size=2), rank_ctx(0, 2))

    def expected(epoch):
        reference = Stream()
        reference.set_epoch(epoch)
        batches = [b.tolist() for b in DataLoader(reference, batch_size=2)]
        return batches[0::2]

    assert [b.tolist() for b in loader] == expected(0)
    stream.set_epoch(5)  # the user tells the dataset, as without shard()
    assert [b.tolist() for b in loader] == expected(5)
    loader.sampler.set_epoch(5)  # the epoch the stride holds: the same epoch again
    assert [b.tolist() for b in loader] == expected(5)


def test_a_mid_epoch_position_and_the_scripts_epoch_must_agree():
    loader = sharded()
    iterator = iter(loader)
    next(iterator), next(iterator), next(iterator)
    saved = loader.state_dict()
    assert saved == {"epoch": 0, "consumed": 3 * 2 * BATCH}
    rest = indices(iterator)

    resumed = sharded()
    resumed.load_state_dict(saved)
    next(iter(resumed))  # the tutorial's peek
    resumed.sampler.set_epoch(0)  # the script's own epoch: the one saved
    assert indices(resumed) == rest

    disagreeing = sharded()
    disagreeing.load_state_dict(saved)
    with pytest.raises(sg.UsageError, match=r"restored in the middle of epoch 0"):
        disagreeing.set_epoch(1)
    disagreeing.sampler.set_epoch(1)
    with pytest.raises(sg.UsageError, match=r"restored in the middle of epoch 0"):
        iter(disagreeing)


def test_a_checkpoint_taken_after_a_peek_resumes_where_the_run_goes_on():
    loader = sharded()
    list(loader)
    next(iter(loader))  # peek at epoch 1
    saved = loader.state_dict()
    assert saved == {"epoch": 1, "consumed": 0}
    resumed = sharded()
    resumed.load_state_dict(saved)
    assert indices(resumed) == indices(loader) == reference_epoch(1)
