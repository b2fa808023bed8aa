"""Issue 23, the process plumbing: a dead launcher ends its ranks, ranks that never join are
named, and what a rank reports survives a broken ``__str__`` or a peer that left early.

The launcher tests start a real launcher (a script written to ``tmp_path``) with a marker
in its environment, which its ranks and its resource tracker inherit; after the launcher
is SIGKILLed, no process carrying the marker may be left, within a bounded wait.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import stratagem as sg
from helpers import agent_env, free_port
from stratagem.process_group import JoinProcessGroup

# Seconds an orphan may live after its launcher died: it must reach its entry point (a
# light script's imports) and kill itself. Generous, for a loaded 2-core machine.
ORPHAN_BOUND = 45.0

LAUNCHER = '''
"""A launcher for the orphan tests: python launcher.py MODE DIR."""
import os
import signal
import sys
import time
from pathlib import Path

import stratagem as sg  # lazy: torch is imported by the ranks' work, not by this import


def parent_death_signal():
    import ctypes

    value = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(2, ctypes.byref(value), *(ctypes.c_ulong(0),) * 3)  # PR_GET_PDEATHSIG
    return value.value


def ready(ctx, directory, what):
    Path(directory, f"rank{ctx.rank}.{what}").write_text(f"{os.getpid()} {parent_death_signal()}")


def catch_everything():
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, lambda *_: None)


class Unprintable(Exception):
    def __str__(self):
        while True:  # the rank is reporting this error, for ever
            time.sleep(0.05)


def body(strategy, ctx, mode, directory):
    import torch

    catch_everything()
    if mode == "idle":
        ready(ctx, directory, "blocked")
        while True:
            time.sleep(0.05)
    if mode == "collective":  # rank 0 waits in an all_reduce rank 1 never joins
        ready(ctx, directory, "blocked")
        if ctx.rank == 0:
            strategy.reduce(torch.ones(1), "sum", ctx)
        while True:
            time.sleep(0.05)
    if mode == "barrier":  # rank 0 waits at the store for a barrier rank 1 never calls
        ready(ctx, directory, "blocked")
        if ctx.rank == 0:
            strategy.barrier(ctx)
        while True:
            time.sleep(0.05)
    if mode == "retry":  # every rank retries a failing collective, swallowing everything
        strategy.reduce(torch.ones(1), "sum", ctx)
        ready(ctx, directory, "blocked")
        while True:
            try:
                time.sleep(0.05)
                raise RuntimeError("try again")
            except BaseException:
                pass
    if mode == "reporting":  # rank 1 is stuck reporting its error, rank 0 in a collective
        ready(ctx, directory, "blocked")
        if ctx.rank == 1:
            raise Unprintable()
        strategy.reduce(torch.ones(1), "sum", ctx)
    raise ValueError(f"unknown mode {mode}")


def fail_fast(strategy, ctx, directory):
    ready(ctx, directory, "started")
    raise ValueError("fail, so that the launcher starts again")


if __name__ == "__main__":
    mode, directory = sys.argv[1], sys.argv[2]
    strategy = sg.ddp_spawn(arrival_timeout=3600)
    if mode == "relaunch":  # a launcher that restarts its world whenever it fails
        while True:
            print("launching", flush=True)
            try:
                sg.launch(fail_fast, strategy, devices=2, args=(directory,))
            except sg.RankError:
                pass
    print("launching", flush=True)
    sg.launch(body, strategy, devices=2, args=(mode, directory))
'''


@attrs.define
class Launcher:
    """A launcher process started for one test, and how to find what it left behind."""

    process: subprocess.Popen[str]
    marker: str
    directory: Path

    def wait_for_line(self, line: str, seconds: float = 120.0) -> None:
        assert self.process.stdout is not None
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            read = self.process.stdout.readline()
            if read.strip() == line:
                return
            if not read and self.process.poll() is not None:
                _, err = self.process.communicate()
                pytest.fail(f"the launcher exited ({self.process.returncode}):\n{err[-3000:]}")
        pytest.fail(f"the launcher did not print {line!r} within {seconds} s")

    def wait_for_files(self, pattern: str, count: int, seconds: float = 120.0) -> list[Path]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            found = sorted(self.directory.glob(pattern))
            if len(found) >= count and all(path.read_text() for path in found):
                return found
            if self.process.poll() is not None:
                _, err = self.process.communicate()
                pytest.fail(f"the launcher exited ({self.process.returncode}):\n{err[-3000:]}")
            time.sleep(0.05)
        pytest.fail(f"{count} {pattern} files did not appear within {seconds} s")

    def kill(self) -> None:
        self.process.kill()
        # wait, not communicate: orphaned ranks would hold the launcher's pipes open.
        self.process.wait(timeout=30)

    def left(self) -> list[str]:
        """Every live process (not a zombie) that carries this launcher's marker."""
        needle = f"STRATAGEM_TEST_MARK={self.marker}".encode()
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                if needle not in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    continue
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:  # gone, or not ours to read
                continue
            if state[0] != "Z":
                found.append(f"pid {pid} (ppid {state[1]}): {command[:100].decode()}")
        return found

    def wait_all_gone(self, seconds: float = ORPHAN_BOUND) -> list[str]:
        deadline = time.monotonic() + seconds
        while (left := self.left()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def clean_up(self) -> None:
        # Survivors of a failing test must not outlive it: they share the launcher's group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for line in self.left():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(line.split()[1]), signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.communicate(timeout=10)


@contextlib.contextmanager
def launchers(tmp_path: Path, modes: list[str]) -> Iterator[list[Launcher]]:
    """Start one launcher per mode, all at once; kill whatever is left when done."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    started = []
    try:
        for number, mode in enumerate(modes):
            directory = tmp_path / f"{number}-{mode}"
            directory.mkdir()
            marker = uuid.uuid4().hex
            env = {**agent_env(tmp_path), "STRATAGEM_TEST_MARK": marker}
            process = subprocess.Popen(
                [sys.executable, str(script), mode, str(directory)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            started.append(Launcher(process, marker, directory))
        yield started
    finally:
        for launcher in started:
            launcher.clean_up()


def kill_during_start_up(tmp_path: Path, delays: list[float]) -> dict[float, list[str]]:
    """SIGKILL one launcher per delay, that many seconds after it starts its ranks."""
    survivors = {}
    with launchers(tmp_path, ["idle"] * len(delays)) as started:
        for launcher in started:
            launcher.wait_for_line("launching")
        began = time.monotonic()
        for delay, launcher in sorted(zip(delays, started, strict=True), key=lambda p: p[0]):
            time.sleep(max(0.0, began + delay - time.monotonic()))
            launcher.kill()
        deadline = time.monotonic() + ORPHAN_BOUND  # one bound for all: they die together
        for delay, launcher in zip(delays, started, strict=True):
            survivors[delay] = launcher.wait_all_gone(max(0.0, deadline - time.monotonic()))
    return {delay: left for delay, left in survivors.items() if left}


def test_ranks_die_with_a_launcher_killed_while_they_start(tmp_path: Path) -> None:
    assert kill_during_start_up(tmp_path, [0.2, 0.7, 1.5]) == {}


@pytest.mark.slow
@pytest.mark.parametrize("first", [0.1, 0.6, 1.1, 1.6])
def test_ranks_die_with_a_launcher_killed_at_any_moment_of_their_start_up(
    tmp_path: Path, first: float
) -> None:
    # 0.1 s steps through 0.1 .. 2.0 s, five launchers at a time.
    delays = [round(first + step / 10, 1) for step in range(5)]
    assert kill_during_start_up(tmp_path, delays) == {}


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_whatever_they_are_doing(tmp_path: Path) -> None:
    modes = ["collective", "barrier", "retry", "reporting"]
    with launchers(tmp_path, modes) as started:
        for mode, launcher in zip(modes, started, strict=True):
            files = launcher.wait_for_files("rank*.blocked", 2)
            # Armed in every rank, after joining and a collective too: nothing in torch or
            # gloo reset the parent-death signal.
            armed = [path.read_text().split()[1] for path in files]
            assert armed == [str(int(signal.SIGKILL))] * 2, mode
        time.sleep(0.5)  # into the collective, the wait at the store, the error
        for launcher in started:
            launcher.kill()
        deadline = time.monotonic() + ORPHAN_BOUND
        left = {
            mode: launcher.wait_all_gone(max(0.0, deadline - time.monotonic()))
            for mode, launcher in zip(modes, started, strict=True)
        }
    assert left == {mode: [] for mode in modes}


@pytest.mark.slow
def test_ranks_die_with_a_launcher_killed_while_it_starts_its_world_again(
    tmp_path: Path,
) -> None:
    with launchers(tmp_path, ["relaunch"]) as (launcher,):
        launcher.wait_for_files("rank*.started", 2)  # one world ran and failed
        for _ in range(2):
            launcher.wait_for_line("launching")
        time.sleep(0.3)  # the next world is starting
        launcher.kill()
        assert launcher.wait_all_gone() == []


# ----------------------------------------------------------------- ranks that never join


def two_rank_env(rank: int, port: int) -> sg.Env:
    return sg.Env(rank=rank, world_size=2, local_world_size=2, master_port=port, source="slurm")


def test_a_rank_that_never_joins_is_named_within_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(sg.LaunchError) as caught:
        sg.ddp(timeout=3, device="cpu").setup(two_rank_env(0, free_port()))
    message = str(caught.value)
    assert "rank(s) 1 of a world of 2 did not join within 3 s" in message, message
    assert "joined: 0" in message and "join_timeout" in message
    assert time.monotonic() - start < 30
    assert not torch.distributed.is_initialized()


def test_the_join_timeout_is_its_own_and_shorter_than_the_collective_timeout() -> None:
    join = sg.ddp(device="cpu").setup
    assert isinstance(join, JoinProcessGroup)
    assert join.join_timeout < join.timeout.total_seconds()
    start = time.monotonic()
    with pytest.raises(
        sg.LaunchError, match=r"rank\(s\) 1 of a world of 2 did not join within 2 s"
    ):
        attrs.evolve(join, join_timeout=2)(two_rank_env(0, free_port()))
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_a_rank_whose_store_host_never_comes_gives_up_after_the_join_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(sg.LaunchError, match="rank 1 could not reach the rendezvous store"):
        JoinProcessGroup(join_timeout=2)(two_rank_env(1, free_port()))
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "1", True, 10**7])
def test_the_join_timeout_is_validated(bad: object) -> None:
    with pytest.raises(sg.UsageError, match="'join_timeout' must be a positive number of seconds"):
        JoinProcessGroup(join_timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(sg.UsageError, match="'join_timeout' must be"):
        attrs.evolve(JoinProcessGroup(), join_timeout=bad)


@attrs.frozen
class NeverOnRankOne:
    """A setup that never joins on rank 1 (it hangs before joining), as a rank that never starts."""

    inner: Any

    def __call__(self, env: sg.Env) -> sg.Context:
        while env.rank == 1:
            time.sleep(0.05)
        return self.inner(env)  # type: ignore[no-any-return]


def reduce_one(strategy: sg.StrategyLike, ctx: sg.Context) -> float:
    return float(strategy.reduce(torch.ones(1), "sum", ctx).item())


@pytest.mark.slow
def test_a_spawned_rank_that_never_joins_is_named_not_a_store_error() -> None:
    strategy = sg.ddp_spawn(timeout=4, start=sg.Spawn(stop_grace=2), device="cpu")
    strategy = attrs.evolve(strategy, setup=NeverOnRankOne(strategy.setup))
    start = time.monotonic()
    with pytest.raises(sg.RankError) as caught:
        sg.launch(reduce_one, strategy, devices=2)
    error = caught.value
    assert (error.rank, error.exc_type) == (0, "stratagem.errors.LaunchError"), str(error)
    assert "rank(s) 1 of a world of 2 did not join within 4 s" in error.message
    assert time.monotonic() - start < 60


# ------------------------------------------------------------------ errors that come back


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("str is broken")


def raise_broken_str(strategy: sg.StrategyLike, ctx: sg.Context) -> None:
    if ctx.rank == 1:
        raise BrokenStr("the payload")
    strategy.barrier(ctx)


def test_an_exception_whose_str_fails_still_comes_back_with_its_type_and_repr() -> None:
    with pytest.raises(sg.RankError) as caught:
        sg.launch(
            raise_broken_str, sg.ddp_spawn(start=sg.Spawn(stop_grace=2), device="cpu"), devices=2
        )
    error = caught.value
    assert error.rank == 1, str(error)
    assert error.exc_type is not None and error.exc_type.endswith("BrokenStr"), str(error)
    assert "BrokenStr('the payload')" in error.message
    assert "__str__ raised RuntimeError: str is broken" in error.message
    assert "raise BrokenStr" in error.remote_traceback


def leave_early(strategy: sg.StrategyLike, ctx: sg.Context) -> float:
    if ctx.rank == 1:
        return 1.0  # returns without the collective rank 0 is about to call
    time.sleep(1.0)
    return float(strategy.reduce(torch.ones(1), "sum", ctx).item())


def test_a_rank_that_returns_early_is_named_not_the_rank_left_in_the_collective() -> None:
    with pytest.raises(sg.RankError) as caught:
        sg.launch(leave_early, sg.ddp_spawn(start=sg.Spawn(stop_grace=2), device="cpu"), devices=2)
    error = caught.value
    assert error.rank == 0, str(error)
    assert (
        "rank(s) 1 returned from the launched function while rank 0 was still in a collective"
        in error.message
    ), str(error)
    assert "call it on rank(s) 1 too, or on no rank" in error.message


def test_a_join_wait_is_bounded_by_the_collective_timeout_too() -> None:
    join = JoinProcessGroup(timeout=timedelta(seconds=2), join_timeout=600)
    start = time.monotonic()
    with pytest.raises(sg.LaunchError, match="did not join within 2 s"):
        join(two_rank_env(0, free_port()))
    assert time.monotonic() - start < 30
