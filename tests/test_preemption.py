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


def test_sigterm_to_a_spawned_world_saves_a_last_checkpoint_and_exits_143(tmp_path):
    run, env = tmp_path / "run", agent_env(tmp_path)
    process = start(run, "spawn", env)
    signal_when_ready(process, run, signal.SIGTERM)
    code, output = finish(process)
    # The ranks raised Preempted; so does the launcher: 143, what the shell showed before too.
    assert code == 128 + signal.SIGTERM, output
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


def wait_for_pid(run: Path, rank: int) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while not (run / f"pid_{rank}").exists() or not (run / f"pid_{rank}").read_text():
        assert time.monotonic() < deadline, f"rank {rank} never wrote its pid"
        time.sleep(0.05)
    return int((run / f"pid_{rank}").read_text())


def test_sigterm_to_a_world_saving_in_the_background_keeps_its_last_checkpoint(tmp_path):
    # Before: exit 143 but no checkpoint at all (3 of 3): the launcher's second SIGTERM,
    # 0.1 s after the first, killed the ranks while they waited for the commit.
    run, env = tmp_path / "run", {**agent_env(tmp_path), "PREEMPTIBLE_BACKGROUND": "1"}
    process = start(run, "spawn", env)
    signal_when_ready(process, run, signal.SIGTERM)
    code, output = finish(process)
    assert code == 143, output
    stopped = int((run / "preempted_at").read_text())
    assert saved_step(run) == stopped >= 3
    assert not list((run / "checkpoints").glob("*.tmp-*")), "a save was left half done"


def test_slurm_s_sigusr1_to_a_spawn_launcher_requeues_after_a_last_checkpoint(tmp_path):
    # Before: the launcher died by the signal (rc -10), no checkpoint, no requeue.
    run, env = tmp_path / "run", {**agent_env(tmp_path), "SLURM_JOB_ID": "4242"}
    process = start(run, "spawn", env)
    signal_when_ready(process, run, signal.SIGUSR1)
    code, output = finish(process)
    assert code == REQUEUE == 75, output
    assert saved_step(run) == int((run / "preempted_at").read_text())


@pytest.mark.parametrize(
    ("signum", "slurm", "expected"),
    [(signal.SIGTERM, False, 143), (signal.SIGUSR1, True, REQUEUE)],
    ids=["sigterm", "sigusr1-under-slurm"],
)
def test_a_stop_signal_to_one_rank_only_ends_the_world_preempted(tmp_path, signum, slurm, expected):
    # Before: rc 1 and a RankError, which a scheduler reads as a failure, not "requeue".
    run, env = tmp_path / "run", agent_env(tmp_path)
    if slurm:
        env["SLURM_JOB_ID"] = "4242"
    process = start(run, "spawn", env)
    signal_when_ready(process, run, 0)  # only wait until it runs
    os.kill(wait_for_pid(run, 1), signum)
    code, output = finish(process)
    assert code == expected, output
    assert "RankError" not in output
    assert saved_step(run) == int((run / "preempted_at").read_text())
