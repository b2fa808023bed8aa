"""The entries of a checkpoint's ``state``: what kind each is, and how it is saved and restored.

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
  ``name/<rank>``.

Which rank writes which entry is `stratagem.checkpoint.owners`' concern.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs
import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from stratagem.checkpoint import rng
from stratagem.checkpoint.owners import PerRank
from stratagem.checkpoint.safety import encode
from stratagem.errors import UsageError, describe

if TYPE_CHECKING:
    from stratagem.env import Context

__all__ = [
    "RNG_KEY",
    "Entry",
    "Kind",
    "classify",
    "leaf_paths",
    "saved_state",
    "tied_keys",
    "unwrap",
]

Kind = Literal["module", "optimizer", "object", "value", "per_rank_object", "per_rank_value"]
KINDS: tuple[Kind, ...] = (
    "module",
    "optimizer",
    "object",
    "value",
    "per_rank_object",
    "per_rank_value",
)
PER_RANK_KINDS: tuple[Kind, ...] = ("per_rank_object", "per_rank_value")
RNG_KEY = "_stratagem_rng"
_RESERVED = "_stratagem"
Path = tuple[str, ...]


def _is_compiled(module: torch.nn.Module) -> bool:
    # Importing torch._dynamo costs seconds; if nobody imported it, nothing is compiled.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


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
    if not isinstance(module, torch.nn.Module):
        raise UsageError(f"unwrap: 'module' must be a torch.nn.Module (got {describe(module)}).")
    while True:
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            module = cast(torch.nn.Module, module.module)
        elif _is_compiled(module):
            module = cast(torch.nn.Module, module._orig_mod)  # noqa: SLF001  # torch offers no other handle
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
    """

    name: str
    kind: Kind
    target: Any
    owner: torch.nn.Module | None = None


def _kind(value: object) -> Kind:
    if isinstance(value, PerRank):
        return "per_rank_object" if _kind(value.value) != "value" else "per_rank_value"
    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return "object"
    return "value"


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
        raise UsageError(
            f"{function}: 'state' must be a mapping with non-empty str keys "
            f"(got {describe(state)})."
        )
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
    modules = {k: settle(unwrap(v)) for k, v in state.items() if isinstance(v, torch.nn.Module)}
    entries = []
    for name, value in state.items():
        kind = _kind(value)
        if kind == "module":
            entries.append(Entry(name, kind, modules[name]))
        elif kind == "optimizer":
            entries.append(Entry(name, kind, value, _owner(name, value, modules)))
        elif kind in PER_RANK_KINDS:
            entries.append(Entry(name, kind, value.value))
        else:
            entries.append(Entry(name, kind, value))
    return entries


def live_state(entry: Entry) -> Any:
    """Return the DCP state dict of a module or optimizer entry (tensors alias the live ones)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if entry.kind == "module":
        return get_model_state_dict(entry.target)
    optimizer = cast(torch.optim.Optimizer, entry.target)
    fresh = not optimizer.state
    state = get_optimizer_state_dict(cast(torch.nn.Module, entry.owner), optimizer)
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
            saved[entry.name] = live_state(entry)
        elif entry.kind == "object":
            saved[entry.name] = encode(entry.target.state_dict(), f"the state of {entry.name!r}")
        elif entry.kind == "per_rank_object":
            what = f"rank {ctx.rank}'s state of {entry.name!r}"
            saved[entry.name] = {str(ctx.rank): encode(entry.target.state_dict(), what)}
        elif entry.kind == "per_rank_value":
            what = f"rank {ctx.rank}'s value {entry.name!r}"
            saved[entry.name] = {str(ctx.rank): encode(entry.target, what)}
        else:
            saved[entry.name] = encode(entry.target, f"the value {entry.name!r}")
    if with_rng:
        saved[RNG_KEY] = {str(ctx.rank): encode(rng.capture(ctx.device), "the RNG state")}
    return saved, ties


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
    for item in items:
        if isinstance(item, (Mapping, torch.Tensor)):
            return True
        if isinstance(item, list) and _holds_containers(item):
            return True
    return False
