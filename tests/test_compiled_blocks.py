"""Per-block compile (issue 37): ``compiled(blocks=policy)`` compiles each picked block before
fsdp shards it, composes with activation checkpointing, and trains as the eager run does."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from helpers import Block, make_block

STEPS = 3


def blocks() -> torch.nn.Module:
    return torch.nn.Sequential(make_block(seed=0), make_block(seed=1))


def train(strategy, ctx) -> dict[str, object]:
    model = strategy.wrap(blocks(), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(7)
    for _ in range(STEPS):
        batch = torch.randn(4, 6, 16, generator=generator)  # the global batch, dealt below
        mine = batch.chunk(ctx.world_size)[ctx.rank]
        loss = strategy.step(model, mine, ctx, forward=lambda m, b: m(b).square().mean())
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    plain = sg.unwrap(model)
    state = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in plain.state_dict().items()
    }
    compiled = [getattr(m, "_compiled_call_impl", None) is not None for m in plain]
    return {"state": state, "blocks compiled": compiled, "root compiled": type(model).__name__}


@pytest.mark.slow
def test_per_block_compile_under_fsdp_and_checkpointing_trains_as_eager():
    [eager] = sg.launch(train, sg.single_device("cpu"))
    stack = sg.with_activation_checkpointing(
        sg.compiled(sg.fsdp_spawn(device="cpu"), blocks=sg.every_module_of(Block)),
        sg.every_module_of(Block),
    )
    for rank, result in enumerate(sg.launch(train, stack, devices=2)):
        assert result["blocks compiled"] == [True, True], rank
        assert result["root compiled"] == "FSDPSequential", rank  # not an OptimizedModule
        assert result["state"].keys() == eager["state"].keys()  # names as they were
        for key, value in eager["state"].items():
            torch.testing.assert_close(result["state"][key], value, rtol=1e-5, atol=1e-6)


def test_a_blocks_policy_that_is_not_a_function_is_refused():
    with pytest.raises(sg.UsageError, match=r"'blocks' must be a function module -> bool or None"):
        sg.compiled(sg.single_device("cpu"), blocks="Block")
