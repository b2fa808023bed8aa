"""launch: results in rank order, one clear error per failure, bounded time, nothing left behind."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import attrs
import pytest
import torch

import stratagem as sg
from helpers import train_a_little

pytestmark = pytest.mark.slow


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc, so nothing is assumed about how they started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) != pid or fields[0] == "Z":
            continue
        # multiprocessing's resource tracker: one per interpreter, started once, shared by all launches
        if b"resource_tracker" in (entry / "cmdline").read_bytes():
            continue
        found.append(int(entry.name))
    return found


@pytest.fixture
def no_leftovers():
    before = set(children_of(os.getpid()))
    yield
    deadline = time.monotonic() + 5
    while set(children_of(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(children_of(os.getpid())) - before == set()


def whoami(strategy, ctx, tag):
    return {
        "rank": ctx.rank,
        "world": ctx.world_size,
        "tag": tag,
        "pid": os.getpid(),
        "main": ctx.is_main,
    }


def raise_on_rank_one(strategy, ctx):
    if ctx.rank == 1:
        raise KeyError("no such layer: 'decoder.9'")
    strategy.barrier(ctx)  # rank 0 waits here for a rank that will never come
    return "unreachable"


def killed_mid_collective(strategy, ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    strategy.reduce(torch.ones(1), "sum", ctx)
    return "unreachable"


def test_results_come_back_in_rank_order(no_leftovers):
    results = sg.launch(whoami, sg.ddp_spawn(device="cpu"), devices=2, args=("x",))
    assert [(r["rank"], r["world"], r["tag"], r["main"]) for r in results] == [
        (0, 2, "x", True),
        (1, 2, "x", False),
    ]
    assert results[0]["pid"] != results[1]["pid"] != os.getpid()


def test_a_rank_that_raises_is_named_with_its_traceback(no_leftovers):
    start = time.monotonic()
    with pytest.raises(sg.RankError) as info:
        sg.launch(raise_on_rank_one, sg.ddp_spawn(device="cpu"), devices=2)
    error = info.value
    assert (error.rank, error.exc_type, error.exitcode) == (1, "KeyError", None)
    assert "decoder.9" in error.message
    assert "raise_on_rank_one" in error.remote_traceback
    assert str(error).startswith("rank 1 failed: KeyError")
    assert time.monotonic() - start < 60
    assert pickle.loads(pickle.dumps(error)).rank == 1


def test_a_killed_rank_is_reported_with_its_signal(no_leftovers):
    start = time.monotonic()
    with pytest.raises(sg.RankError, match="rank 1 failed: .*killed by signal 9") as info:
        sg.launch(killed_mid_collective, sg.ddp_spawn(device="cpu"), devices=2)
    assert info.value.exitcode == -signal.SIGKILL
    assert info.value.exc_type is None
    assert time.monotonic() - start < 60


def test_unpicklable_functions_are_refused_before_any_process_starts(no_leftovers):
    def local(strategy, ctx):
        return 1

    for fn in (lambda strategy, ctx: 1, local):
        with pytest.raises(
            sg.LaunchError, match="cannot be sent to spawned processes.*module level"
        ):
            sg.launch(fn, sg.ddp_spawn(device="cpu"), devices=2)
    with pytest.raises(sg.LaunchError, match="args"):
        sg.launch(whoami, sg.ddp_spawn(device="cpu"), devices=2, args=(lambda: 0,))


def test_in_place_under_torchrun_checks_devices(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(sg.LaunchError, match="devices=2 but 'torchrun' started 1 .*devices=1"):
        sg.launch(whoami, sg.ddp(device="cpu"), devices=2, args=("x",))
    # A spawning strategy runs in place inside another launcher's world.
    [result] = sg.launch(whoami, sg.ddp_spawn(device="cpu"), devices="auto", args=("y",))
    assert (result["pid"], result["world"]) == (os.getpid(), 1)


def test_ddp_outside_a_launcher_points_to_ddp_spawn():
    with pytest.raises(sg.LaunchError, match="torchrun --nproc-per-node 2, or use .*ddp_spawn"):
        sg.launch(whoami, sg.ddp(device="cpu"), devices=2, args=("x",))


def test_ddp_on_one_device_runs_in_place_without_a_port():
    [result] = sg.launch(train_a_little, sg.ddp(device="cpu"), devices=1)
    assert isinstance(result, float)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout": -1}, "'timeout' must be positive"),
        ({"timeout": "1h"}, "'timeout' must be seconds"),
        ({"backend": "tcp"}, "'backend' must be None"),
        ({"bucket_cap_mb": 0}, r"ddp\(bucket_cap_mb=\.\.\.\) must be None or a positive number"),
        ({"static_graph": "yes"}, r"ddp\(static_graph=\.\.\.\) must be True or False"),
        ({"device": "tpu"}, "'device' must be 'auto'"),
    ],
)
def test_ddp_options_are_validated_at_construction(options, message):
    with pytest.raises(sg.UsageError, match=message):
        sg.ddp(**options)


def test_spawn_settings_are_validated():
    with pytest.raises(sg.UsageError, match="Spawn.stop_grace must be a positive number"):
        sg.Spawn(stop_grace=0)


def test_spawning_is_one_substitution_of_the_launch_field():
    for spawning, plain in [
        (sg.ddp_spawn(bucket_cap_mb=8, device="cpu"), sg.ddp(bucket_cap_mb=8, device="cpu")),
        (sg.fsdp_spawn(shard_size=2, device="cpu"), sg.fsdp(shard_size=2, device="cpu")),
        (
            sg.allreduce_grads_spawn(bucket_mb=4, device="cpu"),
            sg.allreduce_grads(bucket_mb=4, device="cpu"),
        ),
    ]:
        assert spawning == sg.spawned(plain)
        assert spawning.name == f"{plain.name}_spawn"
        assert attrs.evolve(spawning, name=plain.name, launch=plain.launch) == plain
    custom = sg.spawned(sg.ddp(device="cpu"), sg.Spawn(stop_grace=9))
    assert custom.launch == sg.Spawn(stop_grace=9)
