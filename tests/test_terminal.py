"""An interactive spawned run ends cleanly in a terminal (issue 34, item 4).

Reported: after the prompt returned, ``resource_tracker: There appear to be 1 leaked
semaphore objects to clean up at shutdown`` (tqdm's lock, in ranks that leave through
``os._exit``). Output to a file was clean, which is why no test saw it: this one runs
under a pseudo-terminal and reads until the last process holding it (the tracker) is gone.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "tqdm_ranks.py"


def run_in_terminal(command: list[str], timeout: float = 120.0) -> str:
    main, terminal = os.openpty()
    try:
        process = subprocess.Popen(command, stdin=terminal, stdout=terminal, stderr=terminal)
    finally:
        os.close(terminal)  # the children hold it now; EOF once the last one is gone
    output, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not chunk:
                break
            output += chunk
        else:
            process.kill()
            pytest.fail(f"still writing after {timeout} s:\n{output.decode(errors='replace')}")
    finally:
        os.close(main)
    assert process.wait(30) == 0, output.decode(errors="replace")
    return output.decode(errors="replace")


def test_a_spawned_run_with_tqdm_leaks_no_semaphore_in_a_terminal():
    pytest.importorskip("tqdm")
    output = run_in_terminal([sys.executable, str(SCRIPT)])
    assert "[0, 1]" in output
    assert "leaked semaphore" not in output, output
    assert "resource_tracker" not in output, output
