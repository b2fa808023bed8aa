"""Match what ``state`` asks for against what a checkpoint holds, before anything is read.

Every difference is found from the metadata alone, so a strict load that does
not match fails before a single tensor of the live objects is touched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
import torch

from stratagem.checkpoint.entries import Entry, Kind, leaf_paths, live_state
from stratagem.checkpoint.layout import CheckpointError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import STORAGE_TYPES, Metadata

__all__ = ["Mismatch", "layout_of", "match"]

_SHOWN = 20  # keys listed per kind of difference; the rest are counted


def _listing(keys: tuple[str, ...]) -> str:
    shown = ", ".join(keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")


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
            f"  {label}: {_listing(keys)}"
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

    if isinstance(leaf, torch.Tensor):
        if not isinstance(item, TensorStorageMetadata):
            return "a value in the checkpoint, a tensor here"
        if tuple(item.size) != tuple(leaf.shape):
            return f"shape {tuple(item.size)} in the checkpoint, {tuple(leaf.shape)} here"
        return None
    if isinstance(item, TensorStorageMetadata):
        return "a tensor in the checkpoint, a value here"
    return None


def match(
    entries: list[Entry],
    saved_kinds: dict[str, Kind],
    layout: dict[str, dict[tuple[str, ...], STORAGE_TYPES]],
    ties: dict[str, dict[str, str]] | None = None,
) -> tuple[dict[str, Any], Mismatch]:
    """Return the state dicts to read modules and optimizers into, and the differences.

    Only entries present in both are in the returned state dicts; their
    tensors alias the live ones, so reading into them loads in place. Plain
    values in ``state`` are not compared: every saved one is returned. A
    module's key saved as an alias of another (``ties``, a tied weight) is
    read through that one: it is left out of the returned state dict.
    """
    templates: dict[str, Any] = {}
    missing: list[str] = []
    unexpected: list[str] = []
    differing: list[str] = []
    names = {entry.name for entry in entries}
    returned = ("value", "per_rank_value")  # load returns these, asked for or not
    unexpected += [n for n, k in saved_kinds.items() if k not in returned and n not in names]
    for entry in entries:
        kind = saved_kinds.get(entry.name)
        if kind is None:
            if entry.kind not in returned:
                missing.append(entry.name)
        elif kind != entry.kind:
            differing.append(
                f"{entry.name} ({_describe_kind(kind)} in the checkpoint, "
                f"{_describe_kind(entry.kind)} here)"
            )
        elif kind in ("module", "optimizer"):
            templates[entry.name] = live_state(entry)
            aliases = (ties or {}).get(entry.name, {}) if kind == "module" else {}
            for alias, original in aliases.items():
                if original in templates[entry.name]:
                    del templates[entry.name][alias]
            requested = dict(leaf_paths(templates[entry.name]))
            saved = layout.get(entry.name, {})
            missing += ["/".join((entry.name, *p)) for p in requested if p not in saved]
            unexpected += ["/".join((entry.name, *p)) for p in saved if p not in requested]
            for path in (p for p in requested if p in saved):
                why = _differs(requested[path], saved[path])
                if why is not None:
                    differing.append(f"{'/'.join((entry.name, *path))} ({why})")
    return templates, Mismatch(tuple(missing), tuple(sorted(unexpected)), tuple(differing))
