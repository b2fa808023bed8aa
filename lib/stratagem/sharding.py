"""Give each rank its part of a DataLoader: every sample to exactly one rank per epoch.

`shard_loader` rebuilds the user's DataLoader around a `ShardSampler` and
returns a `ShardedLoader` that advances the epoch at each pass, so shuffled
epochs differ without a ``set_epoch`` call in the user's loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import attrs
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from stratagem.env import Context
from stratagem.errors import UsageError, describe

__all__ = ["ShardSampler", "ShardedLoader", "shard_loader"]

T = TypeVar("T")


@attrs.define
class ShardSampler:
    """Indices of one rank's share of a map-style dataset.

    Each epoch draws one permutation of all indices (the same on every rank,
    from ``seed + epoch``) and deals it out: rank ``r`` takes positions
    ``r, r + world_size, ...``. Nothing is padded or repeated: with
    ``drop_last=False`` every sample goes to exactly one rank and shares differ
    by at most one sample; with ``drop_last=True`` the last
    ``len(dataset) % world_size`` samples of the permutation are left out so
    that every rank gets the same number.
    """

    size: int
    rank: int
    world_size: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    epoch: int = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the permutation of the next pass."""
        self.epoch = epoch

    def _total(self) -> int:
        return self.size - self.size % self.world_size if self.drop_last else self.size

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        return iter(order[: self._total()][self.rank :: self.world_size].tolist())

    def __len__(self) -> int:
        return len(range(self.rank, self._total(), self.world_size))


@attrs.define
class ShardedLoader:
    """A rank's DataLoader that starts a new epoch at every pass.

    Attributes:
        loader: the rebuilt DataLoader.
        sampler: its `ShardSampler` (or the user's distributed sampler).
        epoch: the epoch the next pass will use.
    """

    loader: DataLoader[Any]
    sampler: ShardSampler | DistributedSampler[Any]
    epoch: int = 0

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def _seed_of(loader: DataLoader[Any]) -> int:
    sampler = loader.sampler
    generator = getattr(sampler, "generator", None) or loader.generator
    return int(generator.initial_seed()) if generator is not None else 0


def _rebuild(loader: DataLoader[T], sampler: ShardSampler) -> DataLoader[T]:
    options: dict[str, Any] = {
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, sampler=sampler, **options)


def shard_loader(loader: Iterable[T], ctx: Context) -> Iterable[T]:
    """Return this rank's share of ``loader``, a ``torch.utils.data.DataLoader``.

    The user's choices carry over: shuffling (a ``RandomSampler``), its seed
    (the generator's initial seed, else 0), ``drop_last``, batch size, workers
    and collation. A loader whose sampler is already distributed is only
    wrapped so that its epoch advances.

    Raises:
        UsageError: ``loader`` is not a DataLoader, iterates an
            ``IterableDataset``, or uses a custom ``batch_sampler``; the message
            says how to shard it by hand with ``ctx.rank`` and ``ctx.world_size``.
    """
    if not isinstance(loader, DataLoader):
        raise UsageError(
            f"shard: 'loader' must be a torch DataLoader (got {describe(loader)}); shard other "
            "iterables yourself, e.g. items[ctx.rank::ctx.world_size]."
        )
    if isinstance(loader.sampler, (ShardSampler, DistributedSampler)):
        return ShardedLoader(loader=loader, sampler=loader.sampler)
    if isinstance(loader.dataset, IterableDataset):
        raise UsageError(
            "shard: a DataLoader over an IterableDataset cannot be re-sampled; split the "
            "stream inside the dataset by ctx.rank and ctx.world_size."
        )
    if loader.batch_size is None:
        raise UsageError(
            "shard: the DataLoader uses a custom batch_sampler, which shard cannot split; "
            "give it a sampler per rank yourself (see stratagem.sharding.ShardSampler)."
        )
    sampler = ShardSampler(
        size=len(loader.dataset),  # type: ignore[arg-type]  # map-style datasets have a length
        rank=ctx.rank,
        world_size=ctx.world_size,
        shuffle=isinstance(loader.sampler, RandomSampler),
        seed=_seed_of(loader),
        drop_last=loader.drop_last,
    )
    return ShardedLoader(loader=_rebuild(loader, sampler), sampler=sampler)
