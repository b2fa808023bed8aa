"""Nothing reads or writes outside the paths the user gave, checked with audit hooks.

A fresh interpreter runs tests/scripts/paths_workflow.py (one-device training
traced to a file, checkpoints saved, replaced, pruned, loaded, described and
listed, then a 2-rank ``ddp_spawn`` launch that trains and saves) with
tests/scripts/audit/sitecustomize.py on PYTHONPATH, so that it and every
process it spawns record their file-system events (PEP 578 audit hooks; the
hooks never touch pytest's process). HOME, TMPDIR and the working directory
are fresh, empty directories, and must stay empty.

What the hooks cannot see: files opened by native code (gloo, the TCP store,
C++ parts of torch) raise no audit event; that they leave HOME, TMPDIR and the
working directory untouched is checked by looking.

One exception, not stratagem's: importing ``torch._dynamo`` (which
``torch.optim`` does on first use, in any PyTorch program) creates torch's
inductor cache directory, by default under TMPDIR. The test gives it a
directory of its own with TORCHINDUCTOR_CACHE_DIR and allows exactly that
``mkdir``, nothing inside it. Python's bytecode cache is off
(PYTHONDONTWRITEBYTECODE): writing ``.pyc`` files next to the sources is the
interpreter's doing, not the library's.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest

import stratagem

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LIB = Path(stratagem.__file__).resolve().parent.parent

_WRITING_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Events that only read (or look): everything else in the log changes the file system.
_READING_EVENTS = {"os.listdir", "os.scandir", "os.chdir"}


def writes(event: dict[str, Any]) -> bool:
    if event["event"] == "open":
        _, mode, flags = event["args"]
        if isinstance(mode, str):  # open(): the mode says it
            return any(letter in mode for letter in "wax+")
        return bool(flags & _WRITING_FLAGS)  # os.open(): the flags do
    return event["event"] not in _READING_EVENTS


def under(path: str, *roots: Path | str) -> bool:
    return any(path == str(root) or path.startswith(f"{root}{os.sep}") for root in roots)


def python_roots() -> set[str]:
    """Where the interpreter, the standard library and installed packages live."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {p for p in sysconfig.get_paths().values() if p}
    return {os.path.realpath(r) for r in roots} | roots


def run_workflow(tmp_path: Path) -> tuple[dict[str, Path], list[dict[str, Any]]]:
    places = {name: tmp_path / name for name in ("user", "home", "tmp", "cwd", "torch", "log")}
    for place in places.values():
        place.mkdir()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(places["home"]),
        "TMPDIR": str(places["tmp"]),
        "TORCHINDUCTOR_CACHE_DIR": str(places["torch"]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "AUDIT_LOG_DIR": str(places["log"]),
        "PYTHONPATH": os.pathsep.join([str(SCRIPTS / "audit"), str(LIB)]),
        "OMP_NUM_THREADS": "1",  # three processes on a small machine: no thread pile-up
    }
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            str(SCRIPTS / "paths_workflow.py"),
            str(places["user"]),
            "--spawn",
        ],
        cwd=places["cwd"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "done"
    logs = sorted(places["log"].iterdir())
    assert len(logs) >= 3, logs  # the workflow's process and its two ranks
    events = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    return places, events


def test_files_are_written_only_where_the_user_said_and_read_only_from_python(tmp_path):
    places, events = run_workflow(tmp_path)
    user = places["user"]

    written = [(e["event"], path) for e in events if writes(e) for path in e["paths"]]
    inside = [path for _, path in written if under(path, user)]
    # The workflow's writes are seen: the trace, a save's files beside its target (rank 1's
    # own among them), the rename into place.
    assert str(user / "trace.jsonl") in inside
    assert fnmatch.filter(inside, f"{user}/checkpoints/b.tmp-*/stratagem.json")
    assert fnmatch.filter(inside, f"{user}/ddp/checkpoints/b.tmp-*/__1_0.distcp")
    renamed = [e["paths"][1] for e in events if e["event"] == "os.rename"]
    assert str(user / "ddp" / "checkpoints" / "b") in renamed
    pipe = "pipe:["  # anonymous: multiprocessing hands a spawned rank its start-up data
    elsewhere = [
        (event, path)
        for event, path in written
        if not under(path, user)
        and not path.startswith(pipe)
        and (event, path) != ("os.mkdir", str(places["torch"]))  # torch's, see the docstring
    ]
    assert elsewhere == []

    allowed_reads = [
        *python_roots(),
        LIB,  # on sys.path: stratagem's modules, and its metadata that torch scans for plugins
        SCRIPTS,  # the workflow and the hook themselves
        user,
        places["cwd"],  # spawned ranks chdir to, and import from, the parent's directory
        "/proc",
        "/sys",
        "/dev",
    ]
    read_elsewhere = sorted(
        {
            path
            for e in events
            if not writes(e)
            for path in e["paths"]
            if not under(path, *allowed_reads) and not path.startswith(pipe)
        }
    )
    assert read_elsewhere == []

    libraries = {e["args"][0] for e in events if e["event"] == "ctypes.dlopen"}
    assert all(
        name is None or "/" not in name or under(name, *python_roots()) for name in libraries
    ), libraries
    binds = {tuple(e["args"][1]) for e in events if e["event"] == "socket.bind"}
    assert binds and all(host == "127.0.0.1" for host, _ in binds), binds  # the rendezvous

    for name in ("home", "tmp", "cwd", "torch"):
        assert list(places[name].iterdir()) == [], name
