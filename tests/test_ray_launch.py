"""The Ray launch field: the demo trains on Ray actors as on spawned ranks; errors and bounds.

Ray is the optional extra ``stratagem[ray]``, which the nox ``tests`` session
installs: there a missing Ray fails these tests. A dev venv without it skips
the tests that need it, and still runs the ones about its absence.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import threading
import time

import attrs
import pytest
import torch

import stratagem as sg
from stratagem.ray_launching import NEEDS_RAY, RayLaunch, ray_launcher
from stratagem.validators import MAX_SECONDS

HAVE_RAY = importlib.util.find_spec("ray") is not None
# Under nox (CI) Ray is installed with the extra: a missing Ray there is a failure, not a skip.
needs_ray = pytest.mark.skipif(
    not HAVE_RAY and "NOX_CURRENT_SESSION" not in os.environ,
    reason="Ray is not installed in this venv (pip install 'stratagem[ray]')",
)

# Ray's local instance, shared by the module's launches: starting one costs seconds.
CPUS = 2


@pytest.fixture(scope="module")
def local_ray():
    import logging

    import ray

    started = time.monotonic()
    ray.init(
        address="local",
        num_cpus=CPUS,
        object_store_memory=128 * 2**20,
        include_dashboard=False,
        logging_level=logging.ERROR,
    )
    print(f"Ray started in {time.monotonic() - started:.1f} s")
    yield ray
    ray.shutdown()


def free_cpus(ray, within: float = 10.0) -> float:
    """Ray's free CPUs once the killed actors gave theirs back (or ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while True:
        free = ray.available_resources().get("CPU", 0.0)
        if free >= CPUS or time.monotonic() > deadline:
            return free
        time.sleep(0.1)


def on_ray(**options) -> sg.Strategy:
    return attrs.evolve(sg.ddp(device="cpu"), launch=ray_launcher(**options))


# ------------------------------------------------------------------ functions the ranks run


def whoami(strategy, ctx, tag):
    total = strategy.reduce(torch.tensor([float(ctx.rank)]), "sum", ctx)
    return {"rank": ctx.rank, "world": ctx.world_size, "tag": tag, "pid": os.getpid(),
            "total": total.item(), "env": sg.detect_env(os.environ).rank}  # fmt: skip


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


def sleep_long(strategy, ctx):
    time.sleep(600)


# ------------------------------------------------------------------ fast: no Ray started


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"num_workers": 0},
            r"num_workers=\.\.\.\) must be None \(one worker per device\) or a positive int \(got 0",
        ),
        ({"num_workers": True}, r"num_workers=\.\.\.\) must be .* \(got True, a bool\)"),
        ({"num_workers": "2"}, r"num_workers=\.\.\.\) must be .* \(got '2', a str\)"),
        ({"cpus_per_worker": 0}, r"cpus_per_worker=\.\.\.\) must be a positive number of CPUs"),
        ({"cpus_per_worker": math.nan}, r"cpus_per_worker=\.\.\.\) must be a positive number"),
        ({"timeout": -1}, r"ray_launcher\(timeout=\.\.\.\) must be a positive number of seconds"),
        ({"timeout": math.inf}, r"timeout=\.\.\.\) must be a positive number of seconds"),
        ({"start_timeout": MAX_SECONDS + 1}, r"start_timeout=\.\.\.\) must be .* at most 1000000"),
        ({"exit_timeout": "30s"}, r"exit_timeout=\.\.\.\) must be a positive number"),
    ],
)
def test_bad_settings_are_refused_naming_the_argument(options, message):
    with pytest.raises(sg.UsageError, match=message):
        ray_launcher(**options)
    with pytest.raises(sg.UsageError, match=message):  # and in every substitution of them
        attrs.evolve(RayLaunch(), **options)


def test_without_ray_building_or_launching_names_the_extra(monkeypatch):
    launcher = RayLaunch(num_workers=2)
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    fix = r"needs Ray, which is not installed .*pip install 'stratagem\[ray\]'"
    with pytest.raises(sg.LaunchError, match=fix):
        ray_launcher(num_workers=2)
    with pytest.raises(sg.LaunchError, match=fix):  # one record, one check: whichever name
        attrs.evolve(launcher, timeout=60.0)
    with pytest.raises(sg.LaunchError, match=fix):
        sg.launch(
            whoami, attrs.evolve(sg.ddp(device="cpu"), launch=launcher), devices=2, args=("x",)
        )
    assert "stratagem[ray]" in NEEDS_RAY


def test_importing_stratagem_imports_no_ray():
    code = (
        "import sys, attrs, stratagem as sg\n"
        "from stratagem.ray_launching import RayLaunch\n"
        "attrs.evolve(sg.ddp(), launch=RayLaunch(num_workers=2))\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


@needs_ray
def test_devices_must_equal_num_workers():
    with pytest.raises(
        sg.LaunchError, match=r"devices=1 but ray_launcher\(num_workers=2\) .*devices=2"
    ):
        sg.launch(whoami, on_ray(num_workers=2), args=("x",))


@needs_ray
def test_unpicklable_arguments_are_refused_before_ray_starts():
    with pytest.raises(
        sg.LaunchError, match=r"args \(<unlocked _thread.lock .*cannot be sent to Ray"
    ):
        sg.launch(whoami, on_ray(num_workers=2), devices=2, args=(threading.Lock(),))


@needs_ray
def test_inside_a_torchrun_world_it_runs_in_place(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    [result] = sg.launch(whoami, on_ray(), devices="auto", args=("y",))
    assert (result["pid"], result["world"]) == (os.getpid(), 1)


# ------------------------------------------------------------------ slow: on Ray's local instance


@needs_ray
@pytest.mark.slow
def test_the_demo_trains_on_ray_as_on_spawned_ranks(local_ray):
    from stratagem.cli.classifier import Config, train
    from stratagem.cli.data import load

    data, config = load("synthetic"), Config(2, 128, shown=False)
    started = time.monotonic()
    on_actors = sg.launch(train, on_ray(num_workers=2), devices=2, args=(data, config))
    took = time.monotonic() - started
    spawned = sg.launch(train, sg.ddp_spawn(device="cpu"), devices=2, args=(data, config))
    print(f"2 Ray workers: {took:.1f} s")
    ours, theirs = on_actors[0].parameters, spawned[0].parameters
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name  # bit for bit
    assert on_actors[0].curve == spawned[0].curve
    assert on_actors[1].parameters is None  # rank 1's result, in its place


@needs_ray
@pytest.mark.slow
def test_results_come_back_in_rank_order(local_ray):
    results = sg.launch(whoami, on_ray(), devices=2, args=("x",))  # one worker per device
    assert [(r["rank"], r["env"], r["world"], r["tag"], r["total"]) for r in results] == [
        (0, 0, 2, "x", 1.0),
        (1, 1, 2, "x", 1.0),
    ]
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3  # two actors, not this process
    # Ray pickles by value what is not importable (a lambda, a closure, a script's function).
    offset = 10
    assert sg.launch(lambda strategy, ctx: ctx.rank + offset, on_ray(), devices=2) == [10, 11]


@needs_ray
@pytest.mark.slow
def test_a_rank_that_raises_is_named_with_its_traceback(local_ray):
    started = time.monotonic()
    with pytest.raises(sg.RankError) as info:
        sg.launch(raise_on_rank_one, on_ray(num_workers=2), devices=2)
    error = info.value
    assert (error.rank, error.exc_type, error.exitcode) == (1, "KeyError", None)
    assert "decoder.9" in error.message
    assert "raise_on_rank_one" in error.remote_traceback
    assert str(error).startswith("rank 1 failed: KeyError")
    assert time.monotonic() - started < 60
    assert free_cpus(local_ray) == CPUS  # rank 0, stuck in its barrier, was killed


@needs_ray
@pytest.mark.slow
def test_a_killed_worker_is_named(local_ray):
    started = time.monotonic()
    with pytest.raises(sg.RankError, match=r"rank 1 failed: its Ray worker \(process \d+\) died"):
        sg.launch(killed_mid_collective, on_ray(num_workers=2), devices=2)
    assert time.monotonic() - started < 60
    assert free_cpus(local_ray) == CPUS


@needs_ray
@pytest.mark.slow
def test_a_run_past_its_timeout_is_stopped(local_ray):
    started = time.monotonic()
    with pytest.raises(sg.LaunchError, match=r"rank\(s\) 0, 1 still running after timeout=3 s"):
        sg.launch(sleep_long, on_ray(num_workers=2, timeout=3), devices=2)
    assert time.monotonic() - started < 30
    assert free_cpus(local_ray) == CPUS


@needs_ray
@pytest.mark.slow
def test_workers_ray_cannot_place_are_a_launch_error(local_ray):
    started = time.monotonic()
    # Two CPUs in all: a worker that asks for three can never start.
    never = r"could not start the worker of rank [01] \(ActorUnschedulableError.* 3 CPU\(s\) "
    with pytest.raises(sg.LaunchError, match=never + r".*Ray has 2.0 free of 2.0"):
        sg.launch(whoami, on_ray(cpus_per_worker=3), devices=2, args=("x",))
    assert time.monotonic() - started < 30
    # One CPU taken: the second worker waits for it, start_timeout seconds at most.
    from ray.util.placement_group import placement_group, remove_placement_group

    taken = placement_group([{"CPU": 1}])  # holds a CPU, no process
    local_ray.get(taken.ready(), timeout=30)
    try:
        waiting = r"did not start worker\(s\) for rank\(s\) [0-9, ]+ within start_timeout=2 s"
        with pytest.raises(sg.LaunchError, match=waiting):
            sg.launch(whoami, on_ray(start_timeout=2), devices=2, args=("x",))
    finally:
        remove_placement_group(taken)
    assert time.monotonic() - started < 60
    assert free_cpus(local_ray) == CPUS


def teardown_hangs_on_rank_one(ctx):
    if ctx.rank == 1:
        time.sleep(600)
    sg.ddp(device="cpu").teardown(ctx)


@needs_ray
@pytest.mark.slow
def test_a_teardown_that_hangs_keeps_the_results(local_ray):
    hanging = attrs.evolve(
        sg.ddp(device="cpu"),
        teardown=teardown_hangs_on_rank_one,
        launch=ray_launcher(exit_timeout=2),
    )
    started = time.monotonic()
    results = sg.launch(whoami, hanging, devices=2, args=("z",))
    assert [r["rank"] for r in results] == [0, 1]
    assert 2 <= time.monotonic() - started < 30
    assert free_cpus(local_ray) == CPUS
