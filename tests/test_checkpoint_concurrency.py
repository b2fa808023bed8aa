"""Saves and loads of one path at the same time: one writer at a time, and a load reads one version.

The writers and the loader are real processes on the real filesystem. Each
test runs at least 20 interleavings and checks after each that the path holds
a whole checkpoint.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

import stratagem as sg

ROUNDS = 20
SIZE = 256  # 256 KiB of weights: a save takes long enough for another to run into it


def single() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def state_of(version: int) -> dict[str, object]:
    """A checkpoint whose every part says which version it is."""
    model = torch.nn.Linear(SIZE, SIZE)
    with torch.no_grad():
        model.weight.fill_(version)
        model.bias.fill_(-version)
    return {"model": model, "version": version}


def loaded_version(path: Path) -> int:
    model = torch.nn.Linear(SIZE, SIZE)
    values = sg.checkpoint.load(path, {"model": model}, single())
    version = values["version"]
    assert torch.all(model.weight == version) and torch.all(model.bias == -version), (
        f"a load mixed versions: the value says {version}, the weights "
        f"{model.weight.detach().unique().tolist()[:4]}"
    )
    return int(version)


def write_in_rounds(path: str, writer: int, barrier, results) -> None:
    """Save once a round, at a random moment, and report how it went."""
    jitter = random.Random(writer)
    for round_ in range(ROUNDS):
        try:
            barrier.wait(120)
        except threading.BrokenBarrierError:
            return  # the test stopped early
        time.sleep(jitter.uniform(0, 0.03))
        version = 100 * (round_ + 1) + writer
        try:
            sg.checkpoint.save(path, state_of(version), single())
            results.put((round_, version, "saved"))
        except Exception as error:  # reported to the test, which says what is allowed
            results.put((round_, version, f"{type(error).__name__}: {error}"))
        barrier.wait(120)  # the test checks the path
        barrier.wait(120)


@pytest.mark.slow
def test_two_saves_to_one_path_never_corrupt_it(tmp_path, processes):
    path = tmp_path / "ckpt"
    sg.checkpoint.save(path, state_of(1), single())
    barrier = processes.Barrier(3)
    results = processes.Queue()
    writers = [
        processes.Process(target=write_in_rounds, args=(str(path), w, barrier, results))
        for w in (1, 2)
    ]
    for writer in writers:
        writer.start()
    saved = {1}
    refusals = 0
    try:
        for round_ in range(ROUNDS):
            barrier.wait(120)
            barrier.wait(120)
            outcomes = [results.get(timeout=60) for _ in writers]
            for got_round, version, outcome in outcomes:
                assert got_round == round_
                if outcome == "saved":
                    saved.add(version)
                else:
                    assert outcome.startswith("CheckpointError: save: another save"), outcome
                    assert "is writing" in outcome and "pid" in outcome, outcome
                    refusals += 1
            assert loaded_version(path) in saved, f"round {round_}: not a version that saved"
            assert not [p.name for p in tmp_path.iterdir() if p.name != "ckpt"], round_
            barrier.wait(120)
    except BaseException:
        barrier.abort()  # a failed check must not leave the writers waiting
        raise
    finally:
        for writer in writers:
            writer.join(60)
            if writer.is_alive():
                writer.kill()
    assert all(w.exitcode == 0 for w in writers)
    assert refusals > 0, "the two writers never overlapped: the test tried nothing"
    assert len(saved) - 1 + refusals == 2 * ROUNDS
    sg.checkpoint.save(path, state_of(7), single())  # the path stays usable
    assert loaded_version(path) == 7


def save_versions(path: str, started, stop) -> None:
    version = 2
    while not stop.is_set():
        sg.checkpoint.save(path, state_of(version), single())
        started.set()
        version += 1


def test_a_load_while_saves_commit_reads_one_version(tmp_path, processes):
    path = tmp_path / "ckpt"
    sg.checkpoint.save(path, state_of(1), single())
    started, stop = processes.Event(), processes.Event()
    writer = processes.Process(target=save_versions, args=(str(path), started, stop))
    writer.start()
    try:
        assert started.wait(120)
        # Load until the loads have met ROUNDS versions: how many loads that takes
        # depends on how fast this machine saves against how fast it loads.
        versions: list[int] = []
        deadline = time.monotonic() + 120
        while len(set(versions)) < ROUNDS and time.monotonic() < deadline:
            versions.append(loaded_version(path))
    finally:
        stop.set()
        writer.join(60)
        if writer.is_alive():
            writer.kill()
    assert writer.exitcode == 0
    assert len(set(versions)) >= ROUNDS, f"the loads met too few saves in 120 s: {versions}"
    assert versions == sorted(versions)


def test_a_save_that_waits_on_a_lock_its_holder_removes_takes_a_new_one(tmp_path):
    # Reported by CI: a saver waiting on the lock (its holder not yet named) got it just after
    # the holder removed the file, and failed on the removed path (FileNotFoundError).
    import fcntl
    import os

    path = tmp_path / "ckpt"
    lock = tmp_path / "ckpt.lock"
    sg.checkpoint.save(tmp_path / "warm", state_of(2), single())  # imports done: saves are quick
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held and not named: the saver waits for up to a second
    outcome: list[object] = []

    def save() -> None:
        try:
            sg.checkpoint.save(path, state_of(3), single())
            outcome.append("saved")
        except Exception as error:
            outcome.append(error)

    saver = threading.Thread(target=save)
    saver.start()
    time.sleep(0.5)  # the saver is polling the lock by now
    lock.unlink()  # as a save releases: removed while still locked, then closed
    os.close(fd)
    saver.join(30)
    assert outcome == ["saved"], outcome
    assert loaded_version(path) == 3
    assert not lock.exists()
