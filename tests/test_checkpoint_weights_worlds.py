"""Weights in shared formats across worlds: written by one strategy, read by every other, bit for bit.

A 2-rank fsdp world writes the FSDP2 example's consolidated ``.pt`` (by hand, as
the example does: ``full_tensor()`` of every entry, ``torch.save`` on rank 0)
and stratagem's safetensors exports (one file, and sharded). Each target world
(ddp on 2, fsdp on 3, FSDP x TP on a 2x2 mesh) imports each file into a block
built from another seed, gathers it whole and exports it again: every tensor
must equal the source's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stratagem as sg
from helpers import block_plan, make_block
from stratagem.checkpoint import safetensor_files

pytestmark = pytest.mark.slow

FILES = ("fsdp2_example.pt", "export.safetensors", "sharded")


def whole(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state, gathered whole on every rank (as the FSDP2 example gathers it)."""
    state = sg.unwrap(module).state_dict()
    return {
        key: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
        for key, value in state.items()
    }


def write_sources(strategy, ctx, directory: str) -> dict[str, torch.Tensor]:
    model = strategy.wrap(make_block(seed=0), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = strategy.step(
        model, torch.randn(2, 5, 16), ctx, forward=lambda m, x: m(x).square().mean()
    )
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)  # trained weights, not the initial ones
    state = whole(model)
    if ctx.is_main:  # the FSDP2 example's checkpoint: torch.save of the full state on rank 0
        torch.save(state, f"{directory}/fsdp2_example.pt")
    sg.checkpoint.export_weights(f"{directory}/export.safetensors", model, ctx)
    sg.checkpoint.export_weights(f"{directory}/sharded", model, ctx, shard_bytes=2048)
    return state


def read_each(strategy, ctx, directory: str) -> dict[str, dict[str, torch.Tensor]]:
    model = strategy.wrap(make_block(seed=ctx.rank + 7), ctx)  # ranks start apart
    seen = {}
    for name in FILES:
        sg.checkpoint.import_weights(f"{directory}/{name}", model, ctx)
        seen[name] = whole(model)
    again = f"{directory}/again-{ctx.world_size}-{strategy.name}.safetensors"
    sg.checkpoint.export_weights(again, model, ctx)
    seen["exported again"] = safetensor_files.read(Path(again))
    return seen


TARGETS = {
    "ddp on 2": (lambda: sg.ddp_spawn(device="cpu"), 2),
    "fsdp on 3": (lambda: sg.fsdp_spawn(device="cpu"), 3),
    "fsdp x tp on 2x2": (
        lambda: sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan(), size=2),
        4,
    ),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    directory = tmp_path_factory.mktemp("weights")
    state = sg.launch(write_sources, sg.fsdp_spawn(device="cpu"), devices=2, args=(str(directory),))
    return str(directory), state[0]


def test_the_sources_hold_the_trained_state(sources):
    directory, state = sources
    assert state.keys() == make_block().state_dict().keys()
    assert not all(torch.equal(v, make_block(0).state_dict()[k]) for k, v in state.items())
    example = torch.load(f"{directory}/fsdp2_example.pt", weights_only=True)
    exported = safetensor_files.read(Path(directory, "export.safetensors"))
    for key, value in state.items():
        assert torch.equal(example[key], value) and torch.equal(exported[key], value), key


@pytest.mark.parametrize("target", TARGETS)
def test_every_format_loads_into_the_strategy_bit_for_bit(sources, target):
    directory, expected = sources
    factory, devices = TARGETS[target]
    for rank, seen in enumerate(
        sg.launch(read_each, factory(), devices=devices, args=(directory,))
    ):
        for name, state in seen.items():
            assert state.keys() == expected.keys(), (target, rank, name)
            for key, value in expected.items():
                assert state[key].dtype == value.dtype, (target, rank, name, key)
                assert torch.equal(state[key], value), f"{target}, rank {rank}, {name}: {key}"
