"""Reading untrusted checkpoint files without running code from them.

DCP writes its ``.metadata`` with plain ``pickle`` and reads it back with
``pickle.load``, which runs whatever a tampered file asks for. Here it is read
by an unpickler that resolves only the classes DCP's metadata is made of.
Plain values (and the state of objects other than modules and optimizers) are
stored as ``torch.save`` bytes and read back with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import re
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratagem.checkpoint.layout import CheckpointError
from stratagem.errors import UsageError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["decode", "encode", "read_metadata", "refusal"]

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "torch.serialization": ("_get_layout",),
    "torch": ("Size",),
    "pathlib": ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"),
    "collections": ("OrderedDict",),
}


@cache
def _allowed() -> dict[tuple[str, str], Any]:
    import importlib

    allowed = {
        (module, name): getattr(importlib.import_module(module), name)
        for module, names in _METADATA_CLASSES.items()
        for name in names
    }
    # Dtypes pickle as attributes of torch (``torch.float32``).
    allowed.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return allowed


def _find_class(module: str, name: str) -> Any:
    found = _allowed().get((module, name))
    if found is None:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}")
    return found


def refusal(error: Exception) -> str:
    """Say in a few words why ``torch.load(weights_only=True)`` (or ``torch.save``) failed."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    if found:
        return f"it names {found.group(1)}, which weights_only loading refuses"
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"


def read_metadata(directory: Path) -> Metadata:
    """Read DCP's ``.metadata`` of ``directory``, resolving only the classes metadata is made of.

    Raises:
        CheckpointError: the file names any other class or function (a
            tampered file), is truncated, or does not hold DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(directory / ".metadata", "rb") as file:
        # The pure-Python unpickler looks find_class up on the instance, so it is
        # restricted without a subclass (house rule: no subclassing outside Protocols).
        unpickler = pickle._Unpickler(file)  # noqa: SLF001
        unpickler.find_class = _find_class  # type: ignore[method-assign]
        try:
            metadata = unpickler.load()
        except Exception as error:  # any failure means an unreadable file
            raise CheckpointError(
                f"load: {str(directory)!r} is not a readable checkpoint: its .metadata "
                f"cannot be read safely ({type(error).__name__}: {error})."
            ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.planner_data, dict):
        raise CheckpointError(
            f"load: {str(directory)!r} is not a readable checkpoint: its .metadata "
            "does not hold the metadata of a stratagem checkpoint."
        )
    return metadata


def encode(value: Any, what: str) -> torch.Tensor:
    """Return ``value`` as ``torch.save`` bytes in a uint8 tensor, checked to read back safely.

    Raises:
        UsageError: ``value`` holds something ``weights_only`` loading refuses
            (a custom class, a function, ...); the message names ``what``.
    """
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as error:  # whatever torch.save or the safe load refuses
        raise UsageError(
            f"save: {what} cannot be stored as a plain value ({refusal(error)}). "
            "Plain values may hold numbers, strings, "
            "lists, tuples, dicts and tensors; give other objects state_dict() and "
            "load_state_dict()."
        ) from None
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def decode(blob: torch.Tensor, what: str) -> Any:
    """Read a value `encode` stored, with ``weights_only=True``: no code from the file runs.

    Raises:
        CheckpointError: the bytes are not a plain value (tampered or corrupt).
    """
    try:
        return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True, map_location="cpu")
    except Exception as error:  # whatever the safe load refuses
        raise CheckpointError(
            f"load: {what} in the checkpoint is not a plain value and was refused "
            f"({refusal(error)})."
        ) from None
