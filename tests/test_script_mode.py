"""Scripts stay scripts: a top-level loop under torchrun (``sg.joined``), and module-level code.

The user's report: ``sg.launch`` forces the loop into a function, and under spawning the
configuration printed three times.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

import stratagem as sg
from helpers import agent_env, free_port

SCRIPTS = Path(__file__).parent / "scripts"


def test_joined_sets_up_and_tears_down_around_the_block():
    left, seen = [], []
    strategy = sg.single_device("cpu")
    recording = attrs.evolve(strategy, teardown=left.append)

    def body() -> None:
        with sg.joined(recording, env=sg.Env()) as ctx:
            seen.append(ctx)
            raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        body()
    assert seen[0].world_size == 1 and seen[0].device == torch.device("cpu")
    assert left == seen, "teardown runs when the block raises"
    with pytest.raises(sg.UsageError, match=r"joined: 'strategy' must be a Strategy"):
        sg.joined(object()).__enter__()
    with pytest.raises(sg.UsageError, match=r"joined: 'env' must be an Env"):
        sg.joined(strategy, env={"RANK": "0"}).__enter__()
    with pytest.raises(sg.UsageError, match=r"'ddp_spawn' spawns its ranks.*under torchrun"):
        sg.joined(sg.ddp_spawn(device="cpu"), env=sg.Env()).__enter__()


@pytest.mark.slow
def test_a_top_level_loop_runs_under_torchrun(tmp_path):
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(SCRIPTS / "toplevel_train.py"), str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(
        command, env=agent_env(tmp_path), capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(row["rank"], row["world"]) for row in rows] == [(0, 2), (1, 2)]
    assert rows[0]["losses"] == rows[1]["losses"] and rows[0]["w"] == rows[1]["w"]
    assert done.stdout.count("configuration: steps 3") == 2, "once per process torchrun started"
    assert done.stdout.count("left the world False") == 2, "teardown ran at the block's end"


@pytest.mark.slow
def test_spawned_ranks_run_module_level_code_again_but_not_the_main_guard(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "spawn_module_level.py")],
        env=agent_env(tmp_path), capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("module level in pid") for line in lines) == 3  # parent + 2 ranks
    assert lines.count("main guard") == 1
    assert "ranks [0, 1]" in lines
