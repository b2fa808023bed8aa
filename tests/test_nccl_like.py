"""Every CPU-side path in a world whose default group has no CPU backend, as under NCCL.

On the GPU host, ``save(..., blocking=False)`` failed in every NCCL world (DCP's async save
needs a CPU backend) and CPU collectives raised ``No backend type associated with device
type cpu``. ``backend="cuda:gloo"`` on this CPU-only torch gives a world with the same
property (the `nccl_like` fixture): the model cannot train there, but checkpoints, results,
flags and the kit's checks all travel on the CPU, over the gloo group setup adds beside it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from stratagem.testing import World

pytestmark = pytest.mark.slow


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "step": seed}


def _weights(state: dict[str, object]) -> list[torch.Tensor]:
    model = state["model"]
    assert isinstance(model, torch.nn.Module)
    return [p.detach().clone() for p in model.parameters()]


def the_world_has_no_cpu_backend(strategy, ctx):
    try:
        dist.all_reduce(torch.ones(1), group=ctx.group)
    except RuntimeError as error:
        refused = str(error)
    else:
        refused = ""
    return refused, ctx.cpu_group is not None


def background_then_blocking_saves_round_trip(strategy, ctx, directory):
    state = _state(seed=7)
    before = _weights(state)
    handle = sg.checkpoint.save(
        os.path.join(directory, "background"), state, ctx, blocking=False, checksums=True
    )
    with torch.no_grad():
        for p in state["model"].parameters():  # type: ignore[union-attr]
            p.zero_()  # the save already holds its copy
    handle.wait(60)
    sg.checkpoint.save(os.path.join(directory, "blocking"), state, ctx, checksums=True)
    fresh = _state(seed=1)
    restored = sg.checkpoint.load(os.path.join(directory, "background"), fresh, ctx)
    background_equal = all(map(torch.equal, _weights(fresh), before))
    sg.checkpoint.load(os.path.join(directory, "blocking"), fresh, ctx)
    blocking_zero = all(bool((w == 0).all()) for w in _weights(fresh))
    return restored["step"], background_equal, blocking_zero


def resumes_from_the_newest(strategy, ctx, directory):
    state = _state(seed=3)
    for step in (1, 2):
        state["step"] = step
        sg.checkpoint.save(os.path.join(directory, f"step_{step}"), state, ctx)
    fresh = _state(seed=5)
    loaded = sg.checkpoint.resume_or_start(directory, fresh, strategy, ctx)
    return loaded["step"], sg.checkpoint.latest(directory) is not None


def collectives_on_cpu_tensors(strategy, ctx):
    mine = torch.tensor([float(ctx.rank + 1)])
    total = strategy.reduce(mine, "sum", ctx).item()
    rows = strategy.gather(mine, ctx).flatten().tolist()
    sent = strategy.broadcast(torch.arange(3.0) + ctx.rank, ctx, src=1).tolist()
    told = strategy.broadcast({"from": ctx.rank}, ctx, src=0)
    strategy.barrier(ctx)
    return total, rows, sent, told


def save_on_rank_zero_only(strategy, ctx, directory):
    if ctx.rank != 0:
        return None
    started = time.monotonic()
    try:
        sg.checkpoint.save(os.path.join(directory, "c"), {"step": 1}, ctx)
    except sg.CollectiveCallError as error:
        return str(error), time.monotonic() - started
    return "returned", time.monotonic() - started


def checked_collectives(strategy, ctx):
    agreed = strategy.reduce(torch.ones(2), "sum", ctx).tolist()
    try:
        strategy.reduce(torch.ones(2 + ctx.rank), "sum", ctx)  # shapes differ: caught
    except sg.CollectiveMismatchError as error:
        return agreed, str(error).splitlines()[0]
    return agreed, "no mismatch reported"


def preemption_is_agreed(strategy, ctx):
    with sg.on_preemption() as preemption:
        before = preemption.requested(ctx)
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        after = preemption.requested(ctx)
    return before, after, preemption.received


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=90) as world:
        yield world


def test_the_fixture_world_refuses_cpu_tensors_on_its_default_group(world, nccl_like):
    (refused, side), (_, side_too) = world.run(the_world_has_no_cpu_backend, nccl_like)
    assert "No backend type associated with device type cpu" in refused
    assert side and side_too  # setup added the gloo group that CPU traffic takes


def test_background_and_blocking_saves_round_trip(world, nccl_like, tmp_path):
    # Failed on the GPU host, and here before: "A CPU backend must be enabled for async save".
    results = world.run(background_then_blocking_saves_round_trip, nccl_like, str(tmp_path))
    assert results == [(7, True, True)] * 2
    assert sg.checkpoint.describe(tmp_path / "background").world_size == 2


def test_resume_or_start_loads_the_newest(world, nccl_like, tmp_path):
    assert world.run(resumes_from_the_newest, nccl_like, str(tmp_path)) == [(2, True)] * 2


def test_reduce_gather_broadcast_barrier_on_cpu_tensors(world, nccl_like):
    expected = (3.0, [1.0, 2.0], [1.0, 2.0, 3.0], {"from": 0})
    assert world.run(collectives_on_cpu_tensors, nccl_like) == [expected] * 2


def test_a_save_on_one_rank_names_the_other(world, tmp_path):
    strategy = sg.ddp(device="cpu", backend="cuda:gloo", arrival_timeout=2.5)
    outcome, nothing = world.run(save_on_rank_zero_only, strategy, str(tmp_path))
    assert nothing is None
    message, seconds = outcome
    assert message.startswith("save is collective") and "rank(s) 1 did not" in message
    assert seconds < 2.5 + 10


def test_checked_agrees_over_the_cpu_group(world, nccl_like):
    results = world.run(checked_collectives, sg.checked(nccl_like))
    for agreed, mismatch in results:
        assert agreed == [2.0, 2.0]
        assert "reduce" in mismatch and "no mismatch" not in mismatch


def test_preemption_is_agreed_by_every_rank(world, nccl_like):
    results = world.run(preemption_is_agreed, nccl_like)
    assert results == [(False, True, signal.SIGUSR1)] * 2


def test_torchrun_in_place_resumes_from_background_saves_and_gathers_results(tmp_path):
    script = Path(__file__).parent / "scripts" / "nccl_like_saves.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), str(tmp_path)]
    runs = []
    for _ in range(2):  # the second run resumes where the first one's background saves ended
        done = subprocess.run(command, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS "))
        runs.append(json.loads(line.removeprefix("RESULTS ")))
    first, second = runs
    assert [r["rank"] for r in first] == [0, 1] and {r["max"] for r in first} == {1.0}
    assert [r["step"] for r in first] == [2, 2] and [r["step"] for r in second] == [4, 4]
    # Each step adds 1 to all 8 weights: the resumed run starts from step 2's weights.
    assert second[0]["weight"] == pytest.approx(first[0]["weight"] + 16.0)
    assert sg.checkpoint.latest(tmp_path).name == "step_4"


def ray_collectives(strategy, ctx):
    return strategy.reduce(torch.tensor([float(ctx.rank + 1)]), "sum", ctx).item()


def test_ray_workers_reduce_over_the_cpu_group(nccl_like):
    pytest.importorskip("ray", reason="the Ray launch field needs the 'ray' extra")
    import logging

    import ray

    from stratagem.ray_launching import ray_launcher

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.ERROR)
    try:
        strategy = attrs.evolve(nccl_like, launch=ray_launcher(num_workers=2))
        assert sg.launch(ray_collectives, strategy, devices=2) == [3.0, 3.0]
    finally:
        ray.shutdown()
