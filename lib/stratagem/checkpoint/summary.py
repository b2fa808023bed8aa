"""`describe`: what a checkpoint holds, read without a model and without running code from it."""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.checkpoint.directory import checked_path
from stratagem.checkpoint.entries import RNG_KEY, Kind
from stratagem.checkpoint.saving import blob_paths, decoded, layout_of, opened
from stratagem.env import Context, Env
from stratagem.trees import map_tensors

__all__ = ["Description", "TensorInfo", "describe"]


@attrs.frozen
class TensorInfo:
    """The shape and dtype of a saved tensor (its whole, unsharded shape)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@attrs.frozen
class Description:
    """What a checkpoint holds.

    Keys read ``entry/key``: ``model/0.weight``, ``optim/param_groups/0/lr``.

    Attributes:
        path: the directory read (a previous version if a save into ``path`` was interrupted).
        saved_at: when the save committed (UTC).
        world_size: the number of ranks that saved it.
        entries: each entry's kind (``module``, ``optimizer``, ``object``, ``value``).
        tensors: each saved tensor's shape and dtype (not read).
        values: plain values, objects' states and other non-tensor items, read safely.
        rng_ranks: the ranks whose RNG states it holds.
    """

    path: Path
    saved_at: datetime.datetime
    world_size: int
    entries: Mapping[str, Kind]
    tensors: Mapping[str, TensorInfo]
    values: Mapping[str, Any]
    rng_ranks: tuple[int, ...]

    def __str__(self) -> str:
        """Render entries and their keys sorted, each tensor or value as a one-line summary."""
        lines = [
            f"{self.path}",
            f"  saved {self.saved_at:%Y-%m-%d %H:%M:%S} UTC by {self.world_size} rank(s); "
            f"RNG states of ranks {list(self.rng_ranks)}",
        ]
        owners = _owners(self.entries, [*self.tensors, *self.values])
        for name in sorted(self.entries, key=_natural):
            lines.append(f"  {_name(name)} ({self.entries[name]})")
            prefix = f"{name}/"
            shown = {
                k[len(prefix) :]: f": {v}" for k, v in self.tensors.items() if owners.get(k) == name
            }
            for key, value in self.values.items():
                if owners.get(key) == name and key not in self.entries:  # not an entry's own
                    shown.update(_value_lines(key[len(prefix) :], value))
            if name in self.values:
                shown.update(_value_lines("", self.values[name]))
            lines += [f"    {key}{shown[key]}" for key in sorted(shown, key=_natural)]
        return "\n".join(lines)


_WIDTH = 60  # characters of a value's repr shown; the rest is cut to "..."
_CHEAP = 1 << 24  # elements of a tensor in memory up to which min/max/mean are worth computing


def _owners(entries: Mapping[str, Any], keys: list[str]) -> dict[str, str]:
    """Return the entry each ``entry/key`` belongs to: the longest entry name it is under.

    An entry named ``model/weight`` (only a crafted checkpoint has one; `save`
    refuses it) then keeps its own value, and ``model``'s weight stays ``model``'s.
    """
    owners: dict[str, str] = {}
    for key in keys:
        parts = key.split("/")
        for end in range(len(parts) - 1, 0, -1):  # a key of an entry, never the entry itself
            if "/".join(parts[:end]) in entries:
                owners[key] = "/".join(parts[:end])
                break
    return owners


def _name(name: str) -> str:
    """Return an entry's name as shown: quoted where it reads as a path or hides its ends."""
    # Not for a backslash: the CLI shows control characters escaped (\x1b) before this.
    return repr(name) if "/" in name or name != name.strip() else name


def _natural(key: str) -> list[str | tuple[int, str]]:
    """Return a sort key: text as text, runs of digits by value (``2.w`` before ``10.w``).

    A run is ordered by its length without leading zeros, then as text: its value's
    order, without ``int()``, which refuses a crafted key's thousands of digits.
    """
    parts = re.split(r"(\d+)", key)  # text, digits, text, ...: a position holds one kind
    return [
        (len(part.lstrip("0")), part) if index % 2 else part for index, part in enumerate(parts)
    ]


@attrs.frozen
class _Summary:
    """A tensor read from a checkpoint, shown as dtype, shape and (if cheap) min/max/mean."""

    tensor: torch.Tensor

    def __repr__(self) -> str:
        tensor = self.tensor
        text = str(TensorInfo(tuple(tensor.shape), tensor.dtype))
        if (
            tensor.is_floating_point()
            and 0 < tensor.numel() <= _CHEAP
            and tensor.device.type == "cpu"
        ):
            low, high, mean = (
                float(f(tensor.detach().float())) for f in (torch.min, torch.max, torch.mean)
            )
            text += f" min={low:.4g} max={high:.4g} mean={mean:.4g}"
        return text


def _brief(value: Any) -> str:
    """Return one line for a plain value: tensors in it summarised, the repr cut to `_WIDTH`."""
    text = " ".join(repr(map_tensors(_Summary, value)).split("\n"))
    return text if len(text) <= _WIDTH else text[: _WIDTH - 3] + "..."


def _value_lines(key: str, value: Any) -> dict[str, str]:
    """Return the lines of a value under ``key``: a non-empty mapping's items one by one."""
    if isinstance(value, Mapping) and value:
        lines: dict[str, str] = {}
        for name, item in value.items():
            lines.update(_value_lines(f"{key}/{name}" if key else str(name), item))
        return lines
    return {key: f" = {_brief(value)}" if key else f"= {_brief(value)}"}


def describe(path: str | os.PathLike[str]) -> Description:
    """Return what the checkpoint at ``path`` holds, without a model or a process group.

    Tensors are listed from the metadata (not read); plain values, objects'
    states and optimizer settings are read with ``weights_only=True``.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        CheckpointError: the checkpoint is truncated, tampered with or unreadable.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from stratagem.checkpoint import dcp_files

    alone = Context(env=Env(), device=torch.device("cpu"))
    with opened(checked_path(path, "describe"), alone) as (found, metadata):
        kinds: dict[str, Kind] = found.manifest["entries"]
        world = found.manifest["world_size"]
        blobs = blob_paths(kinds, range(world), metadata)
        stored = dcp_files.read_values(found, metadata, blobs, alone)
    tensors, values = {}, {}
    for name, items in layout_of(metadata).items():
        for key, item in items.items():
            full = "/".join((name, *key))
            if (name, *key) in blobs:
                if name != RNG_KEY:
                    values[name] = decoded(stored, (name, *key), f"the value {name!r}")
            elif isinstance(item, TensorStorageMetadata):
                tensors[full] = TensorInfo(tuple(item.size), item.properties.dtype)
            else:
                values[full] = stored[(name, *key)]
    return Description(
        path=found.directory,
        saved_at=datetime.datetime.fromtimestamp(found.manifest["saved_at_ns"] / 1e9, datetime.UTC),
        world_size=world,
        entries=dict(kinds),
        tensors=tensors,
        values=values,
        rng_ranks=tuple(sorted(int(p[1]) for p in stored if len(p) == 2 and p[0] == RNG_KEY)),
    )
