"""The entries of a checkpoint's ``state``: what kind each is, who writes it, how it is stored.

- a module is saved with ``get_model_state_dict`` of the plain module, so the
  keys are those of the unwrapped module whatever wrapper (DDP, DataParallel,
  ``torch.compile``) or sharding (FSDP2) surrounds it;
- an optimizer with ``get_optimizer_state_dict``, keyed by parameter name; it
  needs the module whose parameters it updates, so that module must be in
  ``state`` too;
- any other object with ``state_dict``/``load_state_dict`` (a scheduler, a
  ``GradScaler``, a `ShardedLoader`) and every plain value is stored whole as
  ``torch.save`` bytes, read back with ``weights_only=True``;
- an entry marked with `per_rank` is stored the same way, once per rank, under
  ``name/<rank>``;
- the random generators a resumed run must continue (Python's, NumPy's,
  torch's) are stored per rank under `RNG_KEY`.

Who owns each entry, and so which rank writes it:

- **replicated** (every entry not marked otherwise): the same on every rank by
  promise; rank 0's copy is written, whole, for every entry and every key, so a
  checkpoint never mixes ranks. ``save(..., verify=True)`` checks the promise.
- **sharded** (DTensor leaves, as ``fsdp()`` makes them): each rank writes its
  own shard (a shard replicated over a mesh dimension, by the lowest such rank).
- **per rank** (entries marked with `per_rank`): each rank writes its own, and
  on load each rank gets back its own: data positions, an already-fetched batch.

- **parts** (a module a wrap marked with `stratagem.parts.hold_part`,
  as ``pipeline()``'s stages are, and its optimizer): each part is written by
  the rank its mark names, the optimizer's state flattened per parameter name.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import attrs
import numpy as np
import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from stratagem.checkpoint.directory import encode
from stratagem.errors import CheckpointError, UsageError
from stratagem.parts import Part, part_of
from stratagem.training import original_module
from stratagem.validators import refusal, require

if TYPE_CHECKING:
    from stratagem.env import Context

__all__ = [
    "RNG_KEY",
    "Entry",
    "Kind",
    "PerRank",
    "capture_rng",
    "classify",
    "leaf_paths",
    "listing",
    "per_rank",
    "refuse_differing_replicas",
    "restore_rng",
    "saved_state",
    "tied_keys",
    "unwrap",
    "what_stored",
    "written_by_this_rank",
]

RNG_KEY = "_stratagem_rng"
_RESERVED = "_stratagem"
Path = tuple[str, ...]
Kind = Literal["module", "optimizer", "object", "value", "per_rank_object", "per_rank_value"]
KINDS: tuple[Kind, ...] = get_args(Kind)
PER_RANK_KINDS: tuple[Kind, ...] = ("per_rank_object", "per_rank_value")
VALUE_KINDS: tuple[Kind, ...] = ("value", "per_rank_value")  # load returns them, asked for or not
_OBJECT_KINDS: tuple[Kind, ...] = ("object", "per_rank_object")


@attrs.frozen
class PerRank:
    """An entry of ``state`` that each rank saves and restores for itself; see `per_rank`."""

    value: Any


def per_rank(value: Any) -> PerRank:
    """Mark an entry of a checkpoint's ``state`` as per-rank: each rank saves and loads its own.

    Without the mark an entry is replicated and saved from rank 0 only. Mark
    what differs by design across ranks: a data position, a generator, an
    already-fetched batch. An object with ``state_dict``/``load_state_dict`` is
    restored in place; any other value comes back in the dict `load` returns.
    Per-rank entries load only into a world of the saving size (see
    docs/checkpoints.md).

    Example:
        >>> import torch, stratagem as sg
        >>> state = {"batch": sg.per_rank(torch.zeros(2)), "step": 3}
        >>> state["batch"]
        PerRank(value=tensor([0., 0.]))
    """
    return value if isinstance(value, PerRank) else PerRank(value)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Return the plain module inside DDP, DataParallel and ``torch.compile`` wrappers.

    Raises:
        UsageError: ``module`` is not a ``torch.nn.Module``.

    Example:
        >>> import torch, stratagem as sg
        >>> plain = torch.nn.Linear(2, 2)
        >>> sg.unwrap(torch.nn.DataParallel(plain)) is plain
        True
    """
    require(isinstance(module, torch.nn.Module), "unwrap: 'module'", "a torch.nn.Module", module)
    while True:
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            module = cast(torch.nn.Module, module.module)
        elif (inner := original_module(module)) is not module:
            module = inner
        else:
            return module


@attrs.frozen
class Entry:
    """One named entry of ``state``.

    Attributes:
        name: its key in ``state``.
        kind: ``"module"``, ``"optimizer"``, ``"object"`` or ``"value"``.
        target: the plain (unwrapped) module, the optimizer, the object or the value.
        owner: for an optimizer, the plain module whose parameters it updates.
        part: for a module split over ranks (and its optimizer), how this
            rank's part of it is saved; None for the whole of one.
    """

    name: str
    kind: Kind
    target: Any
    owner: torch.nn.Module | None = None
    part: Part | None = None


def _kind(value: object) -> Kind:
    if isinstance(value, PerRank):
        return "per_rank_object" if _kind(value.value) != "value" else "per_rank_value"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    stateful = all(callable(getattr(value, m, None)) for m in ("state_dict", "load_state_dict"))
    return "object" if stateful else "value"


def _owner(
    name: str, optimizer: torch.optim.Optimizer, modules: dict[str, torch.nn.Module]
) -> torch.nn.Module:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    if not modules:
        raise UsageError(
            f"'state' holds the optimizer {name!r} but not the module whose parameters it "
            "updates; add that module to state: optimizer state is saved by parameter name, "
            "which only the module knows."
        )
    raise UsageError(
        f"the optimizer {name!r} updates parameters that none of the modules in state "
        f"({sorted(modules)}) holds; add the module it was built from (the one wrap "
        "returned), or rebuild the optimizer from that module's parameters."
    )


def settle(module: torch.nn.Module) -> torch.nn.Module:
    """Return ``module`` with every FSDP group resharded, as ``wrap`` left it.

    A forward with no backward after it (an evaluation, under ``no_grad`` or
    not) leaves an FSDP root's parameters unsharded; state is read from the
    sharded ones, which the optimizer holds.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")  # sharded modules mean it is imported
    if fsdp is not None:
        for part in module.modules():
            if isinstance(part, fsdp.FSDPModule):
                part.reshard()
    return module


def classify(state: object, function: str) -> list[Entry]:
    """Return the entries of ``state``, each with its kind.

    Raises:
        UsageError: ``state`` is not a mapping with str keys, a key is reserved
            (starts with ``_stratagem``), or an optimizer's module is missing.
    """
    if not isinstance(state, Mapping) or not all(isinstance(k, str) and k for k in state):
        raise refusal(f"{function}: 'state'", "a mapping with non-empty str keys", state)
    reserved = sorted(k for k in state if k.startswith(_RESERVED))
    if reserved:
        raise UsageError(
            f"{function}: keys starting with {_RESERVED!r} are reserved (got {reserved})."
        )
    per_rank = [k for k, v in state.items() if isinstance(v, PerRank)]
    clashes = sorted(k for k in state for name in per_rank if k.startswith(f"{name}."))
    if clashes:
        raise UsageError(
            f"{function}: entries {clashes} would collide with the per-rank entries stored "
            f"under '<name>.<rank>' ({per_rank}); rename them, e.g. with '_' for '.'."
        )
    _refuse_colliding(state, function)
    modules = {k: settle(unwrap(v)) for k, v in state.items() if isinstance(v, torch.nn.Module)}
    entries = []
    for name, value in state.items():
        kind = _kind(value)
        if kind == "module":
            entries.append(Entry(name, kind, modules[name], part=part_of(modules[name])))
        elif kind == "optimizer":
            owner = _owner(name, value, modules)
            entries.append(Entry(name, kind, value, owner, part=part_of(owner)))
        else:  # an object or a value, replicated or marked per rank
            entries.append(Entry(name, kind, value.value if isinstance(value, PerRank) else value))
    return entries


def _refuse_colliding(state: Mapping[str, Any], function: str) -> None:
    r"""Refuse names DCP would mix up, and (to save) names that read as file paths.

    DCP joins an entry's name and its keys with dots, so ``"model"`` (whose key
    ``weight`` becomes ``model.weight``) and ``"model.weight"`` name one item.
    A ``/`` or ``\`` in a name reads as a path (``../x``, ``/etc/passwd``) and,
    in what ``describe`` shows, as another entry's key.

    Raises:
        UsageError: two names collide, or a name to save holds a path separator.
    """
    names = sorted(state)
    for second in names:
        parts = second.split(".")
        for first in (".".join(parts[:end]) for end in range(1, len(parts))):
            if first in state:
                raise UsageError(
                    f"{function}: the entries {first!r} and {second!r} collide: DCP stores "
                    f"the keys of {first!r} as '{first}.<key>', so both name one item; "
                    "rename one of them (e.g. with '_' for '.')."
                )
    if function == "save":
        for name in names:
            if "/" in name or "\\" in name:
                raise UsageError(
                    f"save: the entry name {name!r} holds a path separator, which reads as a "
                    "file path, or as another entry's key where a checkpoint is described; "
                    "rename it (e.g. with '_' for '/')."
                )


def live_state(entry: Entry, *, flat: bool = False) -> Any:
    """Return the DCP state dict of a module or optimizer entry (tensors alias the live ones).

    With ``flat``, an optimizer's state is keyed per parameter name (see
    `stratagem.parts`).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if entry.kind == "module":
        return get_model_state_dict(entry.target)
    optimizer = cast(torch.optim.Optimizer, entry.target)
    fresh = not optimizer.state
    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    state = get_optimizer_state_dict(cast(torch.nn.Module, entry.owner), optimizer, options=options)
    if fresh:
        # DCP fills an optimizer that never stepped by stepping it with lr 0; undo that,
        # so that saving leaves a run exactly as it was.
        optimizer.state.clear()
    return state


def _place(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard
    if local.is_meta:
        return None  # no storage: every meta tensor would look like every other
    try:
        address = local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a subclass without a readable storage
        return None
    return (
        local.device,
        address,
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
    )


def tied_keys(state: Mapping[str, Any]) -> dict[str, str]:
    """Return ``{alias: original}`` for the keys of a module's state that share a tensor.

    A tied embedding and output weight appear under both names; the first
    name (in the module's order) is the one stored.
    """
    first: dict[tuple[Any, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, value in state.items():
        place = _place(value) if isinstance(value, torch.Tensor) and value.numel() > 0 else None
        if place is not None:
            if place in first:
                aliases[key] = first[place]
            else:
                first[place] = key
    return aliases


def saved_state(
    entries: list[Entry], ctx: Context, *, with_rng: bool
) -> tuple[dict[str, Any], dict[str, dict[str, str]]]:
    """Return the state dict DCP writes for ``entries`` (and this rank's RNG state).

    Returns:
        The state dict, and for each module with tied tensors ``{alias: original}``:
        an alias is stored once, under its original key.

    Raises:
        UsageError: a plain value or an object's state is not storable safely.
    """
    saved: dict[str, Any] = {}
    ties: dict[str, dict[str, str]] = {}
    for entry in entries:
        if entry.kind == "module":
            state = live_state(entry)
            aliases = tied_keys(state)
            if aliases:
                ties[entry.name] = aliases
            saved[entry.name] = {k: v for k, v in state.items() if k not in aliases}
        elif entry.kind == "optimizer":
            saved[entry.name] = live_state(entry, flat=entry.part is not None)
        else:  # stored as bytes: an object's state or a value, replicated or this rank's
            value = entry.target.state_dict() if entry.kind in _OBJECT_KINDS else entry.target
            blob = encode(value, what_stored(entry.kind, entry.name, ctx.rank))
            saved[entry.name] = {str(ctx.rank): blob} if entry.kind in PER_RANK_KINDS else blob
    if with_rng:
        saved[RNG_KEY] = {str(ctx.rank): encode(capture_rng(ctx.device), "the RNG state")}
    return saved, ties


def what_stored(kind: Kind, name: str, rank: int) -> str:
    """Return how messages name an entry stored as bytes (``rank 1's state of 'data'``)."""
    what = f"state of {name!r}" if kind in _OBJECT_KINDS else f"value {name!r}"
    return f"rank {rank}'s {what}" if kind in PER_RANK_KINDS else f"the {what}"


def leaf_paths(tree: Any, prefix: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Yield ``(path, leaf)`` for a state dict, with keys as DCP flattens them.

    DCP's rule (``traverse_state_dict``): mappings are entered; a list is
    entered only if it holds tensors or mappings; anything else is a leaf.
    """
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from leaf_paths(value, (*prefix, str(key)))
    elif isinstance(tree, list) and _holds_containers(tree):
        for index, value in enumerate(tree):
            yield from leaf_paths(value, (*prefix, str(index)))
    else:
        yield prefix, tree


def _holds_containers(items: list[Any]) -> bool:
    return any(
        isinstance(item, (Mapping, torch.Tensor))
        or (isinstance(item, list) and _holds_containers(item))
        for item in items
    )


def _is_sharded(leaf: object) -> bool:
    # DTensor leaves mean torch.distributed.tensor is imported; otherwise there are none.
    tensor_module = sys.modules.get("torch.distributed.tensor")
    return tensor_module is not None and isinstance(leaf, tensor_module.DTensor)


def _sharded_part(tree: Any) -> Any:
    """Return the part of ``tree`` made of sharded leaves, or None if it holds none."""
    if isinstance(tree, Mapping):
        kept = {key: _sharded_part(value) for key, value in tree.items()}
        kept = {key: value for key, value in kept.items() if value is not None}
        return kept or None
    if isinstance(tree, list):
        # A list's items are keyed by index: dropping some would renumber the rest, so a
        # list with a shard in it stays whole (DCP then saves its copies from the lowest rank).
        return tree if any(_sharded_part(item) is not None for item in tree) else None
    return tree if _is_sharded(tree) else None


def written_by_this_rank(
    saved: dict[str, Any], per_rank_names: set[str], parts: Mapping[str, bool], ctx: Context
) -> Any:
    """Return the part of ``saved`` this rank writes.

    Rank 0 writes every replicated entry, each rank its shards and per-rank
    entries, and a module split over ranks (``parts``: entry name to whether
    this rank writes its part) comes from the writer of each part.
    """
    written = {}
    for name, value in saved.items():
        if name in parts:
            part = value if parts[name] else None
        elif ctx.rank == 0 or name in per_rank_names:
            part = value
        else:
            part = _sharded_part(value)
        if part is not None:
            written[name] = part
    return written


def _fingerprint(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        data = leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        return f"{leaf.dtype}{tuple(leaf.shape)}:{hashlib.blake2b(data.tobytes()).hexdigest()}"
    return repr(leaf)


def _fingerprints(tree: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            _fingerprints(value, f"{prefix}/{key}", out)
    elif isinstance(tree, (list, tuple)) and not _is_sharded(tree):
        for index, value in enumerate(tree):
            _fingerprints(value, f"{prefix}/{index}", out)
    elif not _is_sharded(tree):
        out[prefix] = _fingerprint(tree)


_SHOWN = 20  # keys listed in a message; the rest are counted


def listing(keys: Sequence[str], *, shown: int = _SHOWN) -> str:
    """Return ``keys`` joined by commas: the first ``shown`` of them, and how many more."""
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return ", ".join(keys[:shown]) + more


def refuse_differing_replicas(
    replicated: dict[str, Any], ctx: Context, parts: Mapping[str, int]
) -> None:
    """Compare the replicated entries of every rank; refuse a verified save where any differ.

    Args:
        replicated: this rank's replicated entries by name, as values (module and
            optimizer state dicts, objects' states, plain values).
        ctx: the joined world; every rank must call it (it gathers the
            fingerprints: every replicated tensor is hashed on every rank).
        parts: the entries of ``replicated`` that are parts of a module split
            over ranks, each with the rank whose copy of this rank's part is
            written: a part is compared with that rank's, the rest with rank 0's.

    Raises:
        CheckpointError: some rank's copy differs; the message lists the keys
            and the ranks that differ.
    """
    mine: dict[str, str] = {}
    for name in sorted(replicated):
        _fingerprints(replicated[name], f"/{name}", mine)
    if ctx.group is None or ctx.world_size == 1:
        return
    import torch.distributed as dist

    from stratagem.env import host_group

    everyone: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(everyone, (mine, dict(parts)), group=host_group(ctx))
    differing: dict[tuple[str, int], list[int]] = {}
    for rank, (theirs, their_parts) in enumerate(everyone):
        references = {0, *their_parts.values()}
        for path in sorted(set(theirs).union(*(everyone[r][0] for r in references))):
            name = path[1:].split("/")[0]
            reference = their_parts.get(name, 0)
            if rank != reference and everyone[reference][0].get(path) != theirs.get(path):
                differing.setdefault((path[1:], reference), []).append(rank)
    described = [
        f"{key} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"differ{'' if len(ranks) > 1 else 's'} from rank {reference})"
        for (key, reference), ranks in differing.items()
    ]
    if differing:
        raise CheckpointError(
            f"save(verify=True): {len(differing)} replicated entries differ across ranks: "
            f"{listing(described)}. Nothing was written. Only rank 0's copy of a "
            "replicated entry is saved; make the ranks agree (e.g. broadcast from rank 0), or "
            "mark state that differs by design with sg.per_rank(...)."
        )


def capture_rng(device: torch.device) -> dict[str, Any]:
    """Return the state of this process's global generators, as values ``weights_only`` reads back.

    Covers ``random``, NumPy's global generator, torch's CPU generator and,
    on a CUDA device, that device's generator.
    """
    version, python_state, gauss = random.getstate()
    legacy = cast(tuple[str, Any, int, int, float], np.random.get_state(legacy=True))
    kind, keys, position, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": (version, torch.tensor(python_state, dtype=torch.int64), gauss),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Set this process's global generators to a state `capture_rng` returned."""
    version, python_state, gauss = state["python"]
    random.setstate((version, tuple(python_state.tolist()), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
