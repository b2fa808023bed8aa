"""A save's commit loses nothing complete, wherever the process is killed.

The DDP tutorial resumes with ``if os.path.exists(PATH): load(...)`` and then
saves to ``PATH`` every epoch. A save killed at any point of its commit must
leave ``PATH`` naming a complete checkpoint (the previous version or the new
one) where the file system can swap two directories atomically, so that
idiom resumes, and the next save never removes the only complete version.
Where it cannot swap (simulated here by a ``directory.swap`` that refuses, as
NFS does; the renames are real), ``sg.checkpoint.exists`` and a normal resume
still find the previous version, and the next save puts it back first.

Children are real processes that ``os._exit`` at a named stage of the save
(the test hook ``directory.stage_hook``, as in test_checkpoint_crash.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import directory

pytestmark = pytest.mark.slow

CRASHED = 17
BEFORE = ("writing", "written", "manifest")  # the previous version is the checkpoint
AFTER = ("committed", "discarding")  # the new version is
STAGES = {"swap": BEFORE + AFTER, "renames": (*BEFORE, "moved-aside", *AFTER)}


def single() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def snapshot(epochs_run: int) -> dict[str, object]:
    """The tutorial's snapshot: a model and the epochs run, every weight saying which."""
    model = torch.nn.Linear(8, 8)
    with torch.no_grad():
        model.weight.fill_(epochs_run)
    return {"MODEL_STATE": model, "EPOCHS_RUN": epochs_run}


def refuse_to_swap(first: Path, second: Path) -> bool:
    return False


def exit_at(stage: str):
    def hook(reached: str) -> None:
        if reached == stage:
            os._exit(CRASHED)

    return hook


def save_and_die_at(path: str, stage: str, mode: str, epochs_run: int) -> None:
    if mode == "renames":
        directory.swap = refuse_to_swap
    directory.stage_hook = exit_at(stage)
    sg.checkpoint.save(path, snapshot(epochs_run), single())
    os._exit(0)  # the stage was never reached


def tutorial_resume(path: Path, exists) -> int:
    """The tutorial's start: load the snapshot if ``exists(path)``, else start at epoch 0."""
    model = torch.nn.Linear(8, 8)
    if not exists(path):
        return 0
    epochs_run = sg.checkpoint.load(path, {"MODEL_STATE": model}, single())["EPOCHS_RUN"]
    assert torch.all(model.weight == epochs_run), "a mixed checkpoint"
    return epochs_run


def normal_resume(run: Path) -> int:
    strategy = sg.single_device("cpu")
    state = {"MODEL_STATE": torch.nn.Linear(8, 8), "EPOCHS_RUN": 0}
    return sg.resume_or_start(run, state, strategy, single())["EPOCHS_RUN"]


def kill_each(
    tmp_path: Path, processes, mode: str, previous: int | None, stages=None
) -> dict[str, Path]:
    """Save ``previous`` (unless None) at one path per stage, then a save dying at that stage."""
    stages = STAGES[mode] if stages is None else stages
    paths = {stage: tmp_path / mode / stage / "snapshot.pt" for stage in stages}
    if previous is not None:
        for path in paths.values():
            sg.checkpoint.save(path, snapshot(previous), single())
    children = {
        stage: processes.Process(target=save_and_die_at, args=(str(path), stage, mode, 5))
        for stage, path in paths.items()
    }
    for child in children.values():
        child.start()
    for child in children.values():
        child.join(120)
    return {s: paths[s] for s, child in children.items() if child.exitcode == CRASHED}


def stages_of_a_save(tmp_path: Path, mode: str, monkeypatch) -> list[str]:
    """The stages rank 0 passes in a save over a previous version, in order."""
    path = tmp_path / "trial" / mode / "snapshot.pt"
    sg.checkpoint.save(path, snapshot(1), single())
    reached: list[str] = []
    with monkeypatch.context() as patched:
        patched.setattr(directory, "stage_hook", reached.append)
        if mode == "renames":
            patched.setattr(directory, "swap", refuse_to_swap, raising=False)
        sg.checkpoint.save(path, snapshot(2), single())
    return list(dict.fromkeys(reached))


@pytest.mark.parametrize("mode", ["swap", "renames"])
def test_a_save_killed_anywhere_in_its_commit_loses_nothing_complete(
    tmp_path, processes, monkeypatch, mode
):
    stages = stages_of_a_save(tmp_path, mode, monkeypatch)
    killed = kill_each(tmp_path, processes, mode, previous=4, stages=stages)
    assert list(killed) == stages, "a save died elsewhere than at its stage"
    if mode == "renames":
        monkeypatch.setattr(directory, "swap", refuse_to_swap, raising=False)
    expected = {s: 4 if s in BEFORE or s == "moved-aside" else 5 for s in killed}
    for stage, path in killed.items():
        if mode == "swap":  # PATH always names a complete version: the tutorial's idiom works
            assert tutorial_resume(path, os.path.exists) == expected[stage], stage
        assert normal_resume(path.parent) == expected[stage], stage
        assert sg.checkpoint.latest(path.parent) == path, stage
    for stage, path in killed.items():
        assert sg.checkpoint.exists(path), stage
        assert tutorial_resume(path, sg.checkpoint.exists) == expected[stage], stage
        # The run goes on and saves its next epoch: nothing complete was lost.
        sg.checkpoint.save(path, snapshot(expected[stage] + 1), single())
        assert tutorial_resume(path, os.path.exists) == expected[stage] + 1, stage
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name], stage
    assert set(stages) == set(STAGES[mode])


def test_a_first_save_killed_in_its_commit_leaves_nothing_or_the_whole_new_one(tmp_path, processes):
    killed = kill_each(tmp_path, processes, "swap", previous=None)
    assert set(killed) == {*BEFORE, "committed"}, "a first save has nothing to discard"
    for stage, path in killed.items():
        expected = 0 if stage in BEFORE else 5
        assert sg.checkpoint.exists(path) == (stage == "committed"), stage
        assert normal_resume(path.parent) == expected, stage
        assert tutorial_resume(path, os.path.exists) == expected, stage


def test_where_the_file_system_swaps_a_save_never_leaves_path_empty(tmp_path):
    path = tmp_path / "snapshot.pt"
    sg.checkpoint.save(path, snapshot(1), single())
    reached = []
    directory.stage_hook = reached.append
    try:
        sg.checkpoint.save(path, snapshot(2), single())
    finally:
        directory.stage_hook = directory._ignore
    assert "moved-aside" not in reached
    assert reached[-3:] == ["manifest", "committed", "discarding"]


def test_a_version_moved_aside_is_put_back_before_the_next_save_writes(tmp_path, processes):
    # What a save interrupted between its two renames leaves (also any earlier stratagem's).
    path = kill_each(tmp_path, processes, "renames", previous=4, stages=["moved-aside"])[
        "moved-aside"
    ]
    assert not path.exists()
    assert tutorial_resume(path, sg.checkpoint.exists) == 4
    # The next save (which can swap) dies while its ranks write: PATH is the previous version.
    child = processes.Process(target=save_and_die_at, args=(str(path), "writing", "swap", 6))
    child.start()
    child.join(120)
    assert child.exitcode == CRASHED
    assert tutorial_resume(path, os.path.exists) == 4
    assert normal_resume(path.parent) == 4


def test_exists_says_whether_load_has_a_checkpoint_to_read(tmp_path):
    path = tmp_path / "snapshot.pt"
    assert sg.checkpoint.exists(path) is False
    path.mkdir()
    assert sg.checkpoint.exists(path) is False  # an empty directory: a save may use it
    sg.checkpoint.save(path, snapshot(1), single())
    assert sg.checkpoint.exists(str(path)) is True
    (path / directory.MANIFEST).write_text("{}")
    with pytest.raises(sg.CheckpointError, match="not a readable checkpoint"):
        sg.checkpoint.exists(path)  # damaged: news, not a fresh start
    (tmp_path / "file").write_text("x")
    with pytest.raises(sg.CheckpointError, match="it is a file"):
        sg.checkpoint.exists(tmp_path / "file")
    with pytest.raises(sg.UsageError, match="'path' must be a str or os.PathLike"):
        sg.checkpoint.exists(3)
