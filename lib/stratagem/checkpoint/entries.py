"""The entries of a checkpoint's ``state``: what kind each is, and how it is saved and restored.

- a module is saved with ``get_model_state_dict`` of the plain module, so the
  keys are those of the unwrapped module whatever wrapper (DDP, DataParallel,
  ``torch.compile``) or sharding (FSDP2) surrounds it;
- an optimizer with ``get_optimizer_state_dict``, keyed by parameter name; it
  needs the module whose parameters it updates, so that module must be in
  ``state`` too;
- any other object with ``state_dict``/``load_state_dict`` (a scheduler, a
  ``GradScaler``, a `ShardedLoader`) and every plain value is stored whole as
  ``torch.save`` bytes, read back with ``weights_only=True``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, cast

import attrs
import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from stratagem.checkpoint import rng
from stratagem.checkpoint.safety import encode
from stratagem.errors import UsageError, describe

if TYPE_CHECKING:
    from stratagem.env import Context

__all__ = ["RNG_KEY", "Entry", "Kind", "classify", "leaf_paths", "saved_state", "unwrap"]

Kind = Literal["module", "optimizer", "object", "value"]
KINDS: tuple[Kind, ...] = ("module", "optimizer", "object", "value")
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
    raise UsageError(
        f"'state' holds the optimizer {name!r} but not the module whose parameters it updates "
        f"(modules in state: {sorted(modules) or 'none'}); add that module to state: optimizer "
        "state is saved by parameter name, which only the module knows."
    )


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
    modules = {k: unwrap(v) for k, v in state.items() if isinstance(v, torch.nn.Module)}
    entries = []
    for name, value in state.items():
        kind = _kind(value)
        if kind == "module":
            entries.append(Entry(name, kind, modules[name]))
        elif kind == "optimizer":
            entries.append(Entry(name, kind, value, _owner(name, value, modules)))
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


def saved_state(entries: list[Entry], ctx: Context, *, with_rng: bool) -> dict[str, Any]:
    """Return the state dict DCP writes for ``entries`` (and this rank's RNG state).

    Raises:
        UsageError: a plain value or an object's state is not storable safely.
    """
    saved: dict[str, Any] = {}
    for entry in entries:
        if entry.kind in ("module", "optimizer"):
            saved[entry.name] = live_state(entry)
        elif entry.kind == "object":
            saved[entry.name] = encode(entry.target.state_dict(), f"the state of {entry.name!r}")
        else:
            saved[entry.name] = encode(entry.target, f"the value {entry.name!r}")
    if with_rng:
        saved[RNG_KEY] = {str(ctx.rank): encode(rng.capture(ctx.device), "the RNG state")}
    return saved


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
