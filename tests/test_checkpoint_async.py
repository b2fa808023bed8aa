"""``save(..., blocking=False)``: staged at once, written in the background, committed whole.

In one process: what the loop changes after `save` returns never reaches the
checkpoint; the path appears only once the commit is done; one save is in
flight at a time; a failure reaches `wait`, the next save or the teardown, and
leaves the previous checkpoint. On two spawned ranks: a run saving in the
background ends where a blocking one does, and a rank killed mid-save leaves
the previous checkpoint, from which the next run resumes bit for bit.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import resumable
import stratagem as sg
from stratagem.checkpoint import directory


@pytest.fixture
def ctx() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


@pytest.fixture
def held():
    """Hold every background save at its commit (blocking ones pass) until the test says."""
    release = threading.Event()
    reached = threading.Event()

    def hook(stage: str) -> None:
        if stage == "written" and threading.current_thread().name == "stratagem-save":
            reached.set()
            assert release.wait(60), "the test never released the save"

    directory.stage_hook = hook
    yield reached, release
    release.set()
    directory.stage_hook = directory._ignore


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_what_the_loop_changes_after_save_returns_is_not_saved(tmp_path, ctx):
    model, optimizer = trained()
    weight = model.weight.detach().clone()
    moment = optimizer.state[model.weight]["exp_avg"].clone()
    handle = sg.checkpoint.save(
        tmp_path / "c", {"model": model, "optim": optimizer, "step": 1}, ctx, blocking=False
    )
    assert isinstance(handle, sg.checkpoint.PendingSave)
    for _ in range(3):  # the loop goes on stepping while the save writes
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    assert not torch.equal(model.weight, weight)
    handle.wait()
    fresh, fresh_optimizer = trained(seed=1)
    values = sg.checkpoint.load(tmp_path / "c", {"model": fresh, "optim": fresh_optimizer}, ctx)
    assert values == {"step": 1}
    assert torch.equal(fresh.weight, weight)
    assert torch.equal(fresh_optimizer.state[fresh.weight]["exp_avg"], moment)


def test_the_path_appears_only_when_the_save_is_committed(tmp_path, ctx, held):
    reached, release = held
    model, _ = trained()
    sg.checkpoint.save(tmp_path / "run" / "step_1", {"model": model}, ctx)
    handle = sg.checkpoint.save(tmp_path / "run" / "step_2", {"model": model}, ctx, blocking=False)
    assert reached.wait(30)
    assert not handle.done()
    assert not (tmp_path / "run" / "step_2").exists()
    assert sg.checkpoint.latest(tmp_path / "run") == tmp_path / "run" / "step_1"
    release.set()
    handle.wait(30)
    assert handle.done()
    assert sg.checkpoint.latest(tmp_path / "run") == tmp_path / "run" / "step_2"


def test_one_save_is_in_flight_at_a_time(tmp_path, ctx, held):
    reached, release = held
    model, _ = trained()
    first = sg.checkpoint.save(tmp_path / "a", {"model": model, "n": 1}, ctx, blocking=False)
    assert reached.wait(30)
    returned = threading.Event()

    def second() -> None:
        sg.checkpoint.save(tmp_path / "b", {"model": model, "n": 2}, ctx)
        returned.set()

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.5)
    assert not returned.is_set(), "a second save started while the first was in flight"
    assert not (tmp_path / "b").exists()
    release.set()
    thread.join(30)
    assert returned.is_set() and first.done()
    assert sg.checkpoint.load(tmp_path / "a", {"model": model}, ctx) == {"n": 1}
    assert sg.checkpoint.load(tmp_path / "b", {"model": model}, ctx) == {"n": 2}


def fail_at_commit(stage: str) -> None:
    if stage == "manifest":
        raise OSError(5, "Input/output error (planted)")


def test_a_failed_background_save_keeps_the_previous_checkpoint_and_says_why(tmp_path, ctx):
    model, _ = trained()
    path = tmp_path / "c"
    sg.checkpoint.save(path, {"model": model, "n": 1}, ctx)
    directory.stage_hook = fail_at_commit
    try:
        handle = sg.checkpoint.save(path, {"model": model, "n": 2}, ctx, blocking=False)
        with pytest.raises(OSError, match="planted"):
            handle.wait(30)
    finally:
        directory.stage_hook = directory._ignore
    assert sg.checkpoint.load(path, {"model": model}, ctx) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no leftovers, no lock
    sg.checkpoint.save(path, {"model": model, "n": 3}, ctx)  # the lock was released
    assert sg.checkpoint.load(path, {"model": model}, ctx) == {"n": 3}


def ended(handle: sg.checkpoint.PendingSave) -> None:
    """Wait for the save to end without calling wait(), which would report its error."""
    deadline = time.monotonic() + 30
    while not handle.done():
        assert time.monotonic() < deadline, "the background save never ended"
        time.sleep(0.01)


def test_an_error_nobody_waited_for_reaches_the_next_save_and_the_teardown(tmp_path, ctx):
    model, _ = trained()
    directory.stage_hook = fail_at_commit
    try:
        ended(sg.checkpoint.save(tmp_path / "a", {"model": model}, ctx, blocking=False))
    finally:
        directory.stage_hook = directory._ignore
    with pytest.raises(OSError, match="planted"):
        sg.checkpoint.save(tmp_path / "b", {"model": model}, ctx)
    assert not (tmp_path / "b").exists()
    directory.stage_hook = fail_at_commit
    try:
        ended(sg.checkpoint.save(tmp_path / "a", {"model": model}, ctx, blocking=False))
    finally:
        directory.stage_hook = directory._ignore
    with pytest.raises(OSError, match="planted"):
        sg.single_device("cpu").teardown(ctx)


def test_wait_refuses_a_bad_timeout_and_bounds_a_stuck_save(tmp_path, ctx, held):
    reached, release = held
    model, _ = trained()
    handle = sg.checkpoint.save(tmp_path / "c", {"model": model}, ctx, blocking=False)
    with pytest.raises(sg.UsageError, match="'timeout' must be None or a positive number"):
        handle.wait(timeout=-1)
    assert reached.wait(30)
    with pytest.raises(sg.CheckpointError, match=r"did not end within 0.2 s"):
        handle.wait(timeout=0.2)
    release.set()
    handle.wait(30)


# ------------------------------------------------------------------ two spawned ranks


def final(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out, weights_only=True)["parameters"]


def run(tmp_path: Path, name: str, **options: object) -> int:
    """Train 16 steps on two spawned ranks, saving every 4; return the step it resumed from."""
    resumed = sg.launch(
        train_with,
        sg.ddp_spawn(device="cpu"),
        devices=2,
        args=(str(tmp_path / name), str(tmp_path / f"{name}.pt"), options),
    )
    return int(resumed[0])


def train_with(strategy, ctx, run_dir, out, options):
    return resumable.train(strategy, ctx, run_dir, out, 16, 4, **options)


@pytest.mark.slow
def test_background_saves_end_where_blocking_saves_do(tmp_path):
    run(tmp_path, "blocking")
    run(tmp_path, "background", blocking=False)
    expected, got = final(tmp_path / "blocking.pt"), final(tmp_path / "background.pt")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    for name in ("blocking", "background"):
        saved = sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir())
        assert saved == ["step_0004", "step_0008", "step_0012", "step_0016"], saved


@pytest.mark.slow
def test_a_rank_killed_during_a_background_save_leaves_the_previous_one_to_resume_from(tmp_path):
    run(tmp_path, "whole", blocking=False)
    with pytest.raises(sg.RankError, match="rank 1") as caught:
        run(tmp_path, "killed", blocking=False, die_at=8, die_in_save=True)
    assert "SIGKILL" in str(caught.value) or "signal 9" in str(caught.value)
    checkpoints = tmp_path / "killed" / "checkpoints"
    assert sg.checkpoint.latest(checkpoints) == checkpoints / "step_0004"
    assert not (checkpoints / "step_0008").exists()
    assert run(tmp_path, "killed", blocking=False) == 4  # the next run resumes from step 4
    expected, got = final(tmp_path / "whole.pt"), final(tmp_path / "killed.pt")
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_a_background_save_records_checksums_that_load_checks(tmp_path, ctx):
    model, _ = trained()
    path = tmp_path / "c"
    sg.checkpoint.save(path, {"model": model}, ctx, blocking=False, checksums=True).wait(30)
    assert sg.checkpoint.load(path, {"model": model}, ctx) == {}
    data = next(path.glob("__0_*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(sg.CheckpointError, match="checksum"):
        sg.checkpoint.load(path, {"model": model}, ctx)
