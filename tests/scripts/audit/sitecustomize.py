"""Record this process's file-system events (PEP 578 audit hooks) for tests/test_paths.py.

On PYTHONPATH, it is imported at start-up by every interpreter of the test:
the workflow's process and each process it spawns. Without AUDIT_LOG_DIR set
it does nothing. Each process appends one JSON line per event to
``<AUDIT_LOG_DIR>/<pid>.jsonl``, through a descriptor opened before the hook
exists and with ``os.write`` (which raises no audit event), so the log records
none of its own writes. Paths are made absolute in the process itself, where
its working directory and directory descriptors mean something.
"""

from __future__ import annotations

import json
import os
import sys

# Event -> (index of a path argument, index of its dir_fd argument or None), for each path.
PATHS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "open": ((0, None),),
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.listdir": ((0, None),),
    "os.scandir": ((0, None),),
    "os.chdir": ((0, None),),
    "shutil.rmtree": ((0, 1),),
    "shutil.copyfile": ((0, None), (1, None)),
    "shutil.move": ((0, None), (1, None)),
    "tempfile.mkstemp": ((0, None),),
    "tempfile.mkdtemp": ((0, None),),
}
OTHER = frozenset({"socket.bind", "ctypes.dlopen"})


def _descriptor_path(descriptor: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{descriptor}")
    except OSError:
        return f"<fd {descriptor}>"


def _absolute(path: object, dir_fd: object) -> str | None:
    if path is None:
        path = "."
    if isinstance(path, int):
        return _descriptor_path(path)
    text = os.fsdecode(os.fspath(path))  # type: ignore[arg-type]
    if not os.path.isabs(text):
        has_fd = isinstance(dir_fd, int) and dir_fd >= 0
        base = _descriptor_path(dir_fd) if has_fd else os.getcwd()  # type: ignore[arg-type]
        text = os.path.join(base, text)
    return os.path.normpath(text)


def _plain(value: object) -> object:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (bytes, os.PathLike)):
        return os.fsdecode(os.fspath(value))
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return repr(value)


def _install(directory: str) -> None:
    log = os.open(
        os.path.join(directory, f"{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
    )
    busy: list[bool] = []

    def hook(event: str, args: tuple[object, ...]) -> None:
        if busy or (event not in PATHS and event not in OTHER):
            return
        busy.append(True)
        try:
            paths = [
                _absolute(args[i], None if fd is None else args[fd])
                for i, fd in PATHS.get(event, ())
            ]
            record = {
                "pid": os.getpid(),
                "event": event,
                "paths": paths,
                "args": [_plain(a) for a in args],
            }
            os.write(log, json.dumps(record).encode() + b"\n")
        finally:
            busy.pop()

    sys.addaudithook(hook)


if os.environ.get("AUDIT_LOG_DIR"):
    _install(os.environ["AUDIT_LOG_DIR"])
