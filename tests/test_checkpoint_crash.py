"""A save killed at any point leaves a checkpoint that loads: the previous one, or the new one whole.

Killed processes are real: children that ``os._exit`` at a named stage of the
save (the test hook ``directory.stage_hook``), children SIGKILLed at arbitrary
moments while saving in a loop, and a rank of a 2-rank world that dies before
writing its shard.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import directory

pytestmark = pytest.mark.slow

CRASHED = 17
STAGES_BEFORE_COMMIT = ("writing", "written", "manifest", "moved-aside")
STAGES_AFTER_COMMIT = ("committed", "discarding")


def single() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def state_of(version: int, size: int = 64) -> dict[str, object]:
    """A checkpoint whose every part says which version it is."""
    model = torch.nn.Linear(size, size)
    with torch.no_grad():
        model.weight.fill_(version)
        model.bias.fill_(-version)
    return {"model": model, "version": version}


def loaded_version(path: Path, size: int = 64) -> int:
    model = torch.nn.Linear(size, size)
    values = sg.checkpoint.load(path, {"model": model}, single())
    version = values["version"]
    assert torch.all(model.weight == version) and torch.all(model.bias == -version), (
        "a mixed checkpoint"
    )
    return version


def exit_at(stage: str):
    def hook(reached: str) -> None:
        if reached == stage:
            os._exit(CRASHED)

    return hook


def save_and_die_at(path: str, stage: str) -> None:
    if stage == "moved-aside":  # only reached where the file system cannot swap directories
        directory.swap = lambda first, second: False
    directory.stage_hook = exit_at(stage)
    sg.checkpoint.save(path, state_of(2), single())
    os._exit(0)  # the stage was never reached


def save_forever(path: str, size: int) -> None:
    for version in range(2, 10_000):
        sg.checkpoint.save(path, state_of(version, size), single())


def leftovers(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_a_save_killed_at_each_stage_leaves_a_whole_checkpoint(tmp_path, processes):
    stages = STAGES_BEFORE_COMMIT + STAGES_AFTER_COMMIT
    paths = {stage: tmp_path / stage / "ckpt" for stage in stages}
    for path in paths.values():
        sg.checkpoint.save(path, state_of(1), single())
    children = {
        stage: processes.Process(target=save_and_die_at, args=(str(paths[stage]), stage))
        for stage in stages
    }
    for child in children.values():
        child.start()
    for stage, child in children.items():
        child.join(120)
        assert child.exitcode == CRASHED, f"{stage}: the child did not die there ({child.exitcode})"
    for stage, path in paths.items():
        expected = 1 if stage in STAGES_BEFORE_COMMIT else 2
        assert loaded_version(path) == expected, stage
        assert sg.checkpoint.latest(path.parent) == path, stage
        if stage == "moved-aside":  # the only window without a directory at path
            assert not path.exists() and [n for n in leftovers(path) if ".old-" in n]
    for stage, path in paths.items():  # the next save succeeds and clears what the crash left
        sg.checkpoint.save(path, state_of(3), single())
        assert loaded_version(path) == 3, stage
        assert leftovers(path) == [], stage


def test_saves_sigkilled_at_arbitrary_moments_leave_a_whole_checkpoint(tmp_path, processes):
    size = 512  # 1 MiB of weights: a kill often lands while files are being written
    delays = (0.2, 0.45, 0.7, 0.95, 1.2, 1.6)  # writing, metadata, manifest, renames, cleanup
    paths = [tmp_path / f"run{i}" / "ckpt" for i in range(len(delays))]
    for path in paths:
        sg.checkpoint.save(path, state_of(1, size), single())
    children = [processes.Process(target=save_forever, args=(str(p), size)) for p in paths]
    for child in children:
        child.start()
    for path, child, delay in zip(paths, children, delays, strict=True):
        # Wait until the child is saving (it has left a temporary directory), then kill it.
        deadline = time.monotonic() + 120
        while not any(".tmp-" in n for n in leftovers(path)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
        assert child.exitcode == -signal.SIGKILL
    for path in paths:
        assert loaded_version(path, size) >= 1  # whichever version, whole
        sg.checkpoint.save(path, state_of(0, size), single())
        assert loaded_version(path, size) == 0
        assert leftovers(path) == []


def rank_one_dies_writing(strategy, ctx, path: str) -> None:
    model = strategy.wrap(torch.nn.Linear(4, 4), ctx)
    with torch.no_grad():
        sg.unwrap(model).weight.fill_(1)
    strategy.save(path, {"model": model, "version": 1}, ctx)
    with torch.no_grad():
        sg.unwrap(model).weight.fill_(2)
    if ctx.rank == 1:
        directory.stage_hook = exit_at("writing")
    strategy.save(path, {"model": model, "version": 2}, ctx)


def test_a_rank_dying_before_it_wrote_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(sg.RankError):
        sg.launch(
            rank_one_dies_writing,
            sg.ddp_spawn(start=sg.Spawn(stop_grace=2), device="cpu"),
            devices=2,
            args=(str(path),),
        )
    model = torch.nn.Linear(4, 4)
    assert sg.checkpoint.load(path, {"model": model}, single()) == {"version": 1}
    assert torch.all(model.weight == 1)
