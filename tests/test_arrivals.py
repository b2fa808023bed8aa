"""A collective called by some ranks only fails within the arrival timeout, naming the others.

Reported by a user: ``if rank == 0: strategy.save(...)`` hung for 30 minutes and ended in
gloo's "Timed out ... recv", naming nothing.
"""

from __future__ import annotations

import time

import pytest
import torch

import stratagem as sg
from stratagem.arrivals import NOT_CALLED_BY_ALL, Arrivals
from stratagem.testing import World

pytestmark = pytest.mark.slow


def only_rank_zero(strategy, ctx, call, path):
    if ctx.rank != 0:
        return None
    started = time.monotonic()
    try:
        if call == "save":
            sg.checkpoint.save(path, {"step": 1}, ctx)
        elif call == "load":
            sg.checkpoint.load(path, {}, ctx)
        elif call == "barrier":
            strategy.barrier(ctx)
        else:
            strategy.reduce(torch.ones(1), "sum", ctx)
    except sg.CollectiveCallError as error:
        return str(error), time.monotonic() - started
    return "returned", time.monotonic() - started


def save_everywhere(strategy, ctx, path):
    sg.checkpoint.save(path, {"step": 1}, ctx)
    strategy.barrier(ctx)
    return sg.checkpoint.load(path, {}, ctx)["step"]


@pytest.fixture(scope="module")
def world():
    # A world of its own, and a setup of its own per case (a distinct timeout): a call left
    # unanswered puts the ranks' call counts out of step, and a new setup joins afresh.
    with World(2, timeout=60) as world:
        yield world


@pytest.mark.parametrize(("call", "timeout"), [("save", 3.0), ("load", 3.1), ("barrier", 3.2)])
def test_a_call_made_on_rank_zero_only_names_the_absent_rank_within_the_timeout(
    world, tmp_path, call, timeout
):
    assert world.run(
        save_everywhere, sg.ddp(arrival_timeout=2.9, device="cpu"), tmp_path / "c"
    ) == [1, 1]
    strategy = sg.ddp(arrival_timeout=timeout, device="cpu")
    outcome, nothing = world.run(only_rank_zero, strategy, call, tmp_path / "c")
    assert nothing is None
    message, seconds = outcome
    assert message.startswith(f"{call} is collective: every rank must call it")
    assert f"rank(s) 1 did not within {timeout:g} s" in message
    assert "rank 1: never seen" in message  # rank 1 returned without a collective call
    assert "not under `if ctx.is_main:`" in message
    assert timeout <= seconds < timeout + 10


def test_checked_extends_the_check_to_every_collective(world):
    strategy = sg.checked(sg.ddp(arrival_timeout=3.3, device="cpu"))
    outcome, nothing = world.run(only_rank_zero, strategy, "reduce", None)
    assert nothing is None
    message, seconds = outcome
    assert message.startswith("reduce is collective") and "rank(s) 1 did not" in message
    assert seconds < 3.3 + 10


def save_or_barrier(strategy, ctx, path):
    try:
        if ctx.rank == 0:
            sg.checkpoint.save(path, {"step": 1}, ctx)
        else:
            strategy.barrier(ctx)
    except sg.CollectiveCallError as error:
        return str(error)
    return None


def test_each_rank_says_where_the_other_was_last_seen(world, tmp_path):
    # Each waits in a call the other is not in: both know at once that neither can come.
    saving, waiting = world.run(
        save_or_barrier, sg.ddp(arrival_timeout=30, device="cpu"), tmp_path / "c"
    )
    assert saving.startswith("save is collective") and "rank 1 waits in barrier" in saving
    assert waiting.startswith("barrier is collective") and "rank 0 waits in save" in waiting
    assert not (tmp_path / "c").exists()


def test_the_message_is_the_teaching_constant():
    assert NOT_CALLED_BY_ALL.format(what="save", missing="1", timeout=60.0, seen="x").startswith(
        "save is collective: every rank must call it, but rank(s) 1 did not within 60 s (x)."
    )


def test_the_timeout_is_checked_where_it_is_given():
    with pytest.raises(sg.UsageError, match=r"'arrival_timeout' must be a positive number"):
        sg.ddp(arrival_timeout=0, device="cpu")
    with pytest.raises(sg.UsageError, match=r"'arrival_timeout' must be a positive number"):
        sg.fsdp(arrival_timeout=float("nan"), device="cpu")
    with pytest.raises(sg.UsageError, match=r"'arrival_timeout'"):
        Arrivals(torch.distributed.HashStore(), timeout=-1)
    assert sg.ddp(device="cpu").setup.arrival_timeout == 60.0
