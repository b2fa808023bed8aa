"""What ``fabric.print`` and ``seed_everything`` give Fabric users: ``ctx.print``, ``sg.seed_everything``."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import stratagem as sg
from helpers import rank_ctx


def test_ctx_print_prints_on_the_main_rank_only(capsys):
    rank_ctx(0, 2).print("loss", 0.5, sep="=")
    rank_ctx(1, 2).print("loss", 0.25)
    assert capsys.readouterr().out == "loss=0.5\n"


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_seeds_python_numpy_and_torch():
    assert sg.seed_everything(123) == 123
    first = draws()
    sg.seed_everything(123)
    assert draws() == first
    sg.seed_everything(124)
    assert draws() != first


def test_per_rank_seeds_add_the_rank():
    assert sg.seed_everything(10, rank_ctx(1, 2), per_rank=True) == 11
    on_rank_one = draws()
    sg.seed_everything(11)
    assert draws() == on_rank_one
    assert sg.seed_everything(10, rank_ctx(1, 2)) == 10  # the same seed everywhere by default


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: sg.seed_everything(-1),
            r"'seed' must be an int in \[0, 4294967295\] \(got -1, an int\)",
        ),
        (lambda: sg.seed_everything(2**32), r"'seed' must be an int"),
        (lambda: sg.seed_everything(1.5), r"got 1\.5, a float"),
        (lambda: sg.seed_everything(True), r"got True, a bool"),
        (lambda: sg.seed_everything(1, per_rank=True), r"per_rank=True needs the context"),
        (lambda: sg.seed_everything(1, sg.Env()), r"seed_everything: 'ctx' must be the Context"),
    ],
)
def test_bad_seeds_are_refused_naming_the_argument(call, message):
    with pytest.raises(sg.UsageError, match=message):
        call()


def test_resume_or_start_can_keep_this_runs_rng(tmp_path):
    # Before: no rng= (a script that re-seeds after loading could not be matched).
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    torch.manual_seed(1)
    model = torch.nn.Linear(2, 1)
    sg.checkpoint.save(tmp_path / "step_1", {"model": model, "step": 1}, ctx)
    after_save = torch.rand(3)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    loaded = sg.resume_or_start(tmp_path, {"model": model, "step": 0}, strategy, ctx, rng=False)
    assert loaded["step"] == 1
    assert torch.equal(torch.rand(3), expected)  # this run's generator, untouched
    sg.resume_or_start(tmp_path, {"model": model, "step": 0}, strategy, ctx)
    assert torch.equal(torch.rand(3), after_save)  # the default restores the checkpoint's
    with pytest.raises(sg.UsageError, match=r"'rng' must be True or False \(got 'no', a str\)"):
        sg.resume_or_start(tmp_path, {"model": model}, strategy, ctx, rng="no")
