"""Who owns each entry of a checkpoint, and so which rank writes it.

- **replicated** (every entry not marked otherwise): the same on every rank by
  promise; rank 0's copy is written, whole, for every entry and every key, so a
  checkpoint never mixes ranks. ``save(..., verify=True)`` checks the promise.
- **sharded** (DTensor leaves, as ``fsdp()`` makes them): each rank writes its
  own shard (a shard replicated over a mesh dimension, by the lowest such rank).
- **per rank** (entries marked with `per_rank`): each rank writes its own, and
  on load each rank gets back its own: data positions, an already-fetched batch.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from stratagem.checkpoint.layout import CheckpointError
from stratagem.env import Context

__all__ = ["PerRank", "differing_replicas", "per_rank", "written_by_this_rank"]

_SHOWN = 20  # differing keys listed; the rest are counted


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


def written_by_this_rank(saved: dict[str, Any], per_rank_names: set[str], ctx: Context) -> Any:
    """Return the part of ``saved`` this rank writes: all on rank 0, else shards and per-rank."""
    if ctx.rank == 0:
        return saved
    written = {}
    for name, value in saved.items():
        part = value if name in per_rank_names else _sharded_part(value)
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


def differing_replicas(replicated: dict[str, Any], ctx: Context) -> str | None:
    """Compare the replicated entries of every rank; describe those that differ, by key.

    Args:
        replicated: this rank's replicated entries by name, as values (module and
            optimizer state dicts, objects' states, plain values).
        ctx: the joined world; every rank must call it (it gathers the
            fingerprints: every replicated tensor is hashed on every rank).

    Returns:
        None if every rank holds the same, else the keys and the ranks that differ from rank 0.
    """
    mine: dict[str, str] = {}
    for name in sorted(replicated):
        _fingerprints(replicated[name], f"/{name}", mine)
    if ctx.group is None or ctx.world_size == 1:
        return None
    import torch.distributed as dist

    everyone: list[dict[str, str]] = [{} for _ in range(ctx.world_size)]
    dist.all_gather_object(everyone, mine, group=ctx.group)
    reference = everyone[0]
    ranks_by_key: dict[str, list[int]] = {}
    for rank, theirs in enumerate(everyone[1:], start=1):
        for path in sorted(reference.keys() | theirs.keys()):
            if reference.get(path) != theirs.get(path):
                ranks = ranks_by_key.setdefault(path[1:], [])
                if rank not in ranks:
                    ranks.append(rank)
    if not ranks_by_key:
        return None
    shown = [
        f"{key} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"differ{'' if len(ranks) > 1 else 's'} from rank 0)"
        for key, ranks in list(ranks_by_key.items())[:_SHOWN]
    ]
    more = f" and {len(ranks_by_key) - _SHOWN} more" if len(ranks_by_key) > _SHOWN else ""
    return f"{len(ranks_by_key)} replicated entries differ across ranks: {', '.join(shown)}{more}"


def refuse_differing(report: str) -> CheckpointError:
    """Return the error of a verified save whose replicated entries differ."""
    return CheckpointError(
        f"save(verify=True): {report}. Nothing was written. Only rank 0's copy of a "
        "replicated entry is saved; make the ranks agree (e.g. broadcast from rank 0), or "
        "mark state that differs by design with sg.per_rank(...)."
    )
