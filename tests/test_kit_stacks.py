"""check_all on every built-in and combinator stack, with BatchNorm and tied weights, 2 and 4 ranks.

The first edition's kit rejected accumulate(ddp(), 2), clipping once it triggered, and
ddp()/fsdp() on any module with BatchNorm: its reference was one plain SGD step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import stratagem as sg
from stratagem.testing import Contract, check_all

pytestmark = pytest.mark.slow

LOW = Contract(rtol=3e-2, atol=3e-2)  # bf16/fp16: the ranks and the reference round alike, mostly


def stacks(tmp_path):
    return {
        "accumulate": (sg.accumulate(sg.ddp(), 2), Contract()),
        "clipping-that-triggers": (sg.with_clipping(sg.ddp(), max_norm=0.01), Contract()),
        "accumulate+clip": (
            sg.with_clipping(sg.accumulate(sg.ddp(), 2), max_norm=0.01), Contract()),
        "bf16-mixed": (sg.with_precision(sg.ddp(), "bf16-mixed"), LOW),
        "16-mixed": (sg.with_precision(sg.ddp(), "16-mixed"), LOW),
        "accumulate-3": (sg.accumulate(sg.ddp(), 3), Contract()),
        "32-true": (sg.with_precision(sg.ddp(), "32-true"), Contract()),
        "64-true": (sg.with_precision(sg.ddp(), "64-true"), Contract()),
        "16-true": (sg.with_precision(sg.ddp(), "16-true"), LOW),
        "bf16-true": (sg.with_precision(sg.ddp(), "bf16-true"), LOW),
        "compiled": (sg.compiled(sg.ddp(), backend="eager"), Contract()),
        "traced": (sg.traced(sg.ddp(), sg.JsonLinesSink(str(tmp_path / "t.jsonl"))), Contract()),
        "checked": (sg.checked(sg.ddp()), Contract()),
        "fsdp+bf16-mixed+accumulate": (
            sg.accumulate(sg.with_precision(sg.fsdp(), "bf16-mixed"), 2), LOW),
        "allreduce+clip": (sg.with_clipping(sg.allreduce_grads(), max_norm=0.01), Contract()),
    }  # fmt: skip


NAMES = sorted(stacks(Path(".")))


@pytest.mark.parametrize("name", NAMES)
def test_every_stack_passes_check_all_on_two_ranks(stratagem_world, tmp_path, name):
    strategy, contract = stacks(tmp_path)[name]
    report = check_all(strategy, world=stratagem_world, contract=contract, directory=tmp_path)
    assert {"data-parallel-step", "accumulation", "checkpoint-round-trip"} <= set(report.passed)
    if name not in ("traced", "checked"):  # every other stack does arithmetic of its own
        assert "combinator-arithmetic" in report.passed, report


@pytest.mark.parametrize("name", ["accumulate+clip", "bf16-mixed", "checked"])
def test_stacks_pass_check_all_on_four_ranks(stratagem_world_of, tmp_path, name):
    strategy, contract = stacks(tmp_path)[name]
    report = check_all(strategy, world=stratagem_world_of(4), contract=contract, directory=tmp_path)
    assert "data-parallel-step" in report.passed


def test_every_built_in_passes_check_all_on_four_ranks(stratagem_world_of, tmp_path):
    for strategy in (sg.ddp(), sg.fsdp(), sg.allreduce_grads()):
        check_all(strategy, world=stratagem_world_of(4), directory=tmp_path / strategy.name)
