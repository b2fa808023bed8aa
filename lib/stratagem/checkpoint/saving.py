"""``save`` and ``load``: the record's checkpoint fields, on ``torch.distributed.checkpoint``.

A load matches what ``state`` asks for against what the checkpoint holds
before anything is read. Every difference is found from the metadata alone, so
a strict load that does not match fails before a single tensor of the live
objects is touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Container, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import attrs
import torch
import torch.distributed as dist

from stratagem import collectives
from stratagem.checkpoint import background, directory, undo
from stratagem.checkpoint.background import PendingSave
from stratagem.checkpoint.directory import Found, checked_path, decode, read_metadata, unreadable
from stratagem.checkpoint.entries import (
    KINDS,
    PER_RANK_KINDS,
    RNG_KEY,
    VALUE_KINDS,
    Entry,
    Kind,
    capture_rng,
    classify,
    leaf_paths,
    listing,
    live_state,
    refuse_differing_replicas,
    restore_rng,
    saved_state,
    what_stored,
    written_by_this_rank,
)
from stratagem.checkpoint.rank_zero import agree, on_main
from stratagem.env import Context, check_context, host_group
from stratagem.errors import CheckpointError, UsageError, error_line
from stratagem.parts import everyones, everyones_ties
from stratagem.validators import is_int, require

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata

__all__ = ["Mismatch", "layout_of", "load", "match", "opened", "save"]

logger = logging.getLogger("stratagem.checkpoint")


def _checked_call(
    function: str, path: object, ctx: Context, **flags: object
) -> tuple[Path, Context]:
    """Return the path and the world of a save or load, checked before any file is made."""
    ctx = collectives.check_world(check_context(ctx, function), function)
    collectives.expect_everyone(ctx, function)
    target = checked_path(path, function)
    for name, value in flags.items():
        require(isinstance(value, bool), f"{function}: '{name}'", "True or False", value)
    return target, ctx


def save(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    ctx: Context,
    *,
    keep_last: int | None = None,
    rng: bool = True,
    verify: bool = False,
    checksums: bool = False,
    blocking: bool = True,
) -> PendingSave | None:
    """Write ``state`` to the directory ``path``, atomically, on every rank of ``ctx``.

    Replicated entries (all but sharded tensors and `per_rank` entries) are
    written from rank 0, whole; each rank writes its own shards and per-rank
    entries (see `stratagem.checkpoint.entries`). Every rank writes into
    ``path.tmp-<token>`` beside ``path``; after a barrier rank 0 writes the
    manifest and renames the directory into place (see
    `stratagem.checkpoint.directory`). A save that fails or is killed leaves the
    previous checkpoint at ``path`` loadable and unchanged.

    Args:
        path: the checkpoint directory; the same on every rank (a shared filesystem).
        state: modules, optimizers, objects with ``state_dict``/``load_state_dict``
            and plain values, by name.
        ctx: the joined world; every rank must call ``save`` (a rank that
            finds others absent after ``ctx.arrivals.timeout`` seconds raises
            `CollectiveCallError` naming them).
        keep_last: after the save, keep only this many newest checkpoints in
            ``path``'s parent directory (``None``: keep all).
        rng: also record every rank's RNG states (Python, NumPy, torch).
        verify: first compare every replicated entry across ranks, and refuse
            to save (writing nothing) if any differs; the error lists them by
            key (``model/1.running_mean``). Costs one gather of fingerprints.
        checksums: record a CRC-32 of every file, which `load` checks, so that
            a changed bit is an error rather than a wrong weight. Each rank
            reads back the files it wrote: off by default, since that costs
            more than 5 % of a save here (``python -m benchmarks
            checkpoint_checksums``).
        blocking: ``False`` returns as soon as this rank's share of the state
            is copied to CPU memory and writes it in the background (see
            `stratagem.checkpoint.background`); the returned `PendingSave`'s
            ``wait()`` raises what a blocking save would have raised. One save
            is in flight at a time: the next save, and the teardown, wait for
            it first.

    Returns:
        ``None``, or the `PendingSave` when ``blocking`` is ``False``.

    Raises:
        UsageError: ``path``, ``state``, ``ctx``, ``keep_last``, ``rng``,
            ``verify`` or ``checksums`` is malformed, a plain value is not
            storable safely, or an optimizer's module is not in ``state``.
        CheckpointError: writing failed (a full disk says so), ``path`` exists
            and is not a checkpoint or is a symbolic link, another save to
            ``path`` is running, or (``verify``) replicated entries differ
            across ranks.
        CollectiveCallError: some ranks did not call ``save``.
    """
    flags = {"rng": rng, "verify": verify, "checksums": checksums, "blocking": blocking}
    target, ctx = _checked_call("save", path, ctx, **flags)
    ok = keep_last is None or is_int(keep_last, 1)
    require(ok, "save: 'keep_last'", "None or a positive int", keep_last)
    entries = classify(state, "save")
    background.unseen_failure(target)  # one save in flight: it ends (or raises) before this starts
    saved: dict[str, Any] = {}
    ties: dict[str, dict[str, str]] = {}
    error: Exception | None = None
    try:
        saved, ties = saved_state(entries, ctx, with_rng=rng)
    except UsageError as caught:
        error = caught
    settings = {"path": str(target), **flags, "keep_last": keep_last, "entries": sorted(state)}
    agree(ctx, error, settings, what="save")
    per_rank = {e.name for e in entries if e.kind in PER_RANK_KINDS} | ({RNG_KEY} if rng else set())
    if verify:
        # Plain values and objects by their values (their bytes also name each tensor's device).
        compared = {
            e.name: e.target.state_dict()
            if e.kind == "object"
            else e.target
            if e.kind == "value"
            else saved[e.name]
            for e in entries
            if e.name not in per_rank
        }
        references = {e.name: e.part.reference for e in entries if e.part is not None}
        refuse_differing_replicas(compared, ctx, references)
    from stratagem.checkpoint import dcp_files  # imports DCP (a second): only once it is needed

    parts = {e.name: e.part.writes for e in entries if e.part is not None}
    if parts:  # a tie inside a part held by another rank is known to that rank only
        ties = everyones_ties(ties, ctx)
    tmp = on_main(ctx, lambda: directory.begin(target))
    manifest = {
        "entries": {e.name: e.kind for e in entries},
        "tied": ties,
        "world_size": ctx.world_size,
        "rng": rng,
        # Optimizers of parts, keyed per parameter name (checkpoint.parts); load reads them so.
        "flat": sorted(e.name for e in entries if e.kind == "optimizer" and e.part is not None),
        "torch": torch.__version__,
    }
    files = written_by_this_rank(saved, per_rank, parts, ctx)
    if not blocking:
        return background.start(
            files, tmp, target, manifest, ctx, keep_last=keep_last, checksums=checksums
        )
    try:
        directory.stage_hook("writing")
        dcp_files.write(tmp, files, ctx)
        # Every rank has written its files. Not collectives.barrier: all ranks are known to be
        # here, and one writing a larger share may take longer than the arrival timeout.
        if checksums:
            manifest["checksums"] = dcp_files.checksums(tmp, ctx)  # its gather is the barrier
        elif ctx.group is not None and ctx.world_size > 1:
            dist.barrier(group=host_group(ctx))
        directory.stage_hook("written")
        on_main(ctx, lambda: directory.commit(tmp, target, manifest, keep_last))
    except BaseException as error:
        if ctx.is_main:
            directory.abandon(tmp, target)
        full = directory.disk_full(error, target)
        if full is not None:
            raise full from None
        raise
    return None


def _kinds(found: Found) -> dict[str, Kind]:
    entries = found.manifest.get("entries")  # its world_size was checked with the manifest
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and v in KINDS for k, v in entries.items()
    ):
        raise unreadable(found.directory, "its manifest does not list its entries")
    return entries


_OPEN_TRIES = 5


def _checked(found: Found) -> Metadata:
    """Check a pinned checkpoint's files and read its metadata safely (rank 0's part of a load)."""
    _kinds(found)
    directory.verify(found)
    metadata = read_metadata(found)
    layout_of(metadata)  # every item has a key path
    from stratagem.checkpoint.dcp_files import storage_problem, tensor_problem

    sizes = found.manifest["files"]
    problem = storage_problem(metadata, sizes) or tensor_problem(metadata, sizes)
    if problem is not None:
        raise unreadable(found.directory, problem)
    return metadata


@contextlib.contextmanager
def opened(target: Path, ctx: Context) -> Iterator[tuple[Found, Metadata]]:
    """Inside, every rank reads one and the same version of the checkpoint at ``target``.

    Rank 0 resolves ``target``, holds the version's files open and checks
    them; each other rank then holds the same version's files open. A save
    that commits meanwhile makes them try again (a few times), so a load never
    mixes the files of two versions.

    Raises:
        FileNotFoundError: there is no checkpoint at ``target``.
        CheckpointError: it is not a complete, unaltered checkpoint, or saves
            replaced it every time the ranks tried to open it.
    """
    for attempt in range(_OPEN_TRIES):
        with contextlib.ExitStack() as held:

            def first(last: bool = attempt == _OPEN_TRIES - 1) -> tuple[Found, Metadata] | None:
                try:
                    try:
                        found = held.enter_context(directory.pinned(target))
                    except FileNotFoundError:  # between a save's renames: the previous one aside
                        aside = directory.resolve(target).directory
                        found = held.enter_context(directory.pinned(aside))
                except (FileNotFoundError, CheckpointError):
                    if last:  # not a save's renames: the path holds no whole checkpoint
                        raise
                    # A save may have been between its renames, or removing what was found.
                    return None
                return found, _checked(found)

            main = on_main(ctx, first)
            mine = main[0] if main is not None and ctx.is_main else None
            if main is not None and not ctx.is_main:
                with contextlib.suppress(FileNotFoundError, CheckpointError):
                    pinned = held.enter_context(directory.pinned(main[0].directory))
                    mine = pinned if pinned.manifest == main[0].manifest else None
            missing = torch.tensor([int(mine is None)], device=ctx.device)
            everyone = int(collectives.reduce(missing, "max", ctx)) == 0
            if everyone and main is not None and mine is not None:
                yield mine, main[1]
                return
    raise CheckpointError(
        f"load: saves replaced the checkpoint at {os.fspath(target)!r} each of the "
        f"{_OPEN_TRIES} times the ranks opened it; load when saves to it pause."
    )


def blob_paths(
    kinds: dict[str, Kind], ranks: Container[int], metadata: Metadata
) -> set[tuple[str, ...]]:
    """Return the key paths of the values stored as bytes: plain values, objects' states, RNGs.

    Args:
        kinds: the checkpoint's entries.
        ranks: the ranks whose per-rank entries and RNG states to include.
        metadata: the checkpoint's metadata: the paths are picked from those it
            holds, never made for every rank of a (crafted) world of millions.
    """
    per_rank = {RNG_KEY, *(name for name, kind in kinds.items() if kind in PER_RANK_KINDS)}
    held = (tuple(map(str, p)) for p in metadata.planner_data.values() if isinstance(p, tuple))
    return {
        path
        for path in held
        if (len(path) == 1 and kinds.get(path[0]) in ("object", "value"))
        or (
            # A rank as written: ASCII digits, few of them (int() of a crafted 5,000 digits raises).
            len(path) == 2
            and path[0] in per_rank
            and path[1].isascii()
            and path[1].isdigit()
            and len(path[1]) <= 9
            and int(path[1]) in ranks
        )
    }


def decoded(stored: dict[tuple[str, ...], Any], path: tuple[str, ...], what: str) -> Any:
    """Return the value `dcp_files.read_values` read at ``path``, decoded safely.

    Raises:
        CheckpointError: it is not there, or it is not a plain value.
    """
    if path not in stored:
        raise CheckpointError(f"load: the checkpoint lists {what} but holds no data for it.")
    return decode(stored[path], what)


@attrs.frozen
class Mismatch:
    """Differences between a checkpoint and the ``state`` loaded from it.

    Keys read ``entry/key`` (``model/0.weight``, ``optim/state/0.weight/exp_avg``),
    or just ``entry`` for a whole entry.

    Attributes:
        missing: in ``state``, not in the checkpoint.
        unexpected: in the checkpoint, not in ``state``.
        differing: in both, but of another shape or kind; never loadable.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    differing: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.differing)

    def report(self) -> str:
        """Return one line per kind of difference."""
        parts = [
            f"  {label}: {listing(keys)}"
            for label, keys in (
                ("missing from the checkpoint", self.missing),
                ("in the checkpoint but not in state", self.unexpected),
                ("differing", self.differing),
            )
            if keys
        ]
        return "\n".join(parts)


def layout_of(metadata: Metadata) -> dict[str, dict[tuple[str, ...], STORAGE_TYPES]]:
    """Group the checkpoint's items by entry: ``{entry: {key path: storage metadata}}``.

    Raises:
        CheckpointError: the metadata lacks the key paths of its items.
    """
    layout: dict[str, dict[tuple[str, ...], STORAGE_TYPES]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        path = metadata.planner_data.get(fqn)
        if not isinstance(path, tuple) or not path:
            raise CheckpointError(
                f"load: the checkpoint's metadata gives no key path for {fqn!r}; it was not "
                "written by stratagem."
            )
        layout.setdefault(str(path[0]), {})[tuple(str(p) for p in path[1:])] = item
    return layout


def _describe_kind(kind: str) -> str:
    return {
        "module": "a module",
        "optimizer": "an optimizer",
        "object": "an object",
        "per_rank_object": "a per-rank object",
        "per_rank_value": "a per-rank value",
    }.get(kind, "a plain value")


def _differs(leaf: Any, item: STORAGE_TYPES) -> str | None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = "a tensor" if isinstance(item, TensorStorageMetadata) else "a value"
    here = "a tensor" if isinstance(leaf, torch.Tensor) else "a value"
    if saved != here:
        return f"{saved} in the checkpoint, {here} here"
    if isinstance(item, TensorStorageMetadata) and tuple(item.size) != tuple(leaf.shape):
        return f"shape {tuple(item.size)} in the checkpoint, {tuple(leaf.shape)} here"
    return None


def match(
    entries: list[Entry],
    saved_kinds: dict[str, Kind],
    layout: dict[str, dict[tuple[str, ...], STORAGE_TYPES]],
    ties: dict[str, dict[str, str]] | None = None,
    flat: frozenset[str] = frozenset(),
    ctx: Context | None = None,
) -> tuple[dict[str, Any], Mismatch]:
    """Return the state dicts to read modules and optimizers into, and the differences.

    Only entries present in both are in the returned state dicts; their
    tensors alias the live ones, so reading into them loads in place. Plain
    values in ``state`` are not compared: every saved one is returned. A
    module's key saved as an alias of another (``ties``, a tied weight) is
    read through that one: it is left out of the returned state dict. The
    optimizers named in ``flat`` were saved keyed per parameter name. A saved
    key of a part (see `stratagem.parts`) is unexpected only if no
    rank of ``ctx`` holds it: every rank must call ``match`` when parts are in
    ``entries``.
    """
    templates: dict[str, Any] = {}
    missing: list[str] = []
    differing: list[str] = []
    names = {entry.name for entry in entries}
    held_parts: set[str] = set()  # the keys this rank's parts hold
    unheld: list[str] = []  # saved keys of parts that this rank does not hold
    unexpected = [n for n, k in saved_kinds.items() if k not in VALUE_KINDS and n not in names]
    for entry in entries:
        kind = saved_kinds.get(entry.name)
        if kind is None:
            if entry.kind not in VALUE_KINDS:
                missing.append(entry.name)
        elif kind != entry.kind:
            differing.append(
                f"{entry.name} ({_describe_kind(kind)} in the checkpoint, "
                f"{_describe_kind(entry.kind)} here)"
            )
        elif kind in ("module", "optimizer"):
            templates[entry.name] = live_state(entry, flat=entry.name in flat)
            aliases = (ties or {}).get(entry.name, {}) if kind == "module" else {}
            for alias, original in aliases.items():
                if original in templates[entry.name]:
                    del templates[entry.name][alias]
            requested = dict(leaf_paths(templates[entry.name]))
            saved = layout.get(entry.name, {})
            missing += ["/".join((entry.name, *p)) for p in requested if p not in saved]
            if entry.part is not None:  # held by some rank: its own keys, or another part's
                held_parts |= {"/".join((entry.name, *p)) for p in requested}
                unheld += ["/".join((entry.name, *p)) for p in saved if p not in requested]
            else:
                unexpected += ["/".join((entry.name, *p)) for p in saved if p not in requested]
            for path in (p for p in requested if p in saved):
                why = _differs(requested[path], saved[path])
                if why is not None:
                    differing.append(f"{'/'.join((entry.name, *path))} ({why})")
    if any(entry.part is not None for entry in entries):
        held = everyones(held_parts, ctx) if ctx is not None else held_parts
        unexpected += [key for key in unheld if key not in held]
    return templates, Mismatch(tuple(missing), tuple(sorted(unexpected)), tuple(differing))


def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    ctx: Context,
    *,
    strict: bool = True,
    rng: bool = True,
) -> dict[str, Any]:
    """Restore ``state``'s objects in place from the checkpoint ``path``; return its plain values.

    Every rank must call it. Checkpoints load under any strategy: a module's
    shards are read into whatever sharding the live module has. RNG states and
    `per_rank` entries are restored rank by rank when the world size equals the
    saving one (a resumed run); at another size, a per-rank entry in ``state``
    is an error (``strict``) or left as it is (``strict=False``, logged).

    Args:
        path: a checkpoint directory that `save` wrote. If a save into it was
            interrupted between its two renames, the previous checkpoint is read.
        state: the objects to restore, by the names they were saved under.
            Plain values in it are ignored: every saved plain value is returned.
        ctx: the joined world.
        strict: raise if ``state`` and the checkpoint differ in entries or keys,
            or ``state`` has per-rank entries saved by a world of another size.
            With ``False``, what matches is loaded and the differences are
            logged on rank 0 (logger ``stratagem.checkpoint``, level WARNING).
        rng: restore this rank's RNG states, when the checkpoint has them.

    Returns:
        Every plain value saved, by name, and (in a world of the saving size)
        this rank's value of every per-rank value.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        CheckpointError: the checkpoint is truncated, tampered with or
            unreadable (nothing in it is unpickled without restriction), or it
            does not match ``state`` (the message lists the keys).
        UsageError: ``path``, ``state``, ``ctx``, ``strict`` or ``rng`` is malformed.
        CollectiveCallError: some ranks did not call ``load`` within
            ``ctx.arrivals.timeout`` seconds.
    """
    target, ctx = _checked_call("load", path, ctx, strict=strict, rng=rng)
    entries = classify(state, "load")
    with opened(target, ctx) as (found, metadata):
        return _load(found, metadata, entries, ctx, strict=strict, rng=rng)


def _load(
    found: Found,
    metadata: Metadata,
    entries: list[Entry],
    ctx: Context,
    *,
    strict: bool,
    rng: bool,
) -> dict[str, Any]:
    kinds = _kinds(found)
    saved_world = found.manifest["world_size"]
    from stratagem.checkpoint import dcp_files

    # Every value is read and vetted before any live tensor is written.
    same_world = saved_world == ctx.world_size
    own = [ctx.rank] if same_world else []
    stored = dcp_files.read_values(found, metadata, blob_paths(kinds, own, metadata), ctx)
    mine = str(ctx.rank)

    def decoded_all(kind: Kind) -> dict[str, Any]:
        """Decode the saved entries of ``kind``: every value, the states of objects in state."""
        under = (mine,) if kind in PER_RANK_KINDS else ()  # a per-rank entry's key: name/rank
        names = kinds if kind in VALUE_KINDS else [e.name for e in entries if e.kind == kind]
        return {
            n: decoded(stored, (n, *under), what_stored(kind, n, ctx.rank))
            for n in names
            if kinds.get(n) == kind
        }

    values, objects = decoded_all("value"), decoded_all("object")
    # This rank's own values may be unreadable on this rank alone: every rank must hear of it.
    rank_error: CheckpointError | None = None
    rng_saved = None
    try:
        if same_world:
            values |= decoded_all("per_rank_value")
            objects |= decoded_all("per_rank_object")
        own_rng = (RNG_KEY, mine)
        if rng and same_world and own_rng in stored:
            rng_saved = decode(stored[own_rng], "the RNG state")
            tried_rng(rng_saved, ctx.device, int(mine))
    except CheckpointError as error:
        rank_error = error
    ties, flat = _ties_and_flat(found)
    templates, mismatch = match(entries, kinds, layout_of(metadata), ties, flat, ctx)
    stranded = [] if same_world else _stranded(entries, kinds)
    agree(
        ctx,
        rank_error
        or _refusal(found, mismatch, strict)
        or _world_refusal(stranded, saved_world, ctx, strict),
    )
    if (mismatch or stranded) and ctx.is_main:
        logger.warning(
            "load: %s differs from state (strict=False):\n%s",
            found.directory,
            "\n".join(
                [mismatch.report()] * bool(mismatch)
                + [f"  per-rank, saved by {saved_world} ranks, left as they are: {stranded}"]
                * bool(stranded)
            ),
        )
    kept = undo.keep(entries, templates, objects)  # put back if a live object refuses its state
    failure: CheckpointError | None = None
    if templates:
        try:
            dcp_files.read(found, metadata, templates, ctx, partial=not strict)
        except CheckpointError as error:  # DCP raises it on every rank
            _put_back(kept, error)
    _retie(entries, templates, ties)
    try:
        _apply(entries, templates, objects, strict, flat)
    except CheckpointError as error:  # this rank's alone: every rank must hear of it
        failure = error
    try:
        agree(ctx, failure)
    except CheckpointError as error:
        _put_back(kept, error)
    if rng_saved is not None:
        restore_rng(rng_saved, ctx.device)
    return values


def _put_back(kept: undo.Kept, error: CheckpointError) -> NoReturn:
    """Restore the live objects as they were before the load, and raise ``error`` saying so."""
    refused = undo.put_back(kept)
    told = "Every object in 'state' was left as it was."
    if refused:
        names = ", ".join(map(repr, refused))
        told = f"The others were left as they were; {names} refused its old state too: rebuild it."
    raise CheckpointError(f"{str(error).rstrip('.')}. {told}") from None


def tried_rng(state: Any, device: torch.device, rank: int) -> None:
    """Check that ``state`` restores this process's generators, and leave them as they were.

    Setting them is the one complete check of a state's format (Python's,
    NumPy's and torch's each have their own); it is done, then undone, before
    a load touches any live object.

    Raises:
        CheckpointError: the state is malformed (the generators are unchanged).
    """
    kept = capture_rng(device)
    try:
        restore_rng(state, device)
    except Exception as error:  # whatever each generator's setter refuses
        raise CheckpointError(
            f"load: rank {rank}'s RNG state in the checkpoint is malformed "
            f"({error_line(error)}); nothing was loaded. Pass rng=False to load "
            "the rest and keep this run's RNG states."
        ) from None
    finally:
        restore_rng(kept, device)


def _ties_and_flat(found: Found) -> tuple[dict[str, dict[str, str]], frozenset[str]]:
    """Return the manifest's tied keys and its optimizers keyed per parameter name.

    Tied keys read ``{module: {alias: original}}``; checkpoints saved before
    either was recorded have none.
    """
    ties, flat = found.manifest.get("tied", {}), found.manifest.get("flat", [])
    if not isinstance(ties, dict) or not all(
        isinstance(aliases, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())
        for aliases in ties.values()
    ):
        raise unreadable(found.directory, "its manifest's 'tied' entry is malformed")
    if not isinstance(flat, list) or not all(isinstance(name, str) for name in flat):
        raise unreadable(found.directory, "its manifest's 'flat' entry is malformed")
    return ties, frozenset(flat)


def _retie(
    entries: list[Entry], templates: dict[str, Any], ties: dict[str, dict[str, str]]
) -> None:
    """Give each alias of a tied tensor its original's value (a live tie holds it already)."""
    for entry in entries:
        aliases, template = ties.get(entry.name), templates.get(entry.name)
        if entry.kind == "module" and aliases and isinstance(template, dict):
            live = entry.target.state_dict(keep_vars=True).keys()
            for alias, original in aliases.items():
                if alias in live and original in template:
                    template[alias] = template[original]


def _stranded(entries: list[Entry], kinds: dict[str, Kind]) -> list[str]:
    """Return the per-rank entries of ``state`` that the checkpoint holds per rank."""
    return [e.name for e in entries if e.kind in PER_RANK_KINDS and kinds.get(e.name) == e.kind]


def _world_refusal(
    stranded: list[str], saved_world: int, ctx: Context, strict: bool
) -> CheckpointError | None:
    if not stranded or not strict:
        return None
    names = ", ".join(map(repr, stranded))
    return CheckpointError(
        f"load: {names} was saved per rank by a world of {saved_world}, and this world has "
        f"{ctx.world_size} rank(s): there is no rank-by-rank match. Load at world size "
        f"{saved_world}, drop per-rank entries from state (RNG states are skipped the same "
        "way), or pass strict=False to load the rest and leave them as they are."
    )


def _refusal(found: Found, mismatch: Mismatch, strict: bool) -> CheckpointError | None:
    if mismatch.differing or (strict and mismatch):
        fix = "Load into objects of the saved structure"
        if not mismatch.differing:
            fix += ", or pass strict=False to load what matches"
        return CheckpointError(
            f"load: the checkpoint at {str(found.directory)!r} does not match 'state':\n"
            f"{mismatch.report()}\n{fix}."
        )
    return None


def _apply(
    entries: list[Entry],
    templates: dict[str, Any],
    objects: dict[str, Any],
    strict: bool,
    flat: frozenset[str],
) -> None:
    """Hand each entry its state; raise naming the first entry whose object refuses it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    for entry in entries:
        state = templates.get(entry.name)
        try:
            if state is not None and entry.kind == "module":
                set_model_state_dict(entry.target, state, options=StateDictOptions(strict=strict))
            elif state is not None and entry.kind == "optimizer":
                owner = cast(torch.nn.Module, entry.owner)  # classify found it for every optimizer
                flattened = entry.name in flat
                options = StateDictOptions(flatten_optimizer_state_dict=flattened)
                with _without_grads(entry.target) if flattened else contextlib.nullcontext():
                    set_optimizer_state_dict(owner, entry.target, state, options=options)
            elif entry.name in objects:  # an object's state, replicated or this rank's
                entry.target.load_state_dict(objects[entry.name])
        except Exception as error:  # whatever the object's own load_state_dict raises
            raise CheckpointError(
                f"load: {entry.name!r} refused its saved state ({error_line(error)}). "
                f"Build {entry.name!r} as it was when saved, or leave it out of "
                "'state' and pass strict=False to load the rest."
            ) from None


@contextlib.contextmanager
def _without_grads(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Hide the gradients of an optimizer that never stepped, while its flat state is set.

    DCP unflattens a state by the slots of the live optimizer, creating them by
    a step with zero gradients, which it skips when any parameter has a
    gradient: the slots would then be silently left out.
    """
    hidden = (
        {}
        if optimizer.state
        else {p: p.grad for group in optimizer.param_groups for p in group["params"]}
    )
    for parameter in hidden:
        parameter.grad = None
    try:
        yield
    finally:
        for parameter, grad in hidden.items():
            parameter.grad = grad
