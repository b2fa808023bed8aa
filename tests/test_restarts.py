"""torchrun restarts a world that lost a rank, and the loop resumes where the last save left it.

Real torchrun agents (``--max-restarts 2``, a c10d rendezvous on 127.0.0.1)
run `tests/resumable.py`, whose rank 1 SIGKILLs itself at a chosen step of
the first attempt. The restarted world calls `resume_or_start`, finds the
newest complete checkpoint, and must end with parameters equal, bit for bit,
to a run that was never interrupted. ``GLOO_SOCKET_IFNAME`` is left unset:
stratagem names the loopback interface itself for a world on one host.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import resumable
import stratagem as sg
from helpers import agent_env, free_port

pytestmark = pytest.mark.slow

SCRIPT = Path(resumable.__file__)
TIMEOUT_S = 300.0


def torchrun(tmp_path: Path, name: str, *options: str) -> subprocess.CompletedProcess[str]:
    env = agent_env(tmp_path)
    del env["GLOO_SOCKET_IFNAME"]  # what this test shows stratagem sets for a one-host world
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--max-restarts=2",
        "--monitor-interval=0.5",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        f"--rdzv-id=stratagem-restart-{uuid.uuid4().hex[:12]}",
        f"--log-dir={tmp_path / f'{name}-logs'}",
        str(SCRIPT),
        str(tmp_path / name),
        str(tmp_path / f"{name}.pt"),
        *options,
    ]
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT_S:.0f} s\n{output}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, output)


def uninterrupted(tmp_path: Path, *extra: object) -> dict[str, torch.Tensor]:
    sg.launch(
        resumable.train,
        sg.ddp_spawn(device="cpu"),
        devices=2,
        args=(str(tmp_path / "whole"), str(tmp_path / "whole.pt"), 24, 4, *extra),
    )
    return torch.load(tmp_path / "whole.pt", weights_only=True)["parameters"]


def test_a_restarted_world_resumes_and_ends_bit_for_bit_where_an_uninterrupted_one_does(
    tmp_path,
):
    expected = uninterrupted(tmp_path)
    done = torchrun(tmp_path, "restarted", "--steps=24", "--every=4", "--die-at=10")
    assert done.returncode == 0, done.stdout
    assert (tmp_path / "restarted" / "killed_at").exists(), "rank 1 was never killed"
    assert "failed (exitcode: -9) local_rank: 1" in done.stdout, done.stdout  # then restarted
    result = torch.load(tmp_path / "restarted.pt", weights_only=True)
    assert result["resumed_from"] == 8  # the newest save before the kill at step 10
    assert result["parameters"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(result["parameters"][key], value), key


def test_a_rank_killed_during_a_background_save_resumes_from_the_save_before(tmp_path):
    expected = uninterrupted(tmp_path)
    done = torchrun(
        tmp_path,
        "killed",
        "--steps=24",
        "--every=4",
        "--die-at=12",
        "--die-in-save",
        "--background",
    )
    assert done.returncode == 0, done.stdout
    result = torch.load(tmp_path / "killed.pt", weights_only=True)
    assert result["resumed_from"] == 8  # the save at 12 was in flight: never committed
    for key, value in expected.items():
        assert torch.equal(result["parameters"][key], value), key


def test_a_run_saved_by_two_ranks_resumes_on_one(tmp_path):
    """``--nnodes MIN:MAX`` may restart a smaller world: the position is global, so it resumes."""
    run, out = str(tmp_path / "run"), str(tmp_path / "out.pt")
    sg.launch(resumable.train, sg.ddp_spawn(device="cpu"), devices=2, args=(run, out, 8, 4))
    resumed = sg.launch(
        resumable.train, sg.ddp_spawn(device="cpu"), devices=1, args=(run, out, 12, 4)
    )
    assert resumed == [8]
    assert sg.checkpoint.latest(tmp_path / "run" / "checkpoints").name == "step_0012"
