"""The ``torch.distributed.checkpoint`` glue: write a state dict, read one back safely.

Imported on first use (DCP takes a second to import). Reading uses DCP's own
storage reader and load planner, without subclassing them (house rule): the
reader serves metadata already read by `directory.read_metadata`, and the
planner reads DCP's non-tensor values with ``weights_only=True`` where it would
unpickle them without restriction.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from stratagem.checkpoint.directory import Found, checksum, refusal
from stratagem.env import Context, host_group
from stratagem.errors import CheckpointError
from stratagem.validators import is_int

__all__ = [
    "checksums",
    "failure_of",
    "read",
    "read_values",
    "storage_problem",
    "tensor_problem",
    "write",
    "write_async",
]


_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def _calling_dcp(ctx: Context, what: str) -> Iterator[None]:
    """Inside, a failure of DCP raises a `CheckpointError` saying that ``what`` failed."""
    try:
        with warnings.catch_warnings():
            if ctx.group is None:
                # A world of one has no process group by design; DCP warns that it assumes so.
                warnings.filterwarnings("ignore", _ONE_PROCESS, UserWarning)
            yield
    except (Exception, CheckpointException) as error:  # DCP's error is a BaseException
        raise _failure(error, what) from None


def _failure(error: BaseException, what: str) -> CheckpointError:
    cause = error
    if isinstance(error, CheckpointException) and error.failures:
        cause = sorted(error.failures.items())[0][1][0]  # the lowest failing rank's
    if isinstance(cause, CheckpointError):
        return cause  # already says what is wrong
    return CheckpointError(f"{what} failed ({type(cause).__name__}: {cause}).")


def _writing(directory: Path, ctx: Context) -> dict[str, Any]:
    """Return the arguments of DCP's ``save`` and ``async_save``: one synced file per rank."""
    return {
        "storage_writer": FileSystemWriter(directory, single_file_per_rank=True, sync_files=True),
        "planner": DefaultSavePlanner(dedup_save_to_lowest_rank=True),
        "process_group": host_group(ctx),
        "no_dist": ctx.group is None,
    }


def write(directory: Path, state_dict: dict[str, Any], ctx: Context) -> None:
    """Write ``state_dict`` into ``directory``: each rank its own file.

    Each rank passes only what it owns (`entries.written_by_this_rank`); an item
    that several ranks still pass (a shard replicated over a mesh dimension)
    is written by the lowest of them, never by a rank the planner balances to.

    Raises:
        CheckpointError: a rank failed to write (every rank raises it).
    """
    with _calling_dcp(ctx, _writing_what(directory)):
        dcp_save(state_dict, **_writing(directory, ctx))


def write_async(
    directory: Path, state_dict: dict[str, Any], ctx: Context
) -> concurrent.futures.Future[Any]:
    """Copy ``state_dict`` to CPU memory now; write it into ``directory`` on DCP's thread.

    Returns once the copy is taken, so the caller may change its tensors; the
    future completes when this rank's files (and, on rank 0, ``.metadata``) are
    written. ``ctx.group`` must be a gloo group used by nothing else meanwhile:
    its collectives run on that thread.

    Raises:
        CheckpointError: the state could not be staged (the writing's own
            failures arrive through the future, as `write` raises them).
    """
    if ctx.group is None:
        # DCP's thread warns that a world of one is one; `_calling_dcp` cannot reach that
        # thread (warning filters are per process, and restored when the block ends), so this
        # one message of DCP's is ignored for the process.
        warnings.filterwarnings("ignore", _ONE_PROCESS, UserWarning)
    with _calling_dcp(ctx, f"save: staging the state for {str(directory)!r}"):
        staged = dcp_async_save(state_dict, **_writing(directory, ctx))
    return cast("concurrent.futures.Future[Any]", staged)


def _writing_what(directory: Path) -> str:
    """Return the step that writes into ``directory``, as the error of its failure names it."""
    return f"save: writing {str(directory)!r}"


def failure_of(error: BaseException, directory: Path) -> CheckpointError:
    """Return the error a failed asynchronous write raises, as `write` would raise it."""
    return _failure(error, _writing_what(directory))


def _vetted(read_item: ReadItem, value: io.BytesIO) -> io.BytesIO:
    """Return the non-tensor value in ``value`` read ``weights_only``, encoded again.

    DCP's planner unpickles without restriction, so it gets a re-encoding of the
    vetted object, never the file's bytes.

    Raises:
        CheckpointError: the value holds something ``weights_only`` loading refuses.
    """
    try:
        vetted = torch.load(value, weights_only=True, map_location="cpu")
    except Exception as error:  # whatever the safe load refuses
        raise CheckpointError(
            f"load: the value {read_item.dest_index.fqn!r} in the checkpoint was refused "
            f"({refusal(error)})."
        ) from None
    clean = io.BytesIO()
    torch.save(vetted, clean)
    clean.seek(0)
    return clean


def storage_problem(metadata: Metadata, sizes: dict[str, int]) -> str | None:
    """Say which item the metadata points at outside the files the manifest lists, if any.

    An item may point outside the checkpoint or past the end of a file.
    """
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", -1), getattr(info, "length", -1)
        if not isinstance(index, MetadataIndex) or name not in sizes:
            return f"its .metadata points at {name!r}, which is not one of its files"
        if not (isinstance(offset, int) and isinstance(length, int)) or not (
            offset >= 0 and length >= 0 and offset + length <= sizes[name]
        ):
            return (
                f"{index.fqn!r} lies outside {name} "
                f"(bytes {offset}..{offset + length} of {sizes[name]})"
            )
    return None


_MAX_DIMENSIONS = 64


def _shown(metadata: Metadata, fqn: str) -> str:
    path = metadata.planner_data.get(fqn)
    return "/".join(map(str, path)) if isinstance(path, tuple) and path else str(fqn)


def _sizes_of(value: Any, dimensions: int | None) -> tuple[int, ...] | None:
    """Return ``value`` as a tuple of non-negative ints (of ``dimensions`` of them), else None."""
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMENSIONS:
        return None
    if dimensions is not None and len(value) != dimensions:
        return None
    if not all(is_int(v, 0) for v in value):
        return None
    return tuple(value)


def _overlapping(chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two boxes ``(offsets, sizes)`` share an element (a sweep along dimension 0)."""
    boxes = sorted((o, z) for o, z in chunks if math.prod(z) > 0)
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1 :]:
            if offsets and other[0] >= offsets[0] + sizes[0]:
                break
            if all(
                max(a, b) < min(a + m, b + n)
                for a, m, b, n in zip(offsets, sizes, other, other_sizes, strict=True)
            ):
                return True
    return False


def tensor_problem(metadata: Metadata, sizes: dict[str, int]) -> str | None:
    """Say which tensor the metadata declares is impossible, or not covered exactly once, if any.

    A crafted ``.metadata`` may declare a tensor larger than the checkpoint's
    files (an allocation of terabytes), a negative dimension, or pieces that
    leave part of a tensor unread (the live tensor would keep its old values
    there) or read it twice.
    """
    stored = sum(sizes.values())
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        key = _shown(metadata, fqn)
        dtype = getattr(item.properties, "dtype", None)
        shape = _sizes_of(item.size, None)
        if not isinstance(dtype, torch.dtype):
            return f"its .metadata gives {key!r} no dtype"
        if shape is None:
            return (
                f"its .metadata declares {key!r} of shape {item.size!r}, with a negative or "
                f"non-integer dimension, or more than {_MAX_DIMENSIONS} (a crafted file)"
            )
        elements = math.prod(shape)
        if elements * dtype.itemsize > stored:
            return (
                f"its .metadata declares {key!r} of shape {list(shape)} "
                f"({elements * dtype.itemsize} bytes), more than the {stored} bytes of its "
                "files (a crafted file)"
            )
        chunks = []
        for chunk in item.chunks if isinstance(item.chunks, list) else [None]:
            offsets = _sizes_of(getattr(chunk, "offsets", None), len(shape))
            extent = _sizes_of(getattr(chunk, "sizes", None), len(shape))
            if (
                offsets is None
                or extent is None
                or any(o + z > d for o, z, d in zip(offsets, extent, shape, strict=True))
            ):
                return f"its .metadata lists a piece of {key!r} outside its shape"
            if math.prod(extent) and MetadataIndex(fqn, offsets) not in metadata.storage_data:
                return f"its .metadata lists a piece of {key!r} stored nowhere"
            chunks.append((offsets, extent))
        if _overlapping(chunks):
            return f"the pieces its .metadata lists for {key!r} overlap (a crafted file)"
        covered = sum(math.prod(z) for _, z in chunks)
        if covered != elements:
            return (
                f"the pieces its .metadata lists for {key!r} cover {covered} of its "
                f"{elements} elements (a crafted or corrupt file: part of the tensor would "
                "keep its old values)"
            )
    return None


def checksums(directory: Path, ctx: Context) -> dict[str, int]:
    """Return the CRC-32 of every file in ``directory``, each computed by the rank that wrote it.

    Rank ``r`` writes the files ``__r_*``, rank 0 also ``.metadata``; rank 0
    reads whatever no rank claimed. Every rank returns all of them, and none
    returns before every rank has written its files.
    """
    mine = sorted(directory.glob(f"__{ctx.rank}_*")) + (
        [directory / ".metadata"] if ctx.rank == 0 else []
    )
    sums = {path.name: checksum(path) for path in mine}
    if ctx.group is not None and ctx.world_size > 1:
        parts: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(parts, sums, group=host_group(ctx))
        sums = {name: value for part in parts for name, value in part.items()}
    if ctx.rank == 0:
        for path in sorted(directory.iterdir()):
            if path.is_file() and path.name not in sums:
                sums[path.name] = checksum(path)
    return sums


def read(
    found: Found, metadata: Metadata, state_dict: dict[str, Any], ctx: Context, *, partial: bool
) -> None:
    """Fill ``state_dict`` (tensors in place, other values replaced) from ``found``'s files.

    Raises:
        CheckpointError: a file could not be read, or a value was refused.
    """
    # DCP's own reader and planner, with what they would read unsafely replaced on the instance
    # (house rule: no subclass): the metadata is the one read safely, served without **kwargs
    # (DCP then never looks for per-rank files); each file is read through the descriptor a
    # `pinned` load holds; each non-tensor value is read ``weights_only`` (`_vetted`).
    reader = FileSystemReader(found.directory)
    reader.read_metadata = lambda: metadata  # type: ignore[method-assign,misc]
    reader.fs.concat_path = lambda path, suffix: found.path_of(suffix)  # type: ignore[method-assign]
    planner = DefaultLoadPlanner(allow_partial_load=partial)
    unsafe = planner.load_bytes  # unpickles without restriction: it gets what `_vetted` returns
    planner.load_bytes = lambda read_item, value: unsafe(read_item, _vetted(read_item, value))  # type: ignore[method-assign]
    with _calling_dcp(ctx, f"load: reading {str(found.directory)!r}"):
        dcp_load(
            state_dict,
            storage_reader=reader,
            planner=planner,
            process_group=host_group(ctx),
            no_dist=ctx.group is None,
        )


def read_values(
    found: Found, metadata: Metadata, blobs: set[tuple[str, ...]], ctx: Context
) -> dict[tuple[str, ...], Any]:
    """Read every non-tensor item, and the uint8 tensors at the key paths ``blobs``.

    They are read into a dict keyed by DCP's own flat keys, so no live object
    is needed and none is touched.

    Returns:
        The values by key path; blobs are returned as tensors, not decoded.

    Raises:
        CheckpointError: a value was refused, or a file could not be read.
    """
    template: dict[str, Any] = {}
    paths: dict[str, tuple[str, ...]] = {}
    for fqn, item in metadata.state_dict_metadata.items():
        paths[fqn] = path = tuple(str(p) for p in metadata.planner_data[fqn])
        if isinstance(item, BytesStorageMetadata):
            template[fqn] = None
        elif (
            path in blobs
            and isinstance(item, TensorStorageMetadata)
            and item.properties.dtype == torch.uint8
            and len(item.size) == 1
        ):
            template[fqn] = torch.empty(tuple(item.size), dtype=torch.uint8)
    if template:
        read(found, metadata, template, ctx, partial=False)
    return {paths[fqn]: value for fqn, value in template.items()}
