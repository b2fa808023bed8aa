"""A 2-rank launch that runs until signalled: ``python interruptible.py PID_DIR [ignore]``.

Each rank writes its pid to PID_DIR, then sleeps in short naps (so Python
sees signals). With ``ignore``, ranks ignore SIGINT and SIGTERM, so only a
second signal to the launcher (which kills them) ends the run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import stratagem as sg


def wait_forever(strategy: sg.StrategyLike, ctx: sg.Context, pid_dir: str, ignore: bool) -> None:
    if ignore:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(pid_dir, f"rank{ctx.rank}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    ignore = len(sys.argv) > 2 and sys.argv[2] == "ignore"
    strategy = sg.ddp_spawn(
        start=sg.Spawn(stop_grace=60.0), device="cpu"
    )  # only a second signal is fast
    try:
        sg.launch(wait_forever, strategy, devices=2, args=(sys.argv[1], ignore))
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
