"""A checkpoint on disk: one directory, renamed into place, read without running code from it.

A checkpoint at ``path`` is a directory holding the files of
``torch.distributed.checkpoint`` (``.metadata``, one ``__<rank>_0.distcp`` per
writing rank) and ``stratagem.json``, the manifest, written last. The names
beside it tell what a save was doing when it stopped:

- ``path.tmp-<token>``: a save in progress (or one that died), or the
  previous checkpoint after the commit swapped it out; never read.
- ``path.old-<token>``: the previous checkpoint, moved aside by a commit
  that could not swap (below); read while there is no ``path``.

A save commits so that ``path`` always names a complete checkpoint:

1. write ``path.tmp-T`` (every rank), then its manifest (rank 0);
2. swap ``path.tmp-T`` and ``path`` in one atomic step (Linux
   ``renameat2(RENAME_EXCHANGE)``), or rename ``path.tmp-T`` to ``path``
   when there is no ``path`` yet;
3. remove the previous checkpoint, now at ``path.tmp-T`` (its manifest
   first), then leftovers of earlier saves.

Where the swap is refused (not Linux, or a file system without it, such as
NFS) step 2 is two renames: ``path`` to ``path.old-T``, then ``path.tmp-T``
to ``path``. A crash between them leaves no ``path``: `resolve`, `latest`
and `exists` then find the previous checkpoint at ``path.old-T`` (so
``os.path.exists(path)`` is not the test to use there), and the next save
puts it back at ``path`` before it writes anything, so it stays until a new
version is committed.

One save at a time writes to a path: rank 0 holds an exclusive ``flock`` on
``path.lock`` (it names the owner) from before step 1 to after step 3, and a
second save is refused; the kernel drops the lock of a process that dies, so
a crashed save never blocks the next. A load holds the files of the version
it opened (Linux: reopened through ``/proc/self/fd``), so a save committing
meanwhile cannot give it another version's files. Symbolic links are never
followed when listing or removing checkpoints: one where a checkpoint is
listed is skipped, and a save whose path is a link is refused.

A crash in 1 leaves ``path`` untouched. A crash in 2 leaves ``path`` as the
previous checkpoint or the new one, each whole. A crash in 3 leaves the new
checkpoint at ``path`` and garbage that the next save removes. A directory
without a manifest is never read.

Its files are untrusted. DCP writes its ``.metadata`` with plain ``pickle`` and
reads it back with ``pickle.load``, which runs whatever a tampered file asks
for. Here it is read by an unpickler that resolves only the classes DCP's
metadata is made of. Plain values (and the state of objects other than
modules and optimizers) are stored as ``torch.save`` bytes and read back with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import json
import os
import pickle
import re
import secrets
import shutil
import socket
import stat
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from stratagem import validators
from stratagem.checkpoint.safetensor_files import INDEX
from stratagem.errors import CheckpointError, UsageError, error_line

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Found",
    "abandon",
    "begin",
    "commit",
    "decode",
    "discard",
    "disk_full",
    "encode",
    "exists",
    "latest",
    "pinned",
    "read_metadata",
    "refusal",
    "resolve",
    "run_directory",
    "stage_hook",
    "unreadable",
]

FORMAT = "stratagem-checkpoint/2"
MANIFEST = "stratagem.json"
_TMP = ".tmp-"
_OLD = ".old-"
_LOCK = ".lock"
_MAX_MANIFEST = 64 << 20  # bytes; a manifest lists names and sizes, never data
_CHUNK = 1 << 22  # bytes read at a time for a checksum
# Bounds of the counts a manifest gives (untrusted: a huge one would be a loop without end).
_MAX_COUNT = 1 << 62
_MAX_WORLD = 1 << 24  # ranks
_LAST_NS = 253402300799 * 10**9  # 9999-12-31 23:59:59 UTC, the last time datetime shows
# Reopening an open file by its /proc name pins a version's files (Linux only).
_PINNING = Path("/proc/self/fd").is_dir()


def _ignore(stage: str) -> None:
    pass


# Called with the name of each stage of a save: "writing" and "written" on every rank ("staging"
# first for a save with blocking=False, which calls "written" on its background thread), then
# "manifest", ("moved-aside" where the commit cannot swap), "committed", "discarding" on rank
# 0. Crash tests replace it to kill the process there; nothing else should.
stage_hook: Callable[[str], None] = _ignore

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# What renameat2 answers where the kernel, the C library or the file system cannot swap.
_NO_SWAP = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


@cache
def _renameat2() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library older than glibc 2.28
        return None
    # (directory, path) of the source, (directory, path) of the destination, flags
    function.argtypes = (ctypes.c_int, ctypes.c_char_p) * 2 + (ctypes.c_uint,)
    function.restype = ctypes.c_int
    return function


def _swap(first: Path, second: Path) -> bool:
    """Exchange two directories' names in one atomic step; False where that is not possible.

    Raises:
        OSError: the swap was possible but failed (a permission, a vanished directory).
    """
    function = _renameat2()
    if function is None:
        return False
    result = function(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_SWAP:
        return False
    raise OSError(code, os.strerror(code), os.fspath(first), None, os.fspath(second))


# How a commit exchanges the new version with the previous one. Tests replace it with one that
# answers False to exercise the two renames of a file system that cannot swap; nothing else should.
swap: Callable[[Path, Path], bool] = _swap


@attrs.frozen
class Found:
    """A complete checkpoint: its directory and its manifest.

    ``opened`` names, while `pinned`, where each of its files can be read
    again through the descriptor this process holds (``/proc/self/fd/N``);
    other files, or all of them when not pinned, are read in the directory.
    """

    directory: Path
    manifest: dict[str, Any]
    opened: Mapping[str, Path] = attrs.field(factory=dict)

    def path_of(self, name: str) -> Path:
        """Return where to read the checkpoint's file ``name``."""
        return self.opened.get(name, self.directory / name)


def temporary(target: Path) -> Path:
    """Return a new name for the directory a save to ``target`` writes to before it commits."""
    return target.with_name(f"{target.name}{_TMP}{secrets.token_hex(6)}")


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


_IMPORT = "sg.checkpoint.import_weights(path, module, ctx)"
WEIGHT_FILES = {".pt": "pt", ".pth": "pt", ".bin": "pt", ".safetensors": "safetensors"}
"""The files `stratagem.checkpoint.weights` reads and writes, by suffix, and their formats."""


def unreadable(directory: Path, what: str) -> CheckpointError:
    """Return the error of a load that found ``directory`` unreadable: ``what`` says why."""
    return CheckpointError(f"load: {os.fspath(directory)!r} is not a readable checkpoint: {what}.")


def _a_file(path: Path) -> CheckpointError:
    hint = (
        f"; to read weights from it, use {_IMPORT}" if path.suffix.lower() in WEIGHT_FILES else ""
    )
    return unreadable(path, f"it is a file; a checkpoint is a directory{hint}")


def _read_small(path: Path, limit: int) -> bytes:
    """Read a regular file of at most ``limit`` bytes, never through a link, never blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as file:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if status.st_size > limit:
            raise OSError(errno.EFBIG, f"{status.st_size} bytes, more than {limit}")
        return file.read(limit)


def read_manifest(directory: Path, shown: Path | None = None) -> dict[str, Any]:
    """Return the manifest of a complete checkpoint, after checking every file it lists.

    Errors name ``shown`` (default ``directory``): ``directory`` may be a
    ``/proc`` name of a directory this process holds open.

    Raises:
        CheckpointError: no manifest, a malformed one (or not a regular file,
            or too large), or a listed file that is missing or has another
            size than when it was written (truncated).
    """
    named = directory if shown is None else shown

    def bad(what: str) -> CheckpointError:  # what is wrong with the manifest
        return unreadable(named, f"{MANIFEST} {what}")

    try:
        text = _read_small(directory / MANIFEST, _MAX_MANIFEST).decode("utf-8")
    except FileNotFoundError:
        hint = (
            f"; it is a sharded safetensors export: read it with {_IMPORT}"
            if (directory / INDEX).exists()
            else ""
        )
        raise unreadable(
            named, f"it has no {MANIFEST} (not a stratagem checkpoint){hint}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:  # a link, a FIFO, a device, huge or not text
        reason = error.strerror if isinstance(error, OSError) else "not UTF-8 text"
        raise bad(f"is not a manifest ({reason})") from None
    try:
        manifest = json.loads(text)
    except ValueError as error:
        raise bad(f"is not valid JSON ({error})") from None
    except RecursionError:
        raise bad("is nested deeper than Python can read (a crafted file)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise bad(f"does not describe a {FORMAT} checkpoint")
    when = manifest.get("saved_at_ns")
    if isinstance(when, bool) or not isinstance(when, int):
        raise bad("does not say when it was saved")
    if not 0 <= when <= _LAST_NS:
        raise bad(
            f"gives saved_at_ns {when}, not a time from 1970 to 9999 (a crafted or corrupt file)"
        )
    world = manifest.get("world_size")
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= _MAX_WORLD:
        raise bad(
            f"gives world_size {world!r}, not a number of ranks from 1 to {_MAX_WORLD} "
            "(a crafted or corrupt file)"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files:
        raise bad("lists no files")
    checksums = manifest.get("checksums", {})
    if not isinstance(checksums, dict) or not all(
        name in files and isinstance(value, int) for name, value in checksums.items()
    ):
        raise bad("has malformed checksums")
    for name, size in files.items():
        if not isinstance(name, str) or "/" in name or "\\" in name or name in {"", ".", ".."}:
            raise bad(f"lists a file outside it ({name!r})")
        try:
            status = (directory / name).lstat()
        except FileNotFoundError:
            raise unreadable(named, f"{name} is missing") from None
        if not stat.S_ISREG(status.st_mode):
            raise unreadable(named, f"{name} is not a regular file")
        actual = status.st_size
        if actual != size:
            raise unreadable(named, f"{name} has {actual} bytes, {size} when written (truncated?)")
    return manifest


def checksum(path: Path) -> int:
    """Return the CRC-32 of the file at ``path``."""
    value = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def verify(found: Found) -> None:
    """Check every file the manifest has a checksum for (checkpoints saved with ``checksums``).

    Raises:
        CheckpointError: a file's bytes changed since it was written (a flipped bit).
    """
    for name, expected in found.manifest.get("checksums", {}).items():
        if checksum(found.path_of(name)) != expected:
            raise unreadable(
                found.directory,
                f"{name} does not match the checksum written with it (its bytes changed "
                "since the save: a disk or copy error); load an earlier checkpoint",
            )


@contextlib.contextmanager
def pinned(directory: Path) -> Iterator[Found]:
    """Inside, read the checkpoint in ``directory`` through files this process holds open.

    A save may meanwhile rename the directory aside and remove it: reads still
    get this version's bytes, never the next version's. Without
    ``/proc/self/fd`` (not Linux) the directory is read by its name.

    Raises:
        FileNotFoundError: ``directory`` (or one of its files) is gone (a save replaced it).
        CheckpointError: it is not a complete checkpoint.
    """
    if not _PINNING:
        yield Found(directory, read_manifest(directory))
        return
    try:
        directory_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except NotADirectoryError:
        raise _a_file(directory) from None
    with contextlib.ExitStack() as held:
        held.callback(os.close, directory_fd)
        pinned_directory = Path(f"/proc/self/fd/{directory_fd}")
        opened: dict[str, Path] = {}
        try:
            manifest = read_manifest(pinned_directory, shown=directory)
            for name in manifest["files"]:
                fd = os.open(pinned_directory / name, os.O_RDONLY | os.O_NOFOLLOW)
                held.callback(os.close, fd)
                opened[name] = Path(f"/proc/self/fd/{fd}")
        except (CheckpointError, FileNotFoundError):
            if not (pinned_directory / MANIFEST).exists():  # a save is removing this version
                raise FileNotFoundError(f"load: {os.fspath(directory)!r} was removed") from None
            raise
        yield Found(directory, manifest, opened=opened)


def _found(directories: Iterable[Path]) -> list[Found]:
    """Return the complete checkpoints among ``directories``; the others are passed over."""
    found = []
    for directory in directories:
        with contextlib.suppress(CheckpointError):
            found.append(Found(directory, read_manifest(directory)))
    return found


def _is_checkpoint(directory: Path) -> bool:
    return bool(_found([directory]))


def _siblings(target: Path, marker: str) -> list[Path]:
    prefix = f"{target.name}{marker}"
    with contextlib.suppress(FileNotFoundError):
        return [
            p for p in target.parent.iterdir() if p.name.startswith(prefix) and not p.is_symlink()
        ]
    return []


def _newest(directories: list[Path]) -> Found | None:
    return max(_found(directories), key=order, default=None)


def order(found: Found) -> tuple[int, int]:
    """Return the key that sorts checkpoints oldest first: their sequence, then their time.

    Each commit writes ``sequence``, one more than the largest beside it, so a
    clock that ran ahead in an earlier job cannot make an older checkpoint
    look newer. Checkpoints of versions before it have none (0): they sort
    among themselves by ``saved_at_ns``, and before every newer one.
    """
    sequence = found.manifest.get("sequence", 0)
    return sequence if validators.is_int(sequence) else 0, found.manifest.get("saved_at_ns", 0)


def _next_sequence(parent: Path) -> int:
    """Return one more than the largest ``sequence`` of a checkpoint in ``parent``."""
    largest = 0
    with contextlib.suppress(OSError):
        for child in parent.iterdir():
            with contextlib.suppress(OSError, ValueError, RecursionError):
                if child.is_symlink() or not child.is_dir():
                    continue
                manifest = json.loads(_read_small(child / MANIFEST, _MAX_MANIFEST))
                value = manifest.get("sequence") if isinstance(manifest, dict) else None
                if isinstance(value, int) and not isinstance(value, bool) and value < _MAX_COUNT:
                    largest = max(largest, value)
    return largest + 1


def resolve(target: Path) -> Found:
    """Return the checkpoint that ``target`` names: itself, or the previous one a save moved aside.

    Raises:
        FileNotFoundError: there is no checkpoint at ``target``.
        CheckpointError: ``target`` is not a complete, unaltered checkpoint.
    """
    if target.exists():
        if not target.is_dir():
            raise _a_file(target)
        return Found(target, read_manifest(target))
    previous = _newest(_siblings(target, _OLD))
    if previous is None:
        raise FileNotFoundError(f"load: no checkpoint at {os.fspath(target)!r}.")
    return previous


def exists(path: str | os.PathLike[str]) -> bool:
    """Return whether ``path`` names a checkpoint that `load` would read.

    Use it instead of ``os.path.exists(path)``: where a save was interrupted
    between the two renames of a file system that cannot swap directories,
    the previous checkpoint is kept beside ``path`` (``path.old-*``) and there
    is nothing at ``path`` itself until the next save puts it back.

    Returns:
        True for a complete checkpoint at ``path`` (or kept beside it); False
        when there is none, or ``path`` is an empty directory.

    Raises:
        UsageError: ``path`` is not a str or path-like.
        CheckpointError: ``path`` holds something that is not a complete,
            unaltered checkpoint (loading it would fail; starting afresh would
            hide that).

    Example:
        >>> import tempfile, torch, stratagem as sg
        >>> path = tempfile.mkdtemp() + "/snapshot"
        >>> sg.checkpoint.exists(path)
        False
        >>> ctx = sg.single_device("cpu").setup(sg.Env())
        >>> sg.checkpoint.save(path, {"model": torch.nn.Linear(2, 1), "epoch": 4}, ctx)
        >>> sg.checkpoint.exists(path)
        True
    """
    target = Path(path_text(path, "exists", "path"))
    if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
        return False
    try:
        resolve(target)
    except FileNotFoundError:
        return False
    return True


def discard(directory: Path) -> None:
    """Remove a checkpoint directory, its manifest first, so a partial removal is never read.

    A symbolic link is never followed: the link goes, what it points at stays.
    """
    if directory.is_symlink():
        directory.unlink()
        return
    if _TMP not in directory.name:
        # Renamed first: a removal killed half way leaves a temporary name, which the next
        # commit beside it removes, never a checkpoint's name on a directory without a manifest.
        doomed = temporary(directory)
        try:
            os.rename(directory, doomed)
        except FileNotFoundError:
            return
        directory = doomed
    with contextlib.suppress(FileNotFoundError):
        (directory / MANIFEST).unlink()
    stage_hook("discarding")
    shutil.rmtree(directory, ignore_errors=True)


def _replaceable(target: Path) -> None:
    if target.is_symlink():
        raise CheckpointError(
            f"save: {os.fspath(target)!r} is a symbolic link; a save replaces the directory at "
            "its path and never writes through a link. Save to the directory it points at."
        )
    if not target.exists():
        return
    if target.is_dir() and (not any(target.iterdir()) or _is_checkpoint(target)):
        return
    raise CheckpointError(
        f"save: {os.fspath(target)!r} exists and is not a stratagem checkpoint; "
        "save elsewhere, or remove it first."
    )


# The lock each save to a path holds, by its temporary directory (rank 0 only).
_held: dict[Path, int] = {}


def _lock_path(target: Path) -> Path:
    return target.with_name(f"{target.name}{_LOCK}")


def _lock(lock: Path, tries: int) -> tuple[int, bool]:
    """Open ``lock`` (made if absent) and lock it: its descriptor, and whether it is now held.

    The holder before us may have removed the file after we opened it: the
    one at the path is locked, or two savers would each hold a lock of their own.
    """
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        if not _locked_soon(fd, tries):
            return fd, False
        if _still_at(fd, lock):
            return fd, True
        os.close(fd)


def _locked_soon(fd: int, tries: int) -> bool:
    """Lock ``fd``, trying ``tries`` times 10 ms apart while its holder has not named itself.

    A save names itself just after it locks; a commit cleaning beside it
    (`_sweep`) holds a lock for a moment and names nobody.
    """
    for attempt in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if attempt == tries - 1 or os.pread(fd, 1, 0):
                return False  # the last try, or a save holds it
            time.sleep(0.01)
        else:
            return True
    return False


def _claim(target: Path) -> int:
    """Take the exclusive lock of saves to ``target``, or say who holds it.

    Raises:
        CheckpointError: another live process holds it.
    """
    lock = _lock_path(target)
    if lock.is_symlink():
        raise CheckpointError(
            f"save: {os.fspath(lock)!r} is a symbolic link, and the lock of saves to "
            f"{os.fspath(target)!r} is never taken through a link; remove the link (no save "
            "holds it) and save again."
        )
    fd, held = _lock(lock, tries=100)  # up to a second
    if not held:
        owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        os.close(fd)
        owner = owner or "a process that has not yet written its pid"
        raise CheckpointError(
            f"save: another save to {os.fspath(target)!r} is writing it ({owner}); two "
            "saves to one path would overwrite each other's files. Let it finish, or save "
            "to another path."
        ) from None
    owner = f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%H:%M:%S')}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner.encode(), 0)
    return fd


def _still_at(fd: int, lock: Path) -> bool:
    """Whether ``fd`` is the file at ``lock``.

    Its holder may have removed it, and no one made another yet: then it is not.
    """
    try:
        return os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False))
    except FileNotFoundError:
        return False


def _put_back(target: Path) -> None:
    """Rename the previous version an interrupted commit moved aside back to ``target``.

    Only under the lock, so no live save is between its renames. Until the
    new version is committed, ``target`` then names the only complete version
    again, rather than a ``.old-`` name the next commit would remove.
    """
    if target.exists() or target.is_symlink():
        return
    previous = _newest(_siblings(target, _OLD))
    if previous is not None:
        os.rename(previous.directory, target)
        _fsync_directory(target.parent)


def begin(target: Path) -> Path:
    """Lock saves to ``target`` and make the directory this one writes to (rank 0).

    Raises:
        CheckpointError: another save to ``target`` is running, or ``target``
            is a link or holds something other than a checkpoint.
    """
    try:
        _writable_parent(target)
        fd = _claim(target)
        try:
            _put_back(target)
            _replaceable(target)
            tmp = temporary(target)
            tmp.mkdir()
        except BaseException:
            _unlock(_lock_path(target), fd)
            raise
    except PermissionError as error:
        raise _denied(error, target) from None
    _held[tmp] = fd
    return tmp


def _writable_parent(target: Path) -> None:
    """Make ``target``'s parent directories, or say in one line why they cannot be.

    Raises:
        CheckpointError: an ancestor is a file or a link that leads nowhere (a
            loop), or the parent is itself a checkpoint (which a prune or a
            save replacing it would remove, with whatever it holds).
    """
    ancestor = next(a for a in target.parents if os.path.lexists(a))  # the nearest that exists
    if not ancestor.is_dir():
        what = "a link that leads nowhere" if ancestor.is_symlink() else "a file"
        raise CheckpointError(
            f"save: {os.fspath(ancestor)!r} is not a directory ({what}), so "
            f"{os.fspath(target)!r} cannot be made under it; remove it, or save elsewhere."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    if (target.parent / MANIFEST).exists():
        raise CheckpointError(
            f"save: {os.fspath(target.parent)!r} is a checkpoint, and a checkpoint inside "
            "another is removed when that one is replaced or pruned; save beside it "
            f"({os.fspath(target.parent.parent / target.name)!r})."
        )


def _denied(error: PermissionError, target: Path) -> CheckpointError:
    where = Path(error.filename).parent if error.filename else target.parent
    # The nearest that exists is the one whose permissions refused.
    where = next((place for place in [where, *where.parents] if place.exists()), where)
    with contextlib.suppress(OSError):
        owner = where.stat().st_uid
        if owner != os.geteuid():
            return CheckpointError(
                f"save: no permission to write in {os.fspath(where)!r} (it belongs to uid "
                f"{owner}, this process runs as uid {os.geteuid()}); save where this user may "
                "write, or have its owner grant write access."
            )
    return CheckpointError(
        f"save: no permission to write in {os.fspath(where)!r} ({error.strerror}); save where "
        "this process may write, or grant it write access."
    )


def _release(tmp: Path, target: Path) -> None:
    fd = _held.pop(tmp, None)
    if fd is not None:
        _unlock(_lock_path(target), fd)


def _unlock(lock: Path, fd: int) -> None:
    # Removed while still locked: a saver that opened it meanwhile sees it is gone.
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    os.close(fd)


def abandon(tmp: Path, target: Path) -> None:
    """Remove a save's temporary directory and unlock ``target`` (rank 0, after a failure)."""
    try:
        discard(tmp)
    finally:
        _release(tmp, target)


def commit(tmp: Path, target: Path, manifest: dict[str, Any], keep_last: int | None) -> None:
    """Write the manifest into ``tmp``, swap ``tmp`` into ``target`` (rank 0, once all ranks wrote).

    The previous version (swapped out to ``tmp``) and leftovers of earlier
    saves (none of them live: this save holds the lock) go afterwards, and
    the lock with them.

    Raises:
        CheckpointError: ``target`` exists and is not a checkpoint (it is never replaced).
    """
    try:
        _replaceable(target)
        manifest = {
            **manifest,
            "format": FORMAT,
            "saved_at_ns": time.time_ns(),
            "sequence": _next_sequence(target.parent),
            "version": tmp.name.rsplit(_TMP, 1)[1],
            "files": {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()},
        }
        _write_manifest(tmp, manifest)
        stage_hook("manifest")
        if not target.exists():
            os.rename(tmp, target)
        # One atomic step puts the new version at target and the previous one at tmp (removed
        # below); a file system that cannot swap gets two renames, with a window between them.
        elif not swap(tmp, target):
            aside = target.with_name(f"{target.name}{_OLD}{manifest['version']}")
            os.rename(target, aside)
            stage_hook("moved-aside")
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(aside, target)  # put the previous checkpoint back
                raise
        _fsync_directory(target.parent)
        stage_hook("committed")
        for leftover in [*_siblings(target, _OLD), *_siblings(target, _TMP)]:
            discard(leftover)
        if keep_last is not None:
            _prune(target, keep_last)
        _sweep(target)
    finally:
        _release(tmp, target)


def _sweep(target: Path) -> None:
    """Remove what dead saves to other paths beside ``target`` left: locks, temporary directories.

    A save killed before its commit leaves ``name.lock`` and ``name.tmp-*``;
    a prune killed while removing leaves ``name.tmp-*``. Each ``name`` is
    cleaned under its own lock, taken without waiting, exactly as a save to
    it would clean: one a live process holds (a save writing) is left alone.
    A previous version moved aside (``name.old-*``) goes only once ``name``
    is a checkpoint again.
    """
    names = set()
    with contextlib.suppress(OSError):
        for child in target.parent.iterdir():
            left = _LEFTOVER.fullmatch(child.name)
            if left is not None:
                names.add(left.group(1))
            elif child.name.endswith(_LOCK) and _our_lock(child):
                names.add(child.name.removesuffix(_LOCK))
    for name in sorted(names - {target.name}):
        other = target.with_name(name)
        with contextlib.suppress(OSError, CheckpointError):
            lock = _lock_path(other)
            if lock.is_symlink():
                continue  # not ours to remove: a save to it says what is wrong
            fd, held = _lock(lock, tries=1)
            if not held:
                os.close(fd)
                continue  # a live save holds it
            try:
                leftovers = _siblings(other, _TMP)
                if _is_checkpoint(other):
                    leftovers += _siblings(other, _OLD)
                for leftover in leftovers:
                    discard(leftover)
            finally:
                _unlock(lock, fd)


# What a save leaves beside its path: PATH.tmp-<token>, PATH.old-<token> (token_hex(6)).
_LEFTOVER = re.compile(r"(.+)\.(?:tmp|old)-[0-9a-f]{12}")


def _our_lock(path: Path) -> bool:
    """Whether ``path`` is a lock file a save made: empty, or naming its holder's pid."""
    with contextlib.suppress(OSError):
        text = b"link" if path.is_symlink() else _read_small(path, 4096)
        return text == b"" or text.startswith(b"pid ")
    return False


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def disk_full(error: BaseException, target: Path) -> CheckpointError | None:
    """Return the error to raise when a save failed for want of space, else ``None``."""
    causes: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and len(causes) < 8:
        causes.append(seen)
        seen = seen.__cause__ or seen.__context__
    text = " ".join(str(c) for c in causes)
    with contextlib.suppress(OSError):
        status = os.statvfs(target.parent)
        if status.f_bavail == 0:
            text += " no space left"
    full = any(isinstance(c, OSError) and c.errno in _FULL for c in causes) or any(
        marker in text.lower() for marker in ("no space left", "quota exceeded", "unexpected pos")
    )
    if not full:
        return None
    kept = (
        f"the previous checkpoint at {os.fspath(target)!r} is intact"
        if target.exists()
        else f"nothing was written at {os.fspath(target)!r}"
    )
    return CheckpointError(
        f"save: the disk holding {os.fspath(target.parent)!r} is full (or a quota or file-size "
        f"limit was reached) while writing the checkpoint; {kept}, and this save's partial "
        f"files were removed. Free some space (keep_last= prunes old checkpoints) and save "
        f"again. ({error_line(error)})"
    )


def _checkpoints_in(directory: Path) -> list[Found]:
    # A link (a `latest` link, a link to another run) is never listed or pruned.
    children = [child for child in sorted(directory.iterdir()) if not child.is_symlink()]
    return _found(c for c in children if c.is_dir() and _TMP not in c.name and _OLD not in c.name)


def _prune(target: Path, keep_last: int) -> None:
    """Remove all but the ``keep_last`` newest checkpoints beside ``target`` (never ``target``)."""
    found = sorted(_checkpoints_in(target.parent), key=order)
    doomed = [f.directory for f in found[:-keep_last] if f.directory != target]
    for directory in doomed:
        discard(directory)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """Return the newest complete checkpoint in ``directory``, or ``None`` if it holds none.

    A checkpoint whose save was interrupted between its two renames counts
    under its own name (loading it gives the previous version).

    Raises:
        UsageError: ``directory`` is not a str or path-like, is a file or a
            link loop, or is itself a checkpoint (pass the directory holding it).
    """
    parent = run_directory(directory, "latest")
    if not parent.is_dir():
        return None
    found = _checkpoints_in(parent)
    for child in parent.iterdir():
        base = child.with_name(child.name.rsplit(_OLD, 1)[0])
        if _OLD in child.name and not child.is_symlink() and not base.exists():
            with contextlib.suppress(CheckpointError, FileNotFoundError):
                found.append(Found(base, resolve(base).manifest))
    newest = max(found, key=order, default=None)
    return None if newest is None else newest.directory


def path_text(value: object, function: str, name: str) -> str:
    """Return ``os.fspath(value)``, checked to be a non-empty path of text without a NUL byte.

    Raises:
        UsageError: ``value``, the argument ``name`` of ``function``, is not a
            non-empty str or a path-like of one (a path-like of bytes included),
            or holds a NUL byte.
    """
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text:
        wanted = "a str or os.PathLike of a str"
        raise validators.refusal(f"{function}: '{name}'", wanted, value)
    if "\0" in text:
        nul = f"{function}: '{name}' holds a NUL byte ({text!r}), which no file name may"
        raise UsageError(f"{nul}; pass the path without it.")
    return text


def checked_path(path: object, function: str) -> Path:
    """Return ``path`` as an absolute `Path`.

    Raises:
        UsageError: as `path_text`.
    """
    return Path(path_text(path, function, "path")).absolute()


def run_directory(directory: object, function: str) -> Path:
    """Return ``directory`` as a `Path`, checked to be where a run keeps its checkpoints.

    It need not exist yet.

    Raises:
        UsageError: as `path_text`, or it is a file or a link that leads
            nowhere, or is itself a checkpoint.
    """
    text = path_text(directory, function, "directory")
    parent = Path(text)
    if os.path.lexists(parent) and not parent.is_dir():
        what = "a link that leads nowhere" if parent.is_symlink() else "a file"
        raise UsageError(
            f"{function}: 'directory' {text!r} is {what}, not the directory of a run's "
            "checkpoints; pass that directory (it need not exist yet)."
        )
    if (parent / MANIFEST).exists():
        raise UsageError(
            f"{function}: 'directory' {text!r} is a checkpoint, not the directory holding a "
            f"run's checkpoints; pass its parent, {os.fspath(parent.absolute().parent)!r}."
        )
    return parent


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
    return error_line(error)


def read_metadata(found: Found) -> Metadata:
    """Read DCP's ``.metadata`` of ``found``, resolving only the classes metadata is made of.

    Raises:
        CheckpointError: the file names any other class or function (a
            tampered file), is truncated, or does not hold DCP metadata.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(found.path_of(".metadata"), "rb") as file:
        # The pure-Python unpickler looks find_class up on the instance, so it is
        # restricted without a subclass (house rule: no subclassing outside Protocols).
        unpickler = pickle._Unpickler(file)  # noqa: SLF001
        unpickler.find_class = _find_class  # type: ignore[method-assign]
        try:
            metadata = unpickler.load()
        except Exception as error:  # any failure means an unreadable file
            raise unreadable(
                found.directory,
                f"its .metadata cannot be read safely ({type(error).__name__}: {error})",
            ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.planner_data, dict):
        raise unreadable(
            found.directory, "its .metadata does not hold the metadata of a stratagem checkpoint"
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
