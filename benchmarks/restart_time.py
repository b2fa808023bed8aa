"""restart_time: from a rank's SIGKILL to the restarted world's first training step, under torchrun.

torchrun (``--max-restarts 2``, c10d rendezvous on 127.0.0.1, 2 ranks)
runs ``tests/resumable.py``; rank 1 of the first attempt notes the time and
SIGKILLs itself at step 10. torchrun notices (``--monitor-interval``), stops
rank 0, starts a new world, which joins, calls ``resume_or_start`` and
trains. Reported: kill to the first resumed step, and, inside that, the
part after the restarted world joined (finding and loading the checkpoint,
wrapping, the first step). The rest is torchrun noticing, stopping and
starting processes, their imports, and the rendezvous.

There is no hand-written side to pair with: a loop without stratagem has no
automatic resume. The figure is absolute, against a fresh run's start-up.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import torch

from benchmarks.report import Result, compare

NAME = "restart_time"
DESCRIPTION = "kill of a rank to the restarted world's first step under torchrun --max-restarts."
SCRIPT = Path(__file__).resolve().parent.parent / "tests" / "resumable.py"
MONITOR_INTERVAL = 0.5


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def once(root: Path) -> tuple[float, float]:
    run, out = root / uuid.uuid4().hex[:8], root / f"{uuid.uuid4().hex[:8]}.pt"
    lib = str(Path(__file__).resolve().parent.parent / "lib")
    env = {**os.environ, "PYTHONPATH": lib, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            "--max-restarts=2",
            f"--monitor-interval={MONITOR_INTERVAL}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{_port()}",
            f"--rdzv-id=bench-{uuid.uuid4().hex[:8]}",
            str(SCRIPT),
            str(run),
            str(out),
            "--steps=16",
            "--every=4",
            "--die-at=10",
        ],
        env=env,
        text=True,
        timeout=600,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed ({done.returncode}):\n{done.stdout[-3000:]}")
    killed = float((run / "killed_at").read_text())
    result = torch.load(out, weights_only=True)
    assert result["resumed_from"] == 8, result["resumed_from"]
    return result["first_step_at"] - killed, result["first_step_at"] - result["started"]


def run(quick: bool = False) -> Result:
    rounds = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="stratagem-bench-") as scratch:
        measured = [once(Path(scratch)) for _ in range(rounds)]
    total = [m[0] for m in measured]
    own = [m[1] for m in measured]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={"rounds": rounds, "monitor_interval_s": MONITOR_INTERVAL, "ranks": 2},
        cases=[
            compare(
                "kill to first resumed step",
                "s",
                total,
                own,
                notes="plain = after the restarted world joined: resume_or_start, wrap, first step",
            )
        ],
        quick=quick,
    )
