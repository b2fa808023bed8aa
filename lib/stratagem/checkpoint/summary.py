"""`describe`: what a checkpoint holds, read without a model and without running code from it."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.checkpoint.api import blob_paths, checked_path, decoded, open_checkpoint
from stratagem.checkpoint.entries import RNG_KEY, Kind
from stratagem.checkpoint.matching import layout_of
from stratagem.env import Context, Env

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
        lines = [
            f"{self.path}",
            f"  saved {self.saved_at:%Y-%m-%d %H:%M:%S} UTC by {self.world_size} rank(s); "
            f"RNG states of ranks {list(self.rng_ranks)}",
        ]
        for name, kind in self.entries.items():
            lines.append(f"  {name} ({kind})")
            prefix = f"{name}/"
            lines += [
                f"    {k[len(prefix) :]}: {v}"
                for k, v in self.tensors.items()
                if k.startswith(prefix)
            ]
            lines += [
                f"    {k[len(prefix) :]} = {v!r}"
                for k, v in self.values.items()
                if k.startswith(prefix)
            ]
            if name in self.values:
                lines.append(f"    = {self.values[name]!r}")
        return "\n".join(lines)


def describe(path: str | os.PathLike[str]) -> Description:
    """Return what the checkpoint at ``path`` holds, without a model or a process group.

    Tensors are listed from the metadata (not read); plain values, objects'
    states and optimizer settings are read with ``weights_only=True``.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        CheckpointError: the checkpoint is truncated, tampered with or unreadable.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from stratagem.checkpoint import engine

    found, metadata = open_checkpoint(checked_path(path, "describe"))
    kinds: dict[str, Kind] = found.manifest["entries"]
    world = found.manifest["world_size"]
    blobs = blob_paths(kinds, world)
    alone = Context(env=Env(), device=torch.device("cpu"))
    stored = engine.read_values(found.directory, metadata, blobs, alone)
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
        rng_ranks=tuple(r for r in range(world) if (RNG_KEY, str(r)) in stored),
    )
