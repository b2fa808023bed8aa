"""A checkpoint on disk: one directory, written beside its target and renamed into place.

A checkpoint at ``path`` is a directory holding the files of
``torch.distributed.checkpoint`` (``.metadata``, one ``__<rank>_0.distcp`` per
writing rank) and ``stratagem.json``, the manifest, written last. The names
beside it tell what a save was doing when it stopped:

- ``path.tmp-<token>``: a save in progress (or one that died); never read.
- ``path.old-<token>``: the previous checkpoint, moved aside while the new
  one is renamed into place.

A save commits in three renames and removals, each safe to interrupt:

1. write ``path.tmp-T`` (every rank), then its manifest (rank 0);
2. rename ``path`` to ``path.old-T`` (if there is one), rename ``path.tmp-T``
   to ``path``;
3. remove ``path.old-T`` (its manifest first), then leftovers of earlier saves.

A crash in 1 leaves ``path`` untouched. A crash between the two renames of 2
leaves no ``path``, and `resolve` then finds the previous checkpoint at
``path.old-T``: loading gives the previous checkpoint until a later save
succeeds. A crash in 3 leaves the new checkpoint at ``path`` and garbage that
the next save removes. A directory without a manifest is never read.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from stratagem.errors import CheckpointError, UsageError, describe

__all__ = [
    "FORMAT",
    "MANIFEST",
    "CheckpointError",
    "Found",
    "commit",
    "discard",
    "latest",
    "resolve",
    "stage_hook",
]

FORMAT = "stratagem-checkpoint/2"
MANIFEST = "stratagem.json"
_TMP = ".tmp-"
_OLD = ".old-"


def _ignore(stage: str) -> None:
    pass


# Called with the name of each stage of a save: "writing" and "written" on every rank, then
# "manifest", "moved-aside", "committed", "discarding" on rank 0. Crash tests replace it to
# kill the process there; nothing else should.
stage_hook: Callable[[str], None] = _ignore


@attrs.frozen
class Found:
    """A complete checkpoint: its directory and its manifest."""

    directory: Path
    manifest: dict[str, Any]


def temporary(target: Path, token: str) -> Path:
    """Return the directory a save to ``target`` writes to before it commits."""
    return target.with_name(f"{target.name}{_TMP}{token}")


def _fsync_directory(directory: Path) -> None:
    # Makes the renames durable across a power loss; not possible on every platform.
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    with open(directory / MANIFEST, "w", encoding="utf-8") as file:
        json.dump(manifest, file, indent=1, sort_keys=True)
        file.flush()
        os.fsync(file.fileno())
    _fsync_directory(directory)


def _bad(directory: Path, what: str) -> CheckpointError:
    return CheckpointError(f"load: {os.fspath(directory)!r} is not a readable checkpoint: {what}.")


def read_manifest(directory: Path) -> dict[str, Any]:
    """Return the manifest of a complete checkpoint, after checking every file it lists.

    Raises:
        CheckpointError: no manifest, a malformed one, or a listed file that is
            missing or has another size than when it was written (truncated).
    """
    try:
        text = (directory / MANIFEST).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise _bad(directory, f"it has no {MANIFEST} (not a stratagem checkpoint)") from None
    try:
        manifest = json.loads(text)
    except ValueError as error:
        raise _bad(directory, f"{MANIFEST} is not valid JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _bad(directory, f"{MANIFEST} does not describe a {FORMAT} checkpoint")
    if not isinstance(manifest.get("saved_at_ns"), int):
        raise _bad(directory, f"{MANIFEST} does not say when it was saved")
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise _bad(directory, f"{MANIFEST} lists no files")
    for name, size in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in {"", ".", ".."}:
            raise _bad(directory, f"{MANIFEST} lists a file outside it ({name!r})")
        try:
            status = (directory / name).lstat()
        except FileNotFoundError:
            raise _bad(directory, f"{name} is missing") from None
        if not stat.S_ISREG(status.st_mode):
            raise _bad(directory, f"{name} is not a regular file")
        actual = status.st_size
        if actual != size:
            raise _bad(directory, f"{name} has {actual} bytes, {size} when written (truncated?)")
    return manifest


def _is_checkpoint(directory: Path) -> bool:
    try:
        read_manifest(directory)
    except CheckpointError:
        return False
    return True


def _siblings(target: Path, marker: str) -> list[Path]:
    prefix = f"{target.name}{marker}"
    with contextlib.suppress(FileNotFoundError):
        return [p for p in target.parent.iterdir() if p.name.startswith(prefix)]
    return []


def _newest(directories: list[Path]) -> Found | None:
    found = []
    for directory in directories:
        with contextlib.suppress(CheckpointError):
            found.append(Found(directory, read_manifest(directory)))
    return max(found, key=lambda f: f.manifest.get("saved_at_ns", 0), default=None)


def resolve(target: Path) -> Found:
    """Return the checkpoint that ``target`` names: itself, or the previous one a save moved aside.

    Raises:
        FileNotFoundError: there is no checkpoint at ``target``.
        CheckpointError: ``target`` is not a complete, unaltered checkpoint.
    """
    if target.exists():
        if not target.is_dir():
            raise _bad(target, "it is a file; a checkpoint is a directory")
        return Found(target, read_manifest(target))
    previous = _newest(_siblings(target, _OLD))
    if previous is None:
        raise FileNotFoundError(f"load: no checkpoint at {os.fspath(target)!r}.")
    return previous


def discard(directory: Path) -> None:
    """Remove a checkpoint directory, its manifest first, so a partial removal is never read."""
    with contextlib.suppress(FileNotFoundError):
        (directory / MANIFEST).unlink()
    stage_hook("discarding")
    shutil.rmtree(directory, ignore_errors=True)


def _replaceable(target: Path) -> None:
    if not target.exists():
        return
    if target.is_dir() and (not any(target.iterdir()) or _is_checkpoint(target)):
        return
    raise CheckpointError(
        f"save: {os.fspath(target)!r} exists and is not a stratagem checkpoint; "
        "save elsewhere, or remove it first."
    )


def commit(tmp: Path, target: Path, manifest: dict[str, Any], keep_last: int | None) -> None:
    """Write the manifest into ``tmp``, rename ``tmp`` to ``target`` (rank 0, once all ranks wrote).

    Raises:
        CheckpointError: ``target`` exists and is not a checkpoint (it is never replaced).
    """
    _replaceable(target)
    manifest = {
        **manifest,
        "format": FORMAT,
        "saved_at_ns": time.time_ns(),
        "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
    }
    _write_manifest(tmp, manifest)
    stage_hook("manifest")
    aside = None
    if target.exists():
        aside = target.with_name(f"{target.name}{_OLD}{tmp.name.rsplit(_TMP, 1)[1]}")
        os.rename(target, aside)
        stage_hook("moved-aside")
    try:
        os.rename(tmp, target)
    except BaseException:
        if aside is not None:
            os.rename(aside, target)  # put the previous checkpoint back
        raise
    _fsync_directory(target.parent)
    stage_hook("committed")
    for leftover in [*_siblings(target, _OLD), *_siblings(target, _TMP)]:
        discard(leftover)
    if keep_last is not None:
        _prune(target, keep_last)


def _checkpoints_in(directory: Path) -> Iterator[Found]:
    for child in sorted(directory.iterdir()):
        if child.is_dir() and _TMP not in child.name and _OLD not in child.name:
            with contextlib.suppress(CheckpointError):
                yield Found(child, read_manifest(child))


def _prune(target: Path, keep_last: int) -> None:
    """Remove all but the ``keep_last`` newest checkpoints beside ``target`` (never ``target``)."""
    found = sorted(_checkpoints_in(target.parent), key=lambda f: f.manifest["saved_at_ns"])
    doomed = [f.directory for f in found[:-keep_last] if f.directory != target]
    for directory in doomed:
        discard(directory)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """Return the newest complete checkpoint in ``directory``, or ``None`` if it holds none.

    A checkpoint whose save was interrupted between its two renames counts
    under its own name (loading it gives the previous version).

    Raises:
        UsageError: ``directory`` is not a str or path-like.
    """
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise UsageError(
            f"latest: 'directory' must be a str or os.PathLike (got {describe(directory)})."
        )
    parent = Path(directory)
    if not parent.is_dir():
        return None
    found = list(_checkpoints_in(parent))
    for child in parent.iterdir():
        base = child.with_name(child.name.rsplit(_OLD, 1)[0])
        if _OLD in child.name and not base.exists():
            with contextlib.suppress(CheckpointError, FileNotFoundError):
                found.append(Found(base, resolve(base).manifest))
    newest = max(found, key=lambda f: f.manifest["saved_at_ns"], default=None)
    return None if newest is None else newest.directory
