"""Checkpoints: one file written atomically by rank 0, read without unpickling code.

``state`` maps names to objects with ``state_dict``/``load_state_dict``
(modules, optimizers, schedulers, grad scalers) and to plain values (ints,
floats, strings, lists, dicts of those, tensors). Modules are saved with the
keys of the plain module, whatever wrapper (``DistributedDataParallel``,
``DataParallel``, ``torch.compile``) surrounds them, so a checkpoint written
under one strategy loads under another.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

from stratagem import collectives
from stratagem.env import Context
from stratagem.errors import UsageError, describe

__all__ = ["load", "save", "unwrap"]

_FORMAT = "stratagem-checkpoint/1"


def _is_compiled(module: torch.nn.Module) -> bool:
    # Importing torch._dynamo costs seconds; if nobody imported it, nothing is compiled.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Return the plain module inside DDP, DataParallel and ``torch.compile`` wrappers."""
    while True:
        if isinstance(module, (DistributedDataParallel, DataParallel)):
            module = cast(torch.nn.Module, module.module)
        elif _is_compiled(module):
            module = cast(torch.nn.Module, module._orig_mod)  # noqa: SLF001  # torch offers no other handle
        else:
            return module


def _has_state(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _state_dict(value: Any) -> Any:
    if isinstance(value, torch.nn.Module):
        return unwrap(value).state_dict()
    return value.state_dict()


def save(path: str | os.PathLike[str], state: Mapping[str, Any], ctx: Context) -> None:
    """Write ``state`` to the file ``path``, atomically.

    Rank 0 writes to a temporary file beside ``path``, flushes it to disk and
    renames it into place; the other ranks wait at a barrier. A save that
    dies half way leaves the previous file at ``path`` untouched.

    Raises:
        UsageError: ``state`` is not a mapping with string keys.
    """
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise UsageError(f"save: 'state' must be a mapping with str keys (got {describe(state)}).")
    if ctx.is_main:
        objects = {k: _state_dict(v) for k, v in state.items() if _has_state(v)}
        values = {k: v for k, v in state.items() if not _has_state(v)}
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as file:
                torch.save({"format": _FORMAT, "objects": objects, "values": values}, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    collectives.barrier(ctx)


def load(path: str | os.PathLike[str], state: Mapping[str, Any], ctx: Context) -> dict[str, Any]:
    """Restore ``state``'s objects in place from ``path`` and return the saved plain values.

    The file is read with ``weights_only=True``: it cannot run code.

    Raises:
        FileNotFoundError: there is no checkpoint at ``path``.
        UsageError: the file is not a stratagem checkpoint, or ``state`` names an
            object the checkpoint does not hold (the message lists both sides).
    """
    try:
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise UsageError(
            f"load: {os.fspath(path)!r} is not a readable checkpoint ({error})."
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
        raise UsageError(f"load: {os.fspath(path)!r} is not a stratagem checkpoint.")
    objects: dict[str, Any] = payload["objects"]
    wanted = [k for k, v in state.items() if _has_state(v)]
    missing = sorted(set(wanted) - set(objects))
    if missing:
        raise UsageError(
            f"load: the checkpoint holds no state for {missing}; it holds {sorted(objects)}."
        )
    for key in wanted:
        target = state[key]
        if isinstance(target, torch.nn.Module):
            unwrap(target).load_state_dict(objects[key])
        else:
            target.load_state_dict(objects[key])
    values: dict[str, Any] = payload["values"]
    return dict(values)
