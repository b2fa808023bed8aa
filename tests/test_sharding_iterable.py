"""shard() over an IterableDataset: every world_size-th batch to each rank, equal counts, resumable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset

import stratagem as sg
from helpers import rank_ctx
from kit_strategies import stream_shard
from stratagem.sharding import shard_loader
from stratagem.testing import LawViolation, laws


class Stream(IterableDataset):
    """Samples 0..size-1, in an order drawn from the epoch when shuffling; counts set_epoch calls."""

    def __init__(self, size: int, shuffle: bool = False) -> None:
        self.size, self.shuffle, self.epoch, self.epochs_set = size, shuffle, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_set.append(epoch)

    def __iter__(self):
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


def batches_per_rank(size: int, world_size: int, batch_size: int) -> list[list[list[int]]]:
    shares = []
    for rank in range(world_size):
        loader = DataLoader(Stream(size), batch_size=batch_size)
        shares.append(
            [batch.tolist() for batch in shard_loader(loader, rank_ctx(rank, world_size))]
        )
    return shares


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 60), world_size=st.integers(1, 5), batch_size=st.integers(1, 7))
def test_every_rank_takes_every_world_size_th_batch_and_only_a_short_round_is_dropped(
    size, world_size, batch_size
):
    shares = batches_per_rank(size, world_size, batch_size)
    everything = [b.tolist() for b in DataLoader(Stream(size), batch_size=batch_size)]
    rounds = len(everything) // world_size
    for rank, share in enumerate(shares):
        assert share == everything[rank : rounds * world_size : world_size]
        assert len(share) == rounds  # equal counts: no rank waits for a batch the others lack
    dealt = sorted(i for share in shares for batch in share for i in batch)
    assert len(dealt) == len(set(dealt))
    assert len(everything) - rounds * world_size < world_size  # only the incomplete round
    loader = shard_loader(DataLoader(Stream(size), batch_size=batch_size), rank_ctx(0, world_size))
    assert len(loader) == rounds


def test_the_epoch_reaches_the_datasets_set_epoch_so_a_shuffled_stream_reshuffles():
    streams = [Stream(12, shuffle=True) for _ in range(2)]
    loaders = [
        shard_loader(DataLoader(stream, batch_size=2), rank_ctx(rank, 2))
        for rank, stream in enumerate(streams)
    ]
    epochs = [[[b.tolist() for b in loader] for _ in range(3)] for loader in loaders]
    assert streams[0].epochs_set == [0, 1, 2]
    assert epochs[0][0] != epochs[0][1] != epochs[0][2]
    for epoch in range(3):  # the ranks' shares of one epoch stay disjoint and complete
        samples = sorted(i for rank in range(2) for b in epochs[rank][epoch] for i in b)
        assert samples == list(range(12))


def test_a_resumed_stream_continues_with_the_batches_it_would_have_seen():
    def loader(rank):
        return shard_loader(DataLoader(Stream(20), batch_size=2), rank_ctx(rank, 2))

    for rank in range(2):
        whole = [[b.tolist() for b in loader(rank)] for _ in range(2)]
        first = loader(rank)
        seen = []
        for batch in first:
            seen.append(batch.tolist())
            if len(seen) == 3:
                break
        position = first.state_dict()
        assert position == {"epoch": 0, "consumed": 3 * 2 * 2}
        resumed = loader(rank)
        resumed.load_state_dict(position)
        rest = [b.tolist() for b in resumed]
        assert seen + rest == whole[0]
        assert [b.tolist() for b in resumed] == whole[1]


def _stream_shares(strategy, ctx):
    return [batch.tolist() for batch in strategy.shard(DataLoader(Stream(13), batch_size=2), ctx)]


@pytest.mark.parametrize(
    "strategy", [sg.ddp(device="cpu"), sg.fsdp(device="cpu")], ids=["ddp", "fsdp"]
)
def test_built_in_shards_split_a_stream_on_a_real_world(stratagem_world, strategy):
    shares = stratagem_world.run(_stream_shares, strategy)
    # 7 batches of 13 samples: 3 whole rounds; the incomplete round, [12], goes to no rank
    assert shares == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [10, 11]]]


def test_strides_have_a_readable_record():
    stride = sg.StreamStride([1, 2, 3], rank=1, world_size=2)
    assert list(stride.select(iter("abcde"))) == ["b", "d"]
    assert list(stride.select(iter("abcde"), skip=1)) == ["c", "e"]


def test_the_partition_law_passes_honest_stream_shards(stratagem_world):
    # A map-only shard that refuses streams with a UsageError passes too: custom_shard, in
    # tests/test_kit_mutants.py::test_an_honest_custom_shard_and_every_built_in_shard_...
    for strategy in (sg.ddp(device="cpu"), stream_shard()):
        laws.check_shard_partition(strategy, world=stratagem_world, size=21)


STREAM_BUGS = {
    "every rank reads the whole stream": (stream_shard(passthrough=True), "read exactly rank 0"),
    "the stream is never told the epoch": (stream_shard(advance=False), "never advances"),
    "the incomplete round goes to rank 0": (
        stream_shard(drop_round=False), "different numbers of batches"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(STREAM_BUGS))
def test_a_planted_stream_bug_is_caught_by_the_partition_law(stratagem_world, name):
    strategy, message = STREAM_BUGS[name]
    with pytest.raises(LawViolation, match=message) as caught:
        laws.check_shard_partition(strategy, world=stratagem_world, size=21)
    assert "an IterableDataset" in str(caught.value)
