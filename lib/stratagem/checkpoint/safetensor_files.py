"""Hugging Face safetensors files, read and written without the ``safetensors`` package.

The format: eight bytes (a little-endian unsigned size), a JSON header of that
size naming each tensor's dtype, shape and byte range, then the bytes. A file
is untrusted input: the header is checked whole (its size against the file,
each range against its dtype and shape, the ranges tiling the data without gap
or overlap) before a tensor is made, and nothing in it is executed.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from stratagem.errors import CheckpointError
from stratagem.validators import is_int

__all__ = ["DTYPES", "INDEX", "read", "read_index", "write"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}

INDEX = "model.safetensors.index.json"
"""The file that maps each tensor of a sharded export to its shard, as Hugging Face names it."""

_HEADER_LIMIT = 100 * 2**20  # the safetensors package's own bound on a header


def _bad(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a valid safetensors file: {why}.")


def _header_length(path: Path, size: int, head: bytes) -> int:
    if sys.byteorder != "little":
        raise CheckpointError(f"{path}: safetensors is little-endian; this machine is not.")
    if size < 8:
        raise _bad(path, f"it has {size} bytes, fewer than the 8 of its header size")
    (length,) = struct.unpack("<Q", head[:8])
    if length > min(size - 8, _HEADER_LIMIT):
        raise _bad(
            path,
            f"its header claims {length} bytes, but the file holds {size - 8} after the size "
            f"(and a header may hold at most {_HEADER_LIMIT})",
        )
    return int(length)


def _entries(
    path: Path, header: object, data: int
) -> dict[str, tuple[torch.dtype, list[int], int]]:
    """Check a parsed header against ``data`` bytes; return ``{name: (dtype, shape, begin)}``."""
    if not isinstance(header, dict):
        raise _bad(path, f"its header is a JSON {type(header).__name__}, not an object")
    entries: dict[str, tuple[torch.dtype, list[int], int]] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise _bad(path, "its __metadata__ is not an object of strings")
            continue
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"tensor {name!r} is not {{dtype, shape, data_offsets}}")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None:
            raise _bad(
                path, f"tensor {name!r} has dtype {entry['dtype']!r}, not one of {sorted(DTYPES)}"
            )
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not isinstance(shape, list) or not all(is_int(d, 0) for d in shape):
            raise _bad(path, f"tensor {name!r} has shape {shape!r}, not a list of sizes >= 0")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o, 0) for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]")
        begin, end = offsets
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise _bad(
                path,
                f"tensor {name!r} spans {end - begin} bytes, but {entry['dtype']} {shape} "
                f"takes {expected}",
            )
        entries[name] = (dtype, shape, begin)
        ranges.append((begin, end, name))
    at, previous = 0, "the header"
    for begin, end, name in sorted(ranges):
        if begin != at:
            relation = "overlaps" if begin < at else "leaves a gap after"
            raise _bad(path, f"tensor {name!r} (bytes {begin}-{end}) {relation} {previous}")
        at, previous = end, repr(name)
    if at != data:
        raise _bad(path, f"its tensors cover {at} bytes of data, but the file holds {data}")
    return entries


def read(path: Path) -> dict[str, torch.Tensor]:
    """Return the tensors of the safetensors file at ``path``, each a CPU tensor.

    Raises:
        CheckpointError: the file cannot be read or its header is not valid.
    """
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            length = _header_length(path, size, file.read(8))
            raw = file.read(length)
            try:
                header = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise _bad(path, f"its header is not JSON ({error})") from None
            entries = _entries(path, header, size - 8 - length)
            data = bytearray(file.read())
    except OSError as error:
        raise CheckpointError(f"cannot read {path}: {error}") from None
    tensors = {}
    for name, (dtype, shape, begin) in entries.items():
        count = math.prod(shape)
        if count == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        if begin % dtype.itemsize:  # another writer's layout: copy to an aligned buffer
            flat = torch.frombuffer(data[begin : begin + count * dtype.itemsize], dtype=dtype)
        else:
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=begin)
        tensors[name] = flat.reshape(shape)
    return tensors


def write(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Write ``tensors`` (CPU, dense) to ``path`` as one safetensors file; the caller renames it."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    # Widest dtypes first: every tensor then starts at a multiple of its own item size.
    tensors = dict(sorted(tensors.items(), key=lambda item: -item[1].dtype.itemsize))
    at = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise CheckpointError(
                f"{name!r} is {tensor.dtype}, which safetensors cannot hold; "
                f"convert it to one of {sorted(str(d) for d in _NAMES)}."
            )
        size = tensor.numel() * tensor.dtype.itemsize
        header[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [at, at + size],
        }
        at += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the package writes it
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
        for tensor in tensors.values():
            if tensor.numel():
                file.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        file.flush()
        os.fsync(file.fileno())


def read_index(directory: Path) -> dict[str, str]:
    """Return ``{tensor: shard file}`` of a sharded export's index, each shard inside ``directory``.

    Raises:
        CheckpointError: the index is not valid, or names a file outside ``directory``.
    """
    path = directory / INDEX
    try:
        if path.stat().st_size > _HEADER_LIMIT:
            raise CheckpointError(f"{path} is larger than {_HEADER_LIMIT} bytes; not an index.")
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read the index {path}: {error}") from None
    weights = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weights, dict) or not weights:
        raise CheckpointError(f"{path} has no weight_map of tensor names to shard files.")
    for name, shard in weights.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(
                f"{path} maps {name!r} to {shard!r}, which is not a file name in {directory}."
            )
    return dict(weights)
