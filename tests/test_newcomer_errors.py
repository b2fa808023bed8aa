"""Mistakes a newcomer makes end in one error that names the fix (issue 34, item 5)."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.training import STEP_WITHOUT_FORWARD


def train(strategy, ctx):
    return ctx.rank


@pytest.mark.parametrize("factory", [sg.ddp_spawn, sg.ddp, sg.single_device, sg.fsdp])
def test_an_uncalled_factory_is_told_to_call_it(factory):
    # Before: "'strategy' must be a Strategy or have every Strategy field (got <function ...>)".
    name = factory.__name__
    with pytest.raises(
        sg.UsageError, match=rf"call the factory: sg\.{name}\(\) instead of sg\.{name}\."
    ):
        sg.launch(train, factory, devices=1)
    with pytest.raises(sg.UsageError, match=rf"sg\.{name}\(\) instead"):
        sg.with_clipping(factory, max_norm=1.0)


@pytest.mark.parametrize(
    ("name", "written"), [("ddp", "ddp"), ("DDP-spawn", "ddp_spawn"), ("fsdp", "fsdp")]
)
def test_a_strategy_named_by_a_string_is_told_the_factory(name, written):
    with pytest.raises(sg.UsageError, match=rf"not names: write sg\.{written}\(\)"):
        sg.launch(train, name, devices=1)
    with pytest.raises(sg.UsageError, match=rf"got '{name}', a str"):
        sg.spawned(name)


def test_an_unknown_name_still_gets_a_fix():
    with pytest.raises(sg.UsageError, match=r"not names: build one, e.g\. sg\.ddp\(\)"):
        sg.launch(train, "zero3", devices=1)


@pytest.mark.parametrize("strategy", [sg.single_device("cpu"), sg.dp()])
def test_a_step_without_forward_on_an_inputs_targets_batch_names_forward(strategy):
    # Before: torch's "linear(): argument 'input' (position 1) must be Tensor, not list".
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(4, 1), ctx)
    for batch in ((torch.randn(2, 4), torch.randn(2, 1)), [torch.randn(2, 4), torch.randn(2, 1)]):
        with pytest.raises(
            sg.UsageError, match=r"step: without forward=, the module is called"
        ) as info:
            strategy.step(model, batch, ctx)
        assert f"a {type(batch).__name__} of 2" in str(info.value)
        assert "forward=lambda model, batch: loss_fn(model(batch[0]), batch[1])" in str(info.value)
        assert isinstance(info.value.__cause__, TypeError)  # torch's own error, kept


def test_a_module_that_takes_the_whole_batch_still_runs_and_its_own_errors_pass_through():
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())

    class Pair(torch.nn.Module):
        def forward(self, batch):
            inputs, targets = batch
            return torch.nn.functional.mse_loss(inputs.sum(1, keepdim=True), targets)

    loss = strategy.step(Pair(), (torch.ones(2, 4), torch.zeros(2, 1)), ctx)
    assert loss.item() == 16.0
    model = strategy.wrap(torch.nn.Bilinear(2, 2, 1), ctx)  # forward(input1, input2)
    with pytest.raises(TypeError) as info:  # a tensor batch: the module's error as it is
        strategy.step(model, torch.ones(2, 2), ctx)
    assert not isinstance(info.value, sg.UsageError)


def test_the_message_is_the_teaching_constant():
    assert STEP_WITHOUT_FORWARD.startswith("step: without forward=")


@pytest.mark.slow
def test_a_spawning_script_without_a_main_guard_is_told_to_add_one():
    # Before: 154 lines ending in "rank 1 failed: process N exited with code 1 without
    # reporting a result" (each rank re-ran the launch while importing the script).
    import subprocess
    import sys
    from pathlib import Path

    from stratagem._processes import NO_MAIN_GUARD

    script = Path(__file__).parent / "scripts" / "no_main_guard.py"
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("stratagem.errors.RankError: rank ") and last.endswith(NO_MAIN_GUARD)
    assert 'Put the launch call under `if __name__ == "__main__":`' in NO_MAIN_GUARD
    assert "bootstrapping phase" not in done.stderr  # multiprocessing's own long refusal
    assert len(done.stderr.splitlines()) < 40
