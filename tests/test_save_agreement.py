"""Ranks that pass different save arguments are refused on every rank, not left to hang.

Reported (issue 39): ``blocking=`` differing across ranks (rank 0 blocking, rank 1 in the
background) hung past 150 s.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

import stratagem as sg
from stratagem.testing import World

pytestmark = pytest.mark.slow


def save_with(strategy, ctx, directory, option):
    torch.manual_seed(0)
    state = {"model": torch.nn.Linear(2, 2), "step": 1}
    kwargs = {"blocking": True}
    path = os.path.join(directory, "c")
    if option == "blocking":
        kwargs["blocking"] = ctx.rank == 0
    elif option == "path":
        path = os.path.join(directory, f"c{ctx.rank}")
    elif option == "keep_last":
        kwargs["keep_last"] = ctx.rank + 1
    started = time.monotonic()
    try:
        handle = sg.checkpoint.save(path, state, ctx, **kwargs)
        if handle is not None:
            handle.wait(30)
    except sg.UsageError as error:
        return str(error), time.monotonic() - started
    return "saved", time.monotonic() - started


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=60) as world:
        yield world


@pytest.mark.parametrize(
    ("option", "shown"),
    [
        ("blocking", "rank 0: blocking=True; rank 1: blocking=False"),
        ("path", "rank 0: path="),
        ("keep_last", "rank 0: keep_last=1; rank 1: keep_last=2"),
    ],
)
def test_differing_save_arguments_are_refused_on_every_rank(world, tmp_path, option, shown):
    results = world.run(save_with, sg.ddp(device="cpu"), str(tmp_path), option)
    for message, seconds in results:
        assert message.startswith(f"save: every rank must pass the same {option}"), message
        assert shown in message
        assert seconds < 10
    assert sorted(os.listdir(tmp_path)) == []  # nothing written, no lock left


def test_equal_arguments_save(world, tmp_path):
    results = world.run(save_with, sg.ddp(device="cpu"), str(tmp_path), "none")
    assert [message for message, _ in results] == ["saved", "saved"]
