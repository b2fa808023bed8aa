"""The project's own strategies under the kit: every built-in obeys every law that applies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stratagem as sg
from stratagem.testing import World, check_all, laws
from stratagem.testing import strategies as kit
from stratagem.testing.modules import default_modules

pytestmark = pytest.mark.slow

SETTINGS = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.mark.parametrize(
    "factory",
    [
        sg.fsdp,
        sg.allreduce_grads,
        lambda: sg.fsdp(shard_when=sg.every_module_of(torch.nn.Linear), device="cpu"),
    ],
    ids=["fsdp-root", "allreduce_grads", "fsdp-every-linear"],
)
def test_two_rank_built_ins_obey_every_law(stratagem_world, tmp_path, factory):
    strategy = factory()
    modules = None
    if strategy.wrap.shard_when is not None if hasattr(strategy.wrap, "shard_when") else False:
        # fully_shard refuses a weight shared by two groups: the tied module cannot be
        # sharded layer by layer (torch's rule, not the strategy's bug).
        modules = {name: m for name, m in default_modules().items() if name != "tied"}
    check_all(
        strategy,
        world=stratagem_world,
        modules=modules,
        portable_to=sg.single_device("cpu"),
        directory=tmp_path,
    )


@pytest.fixture(scope="module")
def world_of_one():
    with World(1) as world:
        yield world


@pytest.mark.parametrize(
    "factory",
    [lambda: sg.single_device("cpu"), sg.dp, lambda: sg.ddp(device="cpu")],
    ids=["single_device", "dp", "ddp-one-rank"],
)
def test_one_rank_built_ins_obey_every_law(world_of_one, tmp_path, factory):
    check_all(factory(), world=world_of_one, directory=tmp_path)


@SETTINGS
@given(module=kit.modules(), batch=kit.batches(world_size=2))
def test_ddp_step_law_on_generated_modules_and_batches(stratagem_world, module, batch):
    laws.check_data_parallel_step(sg.ddp(device="cpu"), module, batch, world=stratagem_world)
    laws.check_wrap(sg.ddp(device="cpu"), module, batch, world=stratagem_world)


@SETTINGS
@given(
    strategy=kit.strategies(), module=kit.modules(convnets=False), batch=kit.batches(world_size=1)
)
def test_stacks_of_combinators_keep_the_laws(world_of_one, strategy, module, batch):
    if "64-true" in strategy.name:  # the plain reference then computes in float64 too
        module, batch = module.double(), batch.double()
    tolerance = 5e-2 if "bf16" in strategy.name else 1e-6
    laws.check_data_parallel_step(strategy, module, batch, world=world_of_one, tolerance=tolerance)


@SETTINGS
@given(op=kit.reduce_ops(floating=False), seed=st.integers(0, 1000))
def test_integer_reduce_law_on_allreduce_grads(stratagem_world, op, seed):
    generator = torch.Generator().manual_seed(seed)
    values = [torch.randint(-50, 50, (3,), generator=generator) for _ in range(2)]
    laws.check_reduce(sg.allreduce_grads(device="cpu"), values, op, world=stratagem_world)


def combinator_stacks(tmp_path):
    return {
        "checked": (sg.checked(sg.ddp(device="cpu")), 1e-6),
        "traced": (
            sg.traced(sg.ddp(device="cpu"), sg.JsonLinesSink(str(tmp_path / "trace.jsonl"))),
            1e-6,
        ),
        "bf16-mixed+clip": (
            sg.with_clipping(sg.with_precision(sg.ddp(device="cpu"), "bf16-mixed"), max_norm=1e6),
            2e-2,
        ),
    }


@pytest.mark.parametrize("name", ["checked", "traced", "bf16-mixed+clip"])
def test_combinators_on_ddp_obey_every_law(stratagem_world, tmp_path, name):
    strategy, tolerance = combinator_stacks(tmp_path)[name]
    check_all(strategy, world=stratagem_world, directory=tmp_path, tolerance=tolerance)
    if name == "traced":
        fields = {event.field for event in sg.JsonLinesSink(str(tmp_path / "trace.jsonl")).events()}
        assert {"setup", "wrap", "step", "backward", "update", "reduce", "save", "load"} <= fields


def test_compiled_obeys_the_training_laws(world_of_one):
    strategy = sg.compiled(sg.single_device("cpu"))
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    batch = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    laws.check_wrap(strategy, module, batch, world=world_of_one, tolerance=1e-5)
    laws.check_data_parallel_step(
        strategy, module, batch, world=world_of_one, steps=2, tolerance=1e-5
    )
