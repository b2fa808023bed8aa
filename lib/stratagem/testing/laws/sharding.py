"""Law ``shard-partition``: ``shard`` deals each epoch out as the docs promise.

Each rank shards a DataLoader over a dataset whose samples are their own
indices (a list: ``list(range(size))``), and reads several epochs. Per epoch
the ranks' shares are disjoint, together they cover the dataset but for at
most ``world_size - 1`` samples (the dropped tail, more with ``drop_last``),
and every rank has the same number of batches; with shuffling the order
changes from epoch to epoch; and a second run with the same seed deals
exactly the same.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from stratagem.errors import UsageError, describe
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import LawViolation, run_on
from stratagem.testing.world import World

__all__ = ["check_shard_partition"]


def _indices(size: int) -> Dataset[int]:
    # A list is a map-style dataset to DataLoader (len and indexing); torch types it narrower.
    return list(range(size))  # type: ignore[return-value]


def _epochs(
    strategy: StrategyLike,
    ctx: Any,
    size: int,
    batch_size: int,
    epochs: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
) -> list[list[list[int]]]:
    runs = []
    for _ in range(2):  # twice from the same seed: dealing must be deterministic
        generator = torch.Generator().manual_seed(seed)
        loader = DataLoader(
            _indices(size), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
            generator=generator,
        )  # fmt: skip
        shard = strategy.shard(loader, ctx)
        runs.append([[int(i) for batch in shard for i in batch] for _ in range(epochs)])
    counts = [len(list(strategy.shard(DataLoader(_indices(size), batch_size=batch_size), ctx)))]
    return [*runs, [counts]]


def check_shard_partition(
    strategy: StrategyLike,
    *,
    world: World | None = None,
    world_size: int = 2,
    size: int = 23,
    batch_size: int = 2,
    epochs: int = 3,
    shuffle: bool = True,
    drop_last: bool = False,
    seed: int = 5,
) -> None:
    """Law ``shard-partition``: disjoint, complete up to a small tail, equal batches, reshuffled.

    Args:
        strategy: the strategy whose ``shard`` field is checked.
        world: the `World` to run on (else one of ``world_size`` is started).
        world_size: ranks to start when ``world`` is omitted.
        size: samples in the dataset.
        batch_size: the DataLoader's batch size.
        epochs: passes over the sharded loader.
        shuffle: whether the DataLoader shuffles (then epochs must differ in order).
        drop_last: the DataLoader's ``drop_last``.
        seed: the seed of the DataLoader's generator.

    Raises:
        LawViolation: a sample went to two ranks, too many were left out, ranks
            got different numbers of batches, shuffled epochs repeated, or two
            runs from one seed dealt differently.
        UsageError: an argument is malformed.
    """
    for name, value in (("size", size), ("batch_size", batch_size), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(
                f"check_shard_partition: {name!r} must be a positive int (got {describe(value)})."
            )
    ranks = world.world_size if world is not None else world_size
    if size < ranks:
        raise UsageError(
            f"check_shard_partition: 'size' must be at least the world size {ranks} (got {size})."
        )
    results = run_on(
        world, ranks, _epochs, strategy, size, batch_size, epochs, shuffle, drop_last, seed
    )
    inputs = (
        f"{size} samples, batch_size={batch_size}, shuffle={shuffle}, drop_last={drop_last}, "
        f"seed={seed}, {epochs} epochs"
    )

    def broken(found: str) -> LawViolation:
        return LawViolation("shard-partition", strategy, inputs, found)

    first = [result[0] for result in results]
    tail = ranks - 1 if not drop_last else size % ranks + ranks * batch_size
    for epoch in range(epochs):
        for rank in range(1, ranks):
            if first[rank][epoch] and sorted(first[rank][epoch]) == sorted(first[0][epoch]):
                raise broken(
                    f"epoch {epoch}: rank {rank} read exactly rank 0's samples; every rank "
                    "reading rank 0's share (a rank that is not used to pick it) gives this"
                )
        seen: dict[int, int] = {}
        for rank, rank_epochs in enumerate(first):
            for sample in rank_epochs[epoch]:
                if sample in seen:
                    raise broken(
                        f"epoch {epoch}: sample {sample} went to rank {seen[sample]} and to rank "
                        f"{rank}; shares must be disjoint (overlapping slices give this)"
                    )
                seen[sample] = rank
        left_out = size - len(seen)
        if left_out > tail:
            raise broken(
                f"epoch {epoch}: {left_out} of {size} samples went to no rank (at most {tail} "
                "may be left out); shares that do not cover the dataset give this"
            )
        lengths = {len(rank_epochs[epoch]) for rank_epochs in first}
        if len({-(-n // batch_size) for n in lengths}) > 1:
            raise broken(
                f"epoch {epoch}: ranks took {sorted(lengths)} samples, different numbers of "
                "batches: a rank would wait in a collective for a batch the others lack"
            )
    if (
        shuffle
        and epochs > 1
        and all(rank_epochs[e] == rank_epochs[0] for rank_epochs in first for e in range(1, epochs))
    ):
        raise broken(
            "every epoch dealt the same order: the sampler's epoch never advances "
            "(DistributedSampler without set_epoch gives this)"
        )
    for rank, result in enumerate(results):
        if result[1] != result[0]:
            raise broken(f"rank {rank}: two runs from seed {seed} dealt differently")
    counts = {result[2][0][0] for result in results}
    if len(counts) > 1:
        raise broken(
            f"an unshuffled loader gave the ranks {sorted(counts)} batches: every rank must get "
            "the same number"
        )
