"""Law ``shard-partition``: ``shard`` deals each epoch out as the docs promise.

Each rank shards a DataLoader over a dataset whose samples are their own
indices (a list: ``list(range(size))``), and reads several epochs. Per epoch
the ranks' shares are disjoint, together they cover the dataset but for at
most ``world_size - 1`` samples (the dropped tail, more with ``drop_last``)
or, as torch's ``DistributedSampler(drop_last=False)`` deals, cover all of it
padded with at most ``world_size - 1`` repeats of the epoch's first samples,
and every rank has the same number of batches; with shuffling the order
changes from epoch to epoch; and a second run with the same seed deals
exactly the same. The same holds for a DataLoader over a stream (an
``IterableDataset`` of the indices, reshuffled by its ``set_epoch``), where
the tail is an incomplete round of at most ``world_size - 1`` batches; a
shard that refuses streams with a `UsageError` is not faulted for it, nor is
one that on a single rank returns the stream's loader as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import ChainDataset, DataLoader, Dataset, IterableDataset
from torch.utils.data.datapipes.iter import IterableWrapper

from stratagem.env import Env
from stratagem.errors import UsageError
from stratagem.planning.simulated_world import simulated_world
from stratagem.strategy import StrategyLike
from stratagem.testing.laws._core import LawViolation, run_on
from stratagem.testing.world import World
from stratagem.validators import is_int, require

__all__ = ["check_shard_partition"]


def _indices(size: int) -> Dataset[int]:
    # A list is a map-style dataset to DataLoader (len and indexing); torch types it narrower.
    return list(range(size))  # type: ignore[return-value]


@attrs.define
class _Stream:
    """Samples 0..size-1 as a stream, reshuffled from ``seed + epoch`` when shuffling."""

    size: int
    seed: int
    shuffle: bool
    epoch: int = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


def _iterable(size: int, seed: int, shuffle: bool) -> IterableDataset[int]:
    # lib/ subclasses nothing, so the stream goes in torch's own IterableDatasets: a wrapper
    # that iterates it afresh each pass, in a chain (a DataLoader hides a bare data pipe's
    # attributes behind its own wrapper); the chain's epoch hook is the stream's.
    stream = _Stream(size, seed, shuffle)
    chain = ChainDataset([IterableWrapper(stream, deepcopy=False)])
    chain.set_epoch = stream.set_epoch  # type: ignore[attr-defined]
    return chain


def _passes(
    strategy: StrategyLike, ctx: Any, loader: DataLoader[int], epochs: int, stream: bool = False
) -> Any:
    shard = strategy.shard(loader, ctx)
    if stream and shard is loader and ctx.world_size == 1:
        return None  # one rank keeps the user's stream as it is (single_device): theirs to drive
    return [[int(i) for batch in shard for i in batch] for _ in range(epochs)]


def _epochs(
    strategy: StrategyLike,
    ctx: Any,
    size: int,
    batch_size: int,
    epochs: int,
    shuffle: bool,
    drop_last: bool,
    seed: int,
    iterable: bool,
) -> dict[str, Any]:
    runs = []
    for _ in range(2):  # twice from the same seed: dealing must be deterministic
        generator = torch.Generator().manual_seed(seed)
        loader = DataLoader(
            _indices(size), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
            generator=generator,
        )  # fmt: skip
        runs.append(_passes(strategy, ctx, loader, epochs))
    count = len(list(strategy.shard(DataLoader(_indices(size), batch_size=batch_size), ctx)))
    result: dict[str, Any] = {
        "map": runs,
        "count": count,
        "iterable": None,
        "data_parallel": tuple(ctx.data_parallel),
    }
    if iterable:
        streams = [_iterable(size, seed, shuffle) for _ in range(2)]
        with contextlib.suppress(UsageError):  # a shard may refuse streams, clearly
            runs = [
                _passes(strategy, ctx, DataLoader(s, batch_size=batch_size), epochs, True)
                for s in streams
            ]
            result["iterable"] = None if None in runs else runs
    return result


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
    iterable: bool = True,
    simulated: bool = False,
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
        iterable: also check a DataLoader over a stream of the same samples.
        simulated: deal on ``world_size`` simulated ranks in this process, one after
            another (each joins torch's fake world as itself and runs the
            strategy's own ``setup``), instead of a `World`: about a second
            for a mesh of 64 ranks (each rank builds every group of the mesh).

    Example:
        >>> import stratagem as sg
        >>> from stratagem.testing.laws import check_shard_partition
        >>> check_shard_partition(sg.hsdp(replicate=4, shard=16, device="cpu"),
        ...                       world_size=64, size=150, simulated=True)

    Raises:
        LawViolation: a sample went to two ranks, too many were left out, ranks
            got different numbers of batches, shuffled epochs repeated, or two
            runs from one seed dealt differently.
        UsageError: an argument is malformed.
    """
    for name, value in (("size", size), ("batch_size", batch_size), ("epochs", epochs)):
        require(is_int(value, 1), f"check_shard_partition: {name!r}", "a positive int", value)
    require(
        isinstance(iterable, bool), "check_shard_partition: 'iterable'", "True or False", iterable
    )
    require(
        isinstance(simulated, bool),
        "check_shard_partition: 'simulated'",
        "True or False",
        simulated,
    )
    if simulated and world is not None:
        raise UsageError(
            "check_shard_partition: 'simulated=True' deals on simulated ranks and 'world' runs "
            "real ones; pass one of them."
        )
    require(is_int(world_size, 1), "check_shard_partition: 'world_size'", "a positive int",
            world_size)  # fmt: skip
    ranks = world.world_size if world is not None else world_size
    if size < ranks:
        raise UsageError(
            f"check_shard_partition: 'size' must be at least the world size {ranks} (got {size})."
        )
    args = (size, batch_size, epochs, shuffle, drop_last, seed, iterable)
    if simulated:
        results = _simulated_runs(strategy, ranks, args)
    else:
        results = run_on(world, ranks, _epochs, strategy, *args)
    inputs = (
        f"{size} samples, batch_size={batch_size}, shuffle={shuffle}, drop_last={drop_last}, "
        f"seed={seed}, {epochs} epochs"
    )

    def broken(kind: str) -> Callable[[str], LawViolation]:
        return lambda found: LawViolation(
            "shard-partition", strategy, f"{kind}, {inputs}", f"{kind}: {found}"
        )

    # The ranks of a tensor-parallel group take the same batches; the groups partition.
    results = _one_per_group(results, broken("a model-parallel group"))
    ranks = len(results)

    tail = ranks - 1 if not drop_last else size % ranks + ranks * batch_size
    _check_runs([r["map"] for r in results], tail, batch_size, epochs, shuffle, seed, size,
                broken("a map-style dataset"))  # fmt: skip
    counts = {result["count"] for result in results}
    if len(counts) > 1:
        raise broken("a map-style dataset")(
            f"an unshuffled loader gave the ranks {sorted(counts)} batches: every rank must get "
            "the same number"
        )
    streams = [result["iterable"] for result in results]
    if any(stream is not None for stream in streams):  # None throughout: not run, or refused
        if any(stream is None for stream in streams):
            refused = [rank for rank, stream in enumerate(streams) if stream is None]
            raise broken("an IterableDataset")(
                f"ranks {refused} refused the stream and the others took it: ranks must agree"
            )
        _check_runs(streams, (ranks - 1) * batch_size, batch_size, epochs, shuffle, seed, size,
                    broken("an IterableDataset"))  # fmt: skip


def _simulated_runs(
    strategy: StrategyLike, world_size: int, args: tuple[Any, ...]
) -> list[dict[str, Any]]:
    """Run `_epochs` as each rank of a simulated world in turn (``shard`` sends nothing)."""
    per_host = min(world_size, 8)
    results = []
    for rank in range(world_size):
        env = Env(
            rank=rank, local_rank=rank % per_host, world_size=world_size,
            local_world_size=per_host, node_rank=rank // per_host, master_port=29500,
        )  # fmt: skip  # the port is never dialled: the fake world has no store to meet at
        with simulated_world(world_size, rank=rank, caller="check_shard_partition"):
            results.append(_epochs(strategy, strategy.setup(env), *args))
    return results


def _one_per_group(
    results: list[dict[str, Any]], broken: Callable[[str], LawViolation]
) -> list[dict[str, Any]]:
    """Return one rank's results per data-parallel index, checking the others took the same."""
    chosen: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, result in enumerate(results):
        index, _ = result["data_parallel"]
        if index not in chosen:
            chosen[index] = (rank, result)
            continue
        first, theirs = chosen[index]
        if any(result[k] != theirs[k] for k in ("map", "count", "iterable")):
            raise broken(
                f"ranks {first} and {rank} are one data-parallel rank ({index}: parts of one "
                "model) and took different batches; they must take the same"
            )
    return [chosen[index][1] for index in sorted(chosen)]


def _torch_padding(shares: list[list[int]], size: int, left_out: int) -> bool:
    """Whether the repeats in one epoch's ``shares`` are those of torch's ``DistributedSampler``.

    With ``drop_last=False`` it deals the epoch's order, padded to a multiple of
    the world size by repeating the order from its start, rank ``r`` taking
    places ``r, r + world_size, ...``: every sample is dealt, the shares are
    equal, and the ``total - size < world_size`` places past the order hold
    its first samples again.
    """
    ranks = len(shares)
    lengths = {len(mine) for mine in shares}
    if left_out or len(lengths) != 1:
        return False
    order = [shares[r][i] for i in range(lengths.pop()) for r in range(ranks)]
    padding = len(order) - size
    return 0 < padding < ranks and all(order[size + j] == order[j % size] for j in range(padding))


def _check_runs(
    runs: list[list[list[list[int]]]],
    tail: int,
    batch_size: int,
    epochs: int,
    shuffle: bool,
    seed: int,
    size: int,
    broken: Callable[[str], LawViolation],
) -> None:
    """Check one kind of loader: per rank, two runs of ``epochs`` passes from one seed."""
    first = [rank_runs[0] for rank_runs in runs]
    ranks = len(first)
    for epoch in range(epochs):
        for rank in range(1, ranks):
            if first[rank][epoch] and sorted(first[rank][epoch]) == sorted(first[0][epoch]):
                raise broken(
                    f"epoch {epoch}: rank {rank} read exactly rank 0's samples; every rank "
                    "reading rank 0's share (a rank that is not used to pick it) gives this"
                )
        seen: dict[int, int] = {}
        repeated: list[tuple[int, int, int]] = []  # (sample, first rank, rank it went to again)
        for rank, rank_epochs in enumerate(first):
            for sample in rank_epochs[epoch]:
                if sample in seen:
                    repeated.append((sample, seen[sample], rank))
                else:
                    seen[sample] = rank
        left_out = size - len(seen)
        if repeated and not _torch_padding([r[epoch] for r in first], size, left_out):
            sample, earlier, rank = repeated[0]
            raise broken(
                f"epoch {epoch}: sample {sample} went to rank {earlier} and to rank {rank} "
                f"({len(repeated)} repeated in all); shares must be disjoint but for torch's "
                f"padding (DistributedSampler(drop_last=False): every sample dealt, then at "
                f"most {ranks - 1} repeats of the epoch's first samples); overlapping slices "
                "give this"
            )
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
    for rank, rank_runs in enumerate(runs):
        if rank_runs[1] != rank_runs[0]:
            raise broken(f"rank {rank}: two runs from seed {seed} dealt differently")
