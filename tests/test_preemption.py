"""A scheduler's stop signal: the step finishes, a last checkpoint is written, the exit code says so.

Real signals to real processes: SIGTERM to the launcher of a spawned 2-rank
world (which passes it on to the ranks), and SLURM's SIGUSR1 to a process
that SLURM would have started (``SLURM_JOB_ID`` set), which then exits with
`REQUEUE`. The checkpoint loads, and the next run resumes from it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from helpers import agent_env
from stratagem.preemption import REQUEUE

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "preemptible.py"
TIMEOUT_S = 180.0


def start(run: Path, mode: str, env: dict[str, str], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(run), mode, *extra],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the run did not end within {TIMEOUT_S:.0f} s after the signal\n{output}")
    return process.returncode, output


def signal_when_ready(process: subprocess.Popen[str], run: Path, signum: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not (run / "ready").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail(f"the run never got going\n{process.communicate()[0]}")
        time.sleep(0.05)
    os.kill(process.pid, signum)


def saved_step(run: Path) -> int:
    path = sg.checkpoint.latest(run / "checkpoints")
    assert path is not None, "no checkpoint was written at the signal"
    model = torch.nn.Linear(8, 2)
    values = sg.checkpoint.load(
        path, {"model": model}, sg.single_device("cpu").setup(sg.Env()), strict=False
    )
    return int(values["step"])


def test_sigterm_to_a_spawned_world_saves_a_last_checkpoint_and_ends_as_sigterm_does(tmp_path):
    run, env = tmp_path / "run", agent_env(tmp_path)
    process = start(run, "spawn", env)
    signal_when_ready(process, run, signal.SIGTERM)
    code, output = finish(process)
    assert code == -signal.SIGTERM, output  # the launcher ends as SIGTERM ends it (shell: 143)
    stopped = int((run / "preempted_at").read_text())
    assert saved_step(run) == stopped >= 3
    # The next run resumes where the signal stopped this one.
    code, output = finish(start(run, "spawn", env, str(stopped + 4)))
    assert code == 0, output
    assert int((run / "resumed_from").read_text()) == stopped


def test_slurm_s_signal_exits_with_the_requeue_code_after_a_last_checkpoint(tmp_path):
    run, env = tmp_path / "run", agent_env(tmp_path)
    env["SLURM_JOB_ID"] = "4242"  # as in a job's environment; one task, so no SLURM world
    process = start(run, "single", env)
    signal_when_ready(process, run, signal.SIGUSR1)
    code, output = finish(process)
    assert code == REQUEUE == 75, output
    assert saved_step(run) == int((run / "preempted_at").read_text())


def test_sigterm_outside_slurm_exits_143(tmp_path):
    run, env = tmp_path / "run", agent_env(tmp_path)
    process = start(run, "single", env)
    signal_when_ready(process, run, signal.SIGTERM)
    code, output = finish(process)
    assert code == 128 + signal.SIGTERM == 143, output
    assert saved_step(run) == int((run / "preempted_at").read_text())
