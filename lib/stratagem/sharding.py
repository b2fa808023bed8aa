"""Give each rank its part of a DataLoader: every sample to exactly one rank per epoch.

`shard_loader` rebuilds the user's DataLoader around a `ShardSampler` (or, for
an ``IterableDataset``, strides over its batches with a `StreamStride`) and
returns a `ShardedLoader`. Its epoch is the script's: a ``set_epoch`` call
(on the loader, its sampler, or the user's own sampler or stream) chooses the
next pass's, and without one each pass is followed by the next epoch, so
shuffled epochs differ either way; a peek at one batch is not an epoch. The
loader's position (epoch, samples consumed) is checkpointable state, so a
resumed run continues in the middle of an epoch with the batches it would
have seen.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import attrs
import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from stratagem.collectives import check_world
from stratagem.env import Context, check_context
from stratagem.errors import UsageError, describe
from stratagem.validators import (
    a_bool,
    field,
    instance_of,
    is_int,
    non_negative_int,
    positive_int,
    rank_and_world,
    refusal,
    require,
)

__all__ = [
    "ShardSampler",
    "ShardedLoader",
    "StreamStride",
    "check_not_empty",
    "keep_loader",
    "shard_loader",
]

T = TypeVar("T")

_SEEDS = 2**64  # torch generators take seeds modulo this; larger sums would overflow


def _epoch_seed(seed: int, epoch: int) -> int:
    """Return the seed of ``epoch``'s draws: ``seed + epoch``, as torch's generators take it."""
    return (seed + epoch) % _SEEDS


def _index(value: object) -> object:
    """Turn an integer-like value (a numpy int, a 0-d int tensor) into an int; leave the rest."""
    if isinstance(value, (bool, int)):
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return value


def _draw(source: Iterable[Any], seed: int, epoch: int) -> list[Any]:
    """Return what a user's sampler yields in ``epoch``, the same on every rank.

    A copy of the sampler is told the epoch (where it has ``set_epoch``) and
    given a generator seeded from ``seed + epoch`` (where it draws from a
    ``generator`` attribute, as torch's samplers do), and is iterated with
    torch's global generator forked and seeded alike, so that the ranks, whose
    global generators may differ, draw the same indices. The user's sampler and
    the global generator are left as they were.
    """
    sampler = copy.copy(source)
    seeded = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    if isinstance(getattr(sampler, "generator", None), (torch.Generator, type(None))):
        # A read-only property is left alone: the global generator, seeded below, still serves.
        with contextlib.suppress(AttributeError):
            sampler.generator = seeded  # type: ignore[attr-defined]
    _tell_epoch(sampler, epoch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_epoch_seed(seed, epoch))
        return [_index(index) for index in sampler]


def _drawn_alike(source: Iterable[Any], seed: int, epoch: int) -> list[Any]:
    """Return `_draw`'s indices, refusing a sampler whose draws do not repeat.

    Two draws for the same epoch must agree, or the sampler draws from a
    generator shard cannot seed (Python's ``random``, numpy), and the ranks'
    draws would differ: samples repeated on some ranks and missed by all.

    Raises:
        UsageError: the two draws differ.
    """
    order = _draw(source, seed, epoch)
    if _draw(source, seed, epoch) != order:
        raise UsageError(
            f"shard: the DataLoader's sampler ({type(source).__name__}) yields indices that "
            f"differ from one draw of epoch {epoch} to the next, so the ranks would deal out "
            "different draws (samples repeated, others missed); draw them from its "
            "'generator' attribute (a torch.Generator, which shard seeds alike on every rank), "
            "or seed its generator from the epoch in set_epoch."
        )
    return order


_SAMPLER_RANK, _SAMPLER_WORLD = rank_and_world("ShardSampler.{name}")
_SAMPLER_COUNT = non_negative_int("ShardSampler.{name}")
_SAMPLER_FLAG = a_bool("ShardSampler.{name}")


@attrs.define
class ShardSampler:
    """Indices of one rank's share of a map-style dataset.

    Each epoch draws one permutation of all indices (the same on every rank,
    from ``seed + epoch``) and deals it out: rank ``r`` takes positions
    ``start + r, start + r + world_size, ...``. Nothing is padded or repeated: with
    ``drop_last=False`` every sample goes to at most one rank and shares differ
    by at most one sample; with ``drop_last=True`` the last
    ``len(dataset) % world_size`` samples of the permutation are left out so
    that every rank gets the same number.

    ``batch_size`` (which `shard_loader` sets) also makes every rank yield the
    same number of batches, so that no rank waits in a collective for a batch
    the others do not have. Dealing already does that unless the epoch's last
    global batch would hold fewer samples than there are ranks
    (``0 < (size - start) % (world_size * batch_size) < world_size``): then those few
    samples, at most ``world_size - 1``, are left out of the epoch (a
    different few each shuffled epoch). Otherwise every sample goes to exactly
    one rank.

    With ``source`` (the user's own sampler, which `shard_loader` passes on),
    what it yields in the epoch is dealt out instead of a permutation of
    ``range(size)``: its indices, its order, its repeats. Every rank draws the
    same indices (see `shard_loader`); ``size`` is how many it yields, which
    must not change from epoch to epoch.

    ``start`` skips the first positions of the permutation, which the world
    consumed before a checkpoint: ``world_size * batches * batch_size`` after
    every rank took ``batches`` whole batches, since dealing makes what the
    ranks consumed together a prefix of the permutation.

    Fields are validated at construction and on assignment.

    Raises:
        UsageError: a field has the wrong type or range (``rank >= world_size``, ...).
    """

    size: int = attrs.field(converter=_index, validator=_SAMPLER_COUNT)
    rank: int = attrs.field(converter=_index, validator=_SAMPLER_RANK)
    world_size: int = attrs.field(converter=_index, validator=_SAMPLER_WORLD)
    shuffle: bool = attrs.field(default=False, validator=_SAMPLER_FLAG)
    seed: int = attrs.field(
        converter=_index, default=0, validator=field(is_int, "ShardSampler.{name}", "an int")
    )
    drop_last: bool = attrs.field(default=False, validator=_SAMPLER_FLAG)
    epoch: int = attrs.field(converter=_index, default=0, validator=_SAMPLER_COUNT)
    start: int = attrs.field(converter=_index, default=0, validator=_SAMPLER_COUNT)
    batch_size: int | None = attrs.field(
        default=None,
        converter=_index,
        validator=positive_int("ShardSampler.{name}", optional="None"),
    )
    source: Iterable[Any] | None = attrs.field(
        default=None,
        validator=instance_of(
            "ShardSampler.{name}", Iterable, "an iterable sampler", optional="None (a permutation)"
        ),
    )

    def set_epoch(self, epoch: int) -> None:
        """Choose the permutation of the next pass (a `ShardedLoader` over it takes the choice)."""
        self.epoch = epoch

    def _kept(self) -> int:
        """How many positions of the permutation, from ``start``, this pass deals out.

        Counted from ``start``, because a position saved by a world of another
        size need not be a multiple of this one's ``world_size * batch_size``.
        """
        remaining = max(0, self.size - self.start)
        if self.drop_last:
            return remaining - remaining % self.world_size
        if self.batch_size is not None:
            last = remaining % (self.world_size * self.batch_size)
            if last < self.world_size:  # some rank would lack the last batch: leave it out
                return remaining - last
        return remaining

    def __iter__(self) -> Iterator[Any]:
        order: list[Any] | torch.Tensor
        if self.source is not None:
            order = _drawn_alike(self.source, self.seed, self.epoch)
            if len(order) != self.size:
                raise UsageError(
                    f"shard: the DataLoader's sampler ({type(self.source).__name__}) yielded "
                    f"{len(order)} indices in epoch {self.epoch} but {self.size} before, and "
                    "every rank must know its number of batches in advance; make it yield "
                    "the same number every epoch."
                )
        elif self.shuffle:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
            order = torch.randperm(self.size, generator=generator)
        else:
            order = torch.arange(self.size)
        mine = order[self.start : self.start + self._kept()][self.rank :: self.world_size]
        return iter(mine.tolist() if isinstance(mine, torch.Tensor) else mine)

    def __len__(self) -> int:
        return len(range(self.rank, self._kept(), self.world_size))


_STREAM_RANK, _STREAM_WORLD = rank_and_world("StreamStride.{name}")


@attrs.define
class StreamStride:
    """One rank's batches of a DataLoader over an ``IterableDataset``: every world_size-th.

    A stream has no indices to deal, so every rank iterates the whole loader
    and keeps the global batches ``rank, rank + world_size, ...`` of it. A
    rank yields its batch only once the round of ``world_size`` batches is
    complete, so an epoch's incomplete last round (at most ``world_size - 1``
    batches) goes to no rank and every rank yields the same number of batches.
    Reading the whole stream on every rank costs ``world_size`` times the
    loading; for a large stream, split it inside the dataset by rank instead.

    ``set_epoch`` is forwarded to the dataset where it has one, so a dataset
    that shuffles by epoch reshuffles at every pass.

    Fields are validated at construction and on assignment.

    Raises:
        UsageError: a field has the wrong type or range.
    """

    dataset: Any
    rank: int = attrs.field(converter=_index, validator=_STREAM_RANK)
    world_size: int = attrs.field(converter=_index, validator=_STREAM_WORLD)
    epoch: int = attrs.field(
        converter=_index, default=0, validator=non_negative_int("StreamStride.{name}")
    )

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch of the next pass and tell the dataset, if it listens."""
        self.epoch = epoch
        _tell_epoch(self.dataset, self.epoch)

    def select(self, batches: Iterable[T], skip: int = 0) -> Iterator[T]:
        """Yield this rank's batches of ``batches`` after the first ``skip`` global ones."""
        kept: Any = None
        for position, batch in enumerate(itertools.islice(batches, skip, None)):
            if position % self.world_size == self.rank:
                kept = batch
            if position % self.world_size == self.world_size - 1:
                yield kept
                kept = None


def _tell_epoch(holder: object, epoch: int) -> None:
    """Call ``holder.set_epoch(epoch)`` where a sampler or dataset has one."""
    set_epoch = getattr(holder, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _epoch_of(holder: object) -> int | None:
    """Return the epoch a sampler or dataset holds (``epoch``, as torch's samplers name it)."""
    value = _index(getattr(holder, "epoch", None))
    return value if isinstance(value, int) and not isinstance(value, bool) else None


@attrs.define
class _Pass:
    """Where the latest pass over a `ShardedLoader` stands."""

    epoch: int
    start: int  # positions of the epoch's permutation consumed before this pass
    batches: int = 0  # batches this rank took in this pass
    settled: bool = False  # the next pass's epoch no longer depends on this one


_SAMPLERS = (ShardSampler, DistributedSampler, StreamStride)


def _mirrored(loader: Any, attribute: object, epoch: int) -> int:
    """Show a `ShardedLoader`'s next epoch on its sampler, if ours: another there is a choice."""
    if isinstance(loader.sampler, (ShardSampler, StreamStride)):
        loader.sampler.epoch = epoch
    return epoch


@attrs.define
class ShardedLoader:
    """A rank's DataLoader that keeps the epoch as the script does; its position is checkpointable.

    The epoch rule (the same on every rank, so the ranks stay in step):

    - ``set_epoch(e)`` (on this loader, on its ``.sampler``, or on the
      ``DistributedSampler`` or stream dataset you gave ``shard``) chooses the
      epoch of the next pass, as torch's ``DistributedSampler.set_epoch`` does;
      calling it every epoch, or never, are both fine.
    - Without a call, each pass that counts is followed by the next epoch, so
      shuffled epochs differ with no ``set_epoch`` in the loop.
    - A pass counts once it yields its second batch, or reaches its end. A
      pass left after its first batch (a peek: ``next(iter(loader))``) is not
      an epoch: the next pass starts that epoch over.
    - After ``load_state_dict`` of a position in the middle of an epoch, the
      next pass continues it; choosing another epoch before that pass raises,
      rather than silently dropping the rest of the epoch.

    ``state_dict()`` is the position of the pass in progress (``{"epoch",
    "consumed"}``: positions of that epoch's permutation the world has
    consumed), or of the next pass when none is; after ``load_state_dict``
    the next pass resumes there. A pass left before its end (``break``)
    counts as in progress until the next pass starts.

    Attributes:
        loader: the rebuilt DataLoader.
        sampler: its `ShardSampler`, the `StreamStride` of a stream, or the user's
            distributed sampler.
        epoch: the epoch the next pass will use.

    Raises:
        UsageError: a field has the wrong type.
    """

    loader: DataLoader[Any] = attrs.field(
        validator=instance_of("ShardedLoader.{name}", DataLoader, "a DataLoader")
    )
    sampler: ShardSampler | StreamStride | DistributedSampler[Any] = attrs.field(
        validator=instance_of(
            "ShardedLoader.{name}",
            _SAMPLERS,
            "a ShardSampler, a StreamStride or a DistributedSampler",
            hint="; strategy.shard(loader, ctx) builds them for you",
        )
    )
    epoch: int = attrs.field(
        default=0,
        validator=non_negative_int("ShardedLoader.{name}"),
        on_setattr=attrs.setters.pipe(attrs.setters.validate, _mirrored),
    )
    _start: int = attrs.field(default=0, init=False)
    _pass: _Pass | None = attrs.field(default=None, init=False, repr=False)
    # The epoch the user's own sampler or dataset held when this loader last looked: a
    # different one at the next pass is the user's set_epoch. (A ShardSampler or a
    # StreamStride instead holds this loader's next epoch between passes: another is a choice.)
    _seen: int | None = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._seen = _epoch_of(self._holder())
        _mirrored(self, None, self.epoch)

    def _holder(self) -> object:
        """Return the user's own sampler or dataset, whose ``epoch`` a script may set; or None."""
        if isinstance(self.sampler, StreamStride):
            return self.sampler.dataset
        return self.sampler if isinstance(self.sampler, DistributedSampler) else self.sampler.source

    def _choice(self) -> int | None:
        """Take the epoch the user set on the sampler or dataset since the last pass, if any."""
        held = _epoch_of(self._holder())
        choice = held if held is not None and held != self._seen else None
        self._seen = held
        ours = isinstance(self.sampler, (ShardSampler, StreamStride))
        if ours and self.sampler.epoch != self.epoch:
            choice = self.sampler.epoch
        return choice

    def _take_choice(self) -> None:
        choice = self._choice()
        if choice is not None:
            self._choose(choice)

    def _choose(self, epoch: int) -> None:
        if epoch != self.epoch:
            if self._start > 0:
                raise UsageError(
                    f"ShardedLoader.set_epoch: the loader was restored in the middle of epoch "
                    f"{self.epoch} ({self._start} positions consumed), and epoch {epoch} would "
                    f"drop the rest of it; set epoch {self.epoch} to continue it, or "
                    f"load_state_dict({{'epoch': {epoch}, 'consumed': 0}}) to start another."
                )
            self.epoch = epoch
        if self._pass is not None:
            self._pass.settled = True  # the user decided the next pass's epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch of the next pass; the passes after it go on from there.

        Choosing the epoch a mid-epoch position was restored in keeps the
        position (the next pass continues it).

        Raises:
            UsageError: ``epoch`` is not a non-negative int, or the loader was
                restored in the middle of another epoch.
        """
        epoch = _index(epoch)  # type: ignore[assignment]
        require(is_int(epoch, 0), "ShardedLoader.set_epoch: 'epoch'", "a non-negative int", epoch)
        self._take_choice()  # an earlier choice on the sampler; this later one wins
        self._choose(epoch)

    def __iter__(self) -> Iterator[Any]:
        self._take_choice()
        self._pass = _Pass(self.epoch, self._start)
        return self._run(self._pass)

    def _tell(self, epoch: int) -> None:
        """Give the sampler (and a stream's dataset) the epoch of the pass that starts."""
        if isinstance(self.sampler, DistributedSampler):
            self.sampler.set_epoch(epoch)
        else:
            self.sampler.epoch = epoch  # not set_epoch: that is the user's choice
            if isinstance(self.sampler, StreamStride):
                _tell_epoch(self.sampler.dataset, epoch)
        self._seen = _epoch_of(self._holder())

    def _settle(self, progress: _Pass) -> None:
        """Count the pass: unless the user chose otherwise, the next pass is the next epoch."""
        if self._pass is progress and not progress.settled:
            self._start = 0  # this pass took over the restored position, whatever comes next
            self._take_choice()  # one the user made during the pass settles it instead
            if not progress.settled:
                self.epoch = progress.epoch + 1
        progress.settled = True

    def _run(self, progress: _Pass) -> Iterator[Any]:
        self._tell(progress.epoch)
        batches: Iterator[Any]
        if isinstance(self.sampler, ShardSampler):
            self.sampler.start = progress.start
            if self.loader.generator is not None:
                # Workers' seeds come from this generator: per epoch, and never from the
                # global RNG, whose state a resumed run restores.
                self.loader.generator.manual_seed(_epoch_seed(self.sampler.seed, progress.epoch))
            batches = iter(self.loader)
        elif isinstance(self.sampler, StreamStride):  # skips the global batches consumed
            batches = self.sampler.select(
                self.loader, progress.start // (self.loader.batch_size or 1)
            )
        else:  # a user's DistributedSampler cannot skip: its batches are loaded and dropped
            batches = itertools.islice(
                self.loader, progress.start // self._positions_per_batch(), None
            )
        try:
            for batch in batches:
                progress.batches += 1
                if progress.batches == 2:
                    self._settle(progress)
                yield batch
        except GeneratorExit:
            if progress.batches <= 1 and self._pass is progress:
                self._pass = None  # a peek: the next pass starts this epoch over
            raise
        self._settle(progress)
        if self._pass is progress:
            self._pass = None

    def _positions_per_batch(self) -> int:
        world = (
            self.sampler.num_replicas
            if isinstance(self.sampler, DistributedSampler)
            else self.sampler.world_size
        )
        return world * (self.loader.batch_size or 1)

    def __len__(self) -> int:
        if isinstance(self.sampler, StreamStride):  # whole rounds of the stream's batches
            return len(self.loader) // self.sampler.world_size
        return len(self.loader)

    def state_dict(self) -> dict[str, int]:
        """Return the position: the epoch in progress (or next) and the positions consumed of it.

        Raises:
            UsageError: the script set an epoch that would drop the rest of a restored one.
        """
        if self._pass is None:
            self._take_choice()
            return {"epoch": self.epoch, "consumed": self._start}
        consumed = self._pass.start + self._pass.batches * self._positions_per_batch()
        return {"epoch": self._pass.epoch, "consumed": consumed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Make the next pass resume at a position `state_dict` returned.

        Raises:
            UsageError: ``state`` is not such a position.
        """
        label = "ShardedLoader.load_state_dict: 'state'"
        require(isinstance(state, Mapping), label, "the mapping state_dict returned", state)
        epoch, consumed = state.get("epoch"), state.get("consumed")
        if not (is_int(epoch, 0) and is_int(consumed, 0)):
            raise UsageError(
                f"{label} must hold non-negative ints 'epoch' and 'consumed' "
                f"(got {describe(dict(state))})."
            )
        self._choice()  # an epoch set before the position is restored gives way to it
        self.epoch, self._start, self._pass = epoch, consumed, None


def _seed_of(loader: DataLoader[Any]) -> int:
    for generator in (getattr(loader.sampler, "generator", None), loader.generator):
        if isinstance(generator, torch.Generator):
            return int(generator.initial_seed())
    return 0


def _permutes_the_dataset(sampler: object, size: int) -> bool | None:
    """Whether ``sampler`` is torch's plain shuffle (True) or plain order (False) of all ``size``.

    ``None`` for any other sampler (a subset, weights, replacement, a subclass, the user's
    own): what it yields must be dealt out as it is.
    """
    if type(sampler) is SequentialSampler:
        return False if len(sampler) == size else None
    if type(sampler) is RandomSampler and not sampler.replacement:
        return True if len(sampler) == size == len(sampler.data_source) else None
    return None


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
    # Its own generator, seeded per epoch by ShardedLoader: iterating never touches the global RNG.
    return DataLoader(loader.dataset, sampler=sampler, generator=torch.Generator(), **options)


def check_not_empty(loader: object) -> None:
    """Refuse a DataLoader over an empty map-style dataset: no rank would get a batch.

    Decided from the dataset alone, so every rank decides alike (none waits for another).

    Raises:
        UsageError: the dataset has no sample.
    """
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return
    try:
        size = len(loader.dataset)  # type: ignore[arg-type]  # map-style datasets have a length
    except TypeError:
        return  # a dataset without a length: nothing to tell
    if size == 0:
        raise UsageError(
            f"shard: the DataLoader's dataset ({type(loader.dataset).__name__}) is empty, so "
            "the loop would train on nothing; check where the data comes from."
        )


def shard_loader(loader: Iterable[T], ctx: Context) -> Iterable[T]:
    """Return this rank's share of ``loader``, a ``torch.utils.data.DataLoader``.

    Batches are dealt over ``ctx.data_parallel``: the whole world, or under
    tensor parallelism the world over the ``"tp"`` groups, whose ranks take the
    same batches.

    The user's choices carry over: shuffling (a ``RandomSampler``), its seed
    (the generator's initial seed, else 0), ``drop_last``, batch size, workers
    and collation.

    Any other sampler (``SubsetRandomSampler``, ``WeightedRandomSampler``, one
    with replacement, the user's own) is drawn at every epoch and what it
    yields is dealt out, so exactly its samples are used. Every rank draws the
    same indices: from a copy of it, told the epoch (``set_epoch``), whose
    ``generator`` and torch's global generator (forked) are seeded from the
    seed + epoch; epoch 0 is what a fresh sampler of that seed yields in one
    process. A sampler whose draws do not repeat (one drawing from Python's
    ``random`` or numpy unseeded) is refused, as the ranks could not agree.

    A loader whose sampler is already distributed is only wrapped so that its
    epoch advances (from the one it holds) unless the script sets it. A
    loader over an ``IterableDataset`` is kept as it is and
    strided by batch (`StreamStride`): every rank reads the whole stream, keeps
    every ``world_size``-th batch, and the incomplete last round (at most
    ``world_size - 1`` batches) goes to no rank; the epoch reaches the
    dataset's ``set_epoch`` where it has one.

    Raises:
        UsageError: ``loader`` is not a DataLoader or uses a custom
            ``batch_sampler``; the message
            says how to shard it by hand with ``ctx.rank`` and ``ctx.world_size``.
            Or its sampler yields different indices each time for one epoch.
            Or its dataset is empty (`check_not_empty`), or ``ctx`` is not a `Context`.
    """
    check_world(check_context(ctx, "shard"), "shard")
    if not isinstance(loader, DataLoader):
        hint = "; shard other iterables yourself, e.g. items[ctx.rank::ctx.world_size]"
        raise refusal("shard: 'loader'", "a torch DataLoader", loader, hint=hint)
    # The ranks of a tensor-parallel group hold parts of one model: they take the same batches.
    rank, world_size = ctx.data_parallel
    check_not_empty(loader)
    if isinstance(loader.sampler, (ShardSampler, DistributedSampler)):
        return ShardedLoader(loader=loader, sampler=loader.sampler, epoch=loader.sampler.epoch)
    if isinstance(loader.dataset, IterableDataset):
        stride = StreamStride(loader.dataset, rank=rank, world_size=world_size)
        return ShardedLoader(loader=loader, sampler=stride)
    if loader.batch_size is None:
        raise UsageError(
            "shard: the DataLoader uses a custom batch_sampler, which shard cannot split; "
            "give it a sampler per rank yourself (see stratagem.sharding.ShardSampler)."
        )
    size = len(loader.dataset)  # type: ignore[arg-type]  # map-style datasets have a length
    seed = _seed_of(loader)
    shuffle = _permutes_the_dataset(loader.sampler, size)
    source = None if shuffle is not None else loader.sampler
    if source is not None:
        size = len(_drawn_alike(source, seed, 0))
    sampler = ShardSampler(
        size=size,
        rank=rank,
        world_size=world_size,
        shuffle=bool(shuffle),
        seed=seed,
        drop_last=loader.drop_last,
        batch_size=loader.batch_size,
        source=source,
    )
    if sampler.size < world_size:
        what = "dataset has" if source is None else "sampler yields"
        raise UsageError(
            f"shard: the DataLoader's {what} {sampler.size} sample(s), fewer than the "
            f"{world_size} ranks, so some rank would have no batch while the others wait "
            "for it; use fewer ranks or more data."
        )
    return ShardedLoader(loader=_rebuild(loader, sampler), sampler=sampler)


def keep_loader(loader: Iterable[T], ctx: Context) -> Iterable[T]:
    """Shard field of a world of one: the whole loader is this rank's share.

    Raises:
        UsageError: ``loader`` is not iterable, is a DataLoader over an empty
            dataset (as on N ranks), or ``ctx`` is not a `Context`.
    """
    check_context(ctx, "shard")
    iterable = hasattr(loader, "__iter__") or hasattr(loader, "__getitem__")
    require(iterable, "shard: 'loader'", "iterable, e.g. a torch DataLoader", loader)
    check_not_empty(loader)
    return loader
