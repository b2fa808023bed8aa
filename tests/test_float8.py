"""with_float8 (issue 37): torchao's float8 training as a wrap layer, emulated on the CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import stratagem as sg
from stratagem.testing import Contract, LawViolation, check_all
from stratagem.testing.tolerances import compute_dtype, without_precision

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def make_model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)
    )


def batches(count: int = 3, rows: int = 16) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(rows, 32, generator=generator) for _ in range(count)]


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def train(strategy, ctx, steps: int = 3) -> dict[str, torch.Tensor]:
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches(steps):
        share = batch.chunk(ctx.world_size)[ctx.rank]
        loss = strategy.step(model, share, ctx, forward=loss_of)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in sg.unwrap(model).named_parameters()
    }


@pytest.mark.parametrize("recipe", RECIPES)
def test_it_trains_as_torchao_by_hand_bit_for_bit(recipe) -> None:
    strategy = sg.with_float8(sg.single_device("cpu"), recipe=recipe)
    ours = train(strategy, strategy.setup(sg.Env()))
    model = make_model()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name != "3")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches():
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for name, parameter in model.named_parameters():
        assert torch.equal(ours[name], parameter.detach()), name
    # And it is float8: not what float32 training gives.
    plain = sg.single_device("cpu")
    float32 = train(plain, plain.setup(sg.Env()))
    assert not torch.equal(ours["0.weight"], float32["0.weight"])


def test_the_policy_picks_the_linear_layers_it_converts() -> None:
    strategy = sg.with_float8(sg.single_device("cpu"))
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(make_model(), ctx)
    # The default keeps a layer whose features are not multiples of 16 (the 10 outputs).
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Float8Linear", "Linear"]
    first_only = sg.with_float8(sg.single_device("cpu"), modules=lambda m: m.in_features == 32)
    model = first_only.wrap(make_model(), ctx)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Linear", "Float8Linear"]
    names = dict(make_model().named_parameters())
    assert dict(model.named_parameters()).keys() == names.keys()  # checkpoints keep their keys
    answers_none = sg.with_float8(sg.single_device("cpu"), modules=lambda m: None)
    with pytest.raises(sg.UsageError, match=r"policy must return True or False.*'0'"):
        answers_none.wrap(make_model(), ctx)


def test_it_is_refused_twice_and_with_bad_options() -> None:
    once = sg.with_float8(sg.ddp(device="cpu"))
    with pytest.raises(sg.CombinatorError, match="already trains in float8; apply it once"):
        sg.with_float8(once)
    with pytest.raises(sg.UsageError, match=r"'recipe' must be one of 'tensorwise'"):
        sg.with_float8(sg.ddp(device="cpu"), recipe="blockwise")  # type: ignore[arg-type]
    with pytest.raises(sg.UsageError, match=r"'emulate' must be None \(by device\), True or False"):
        sg.with_float8(sg.ddp(device="cpu"), emulate="yes")  # type: ignore[arg-type]


@pytest.mark.slow
def test_fsdp_in_float8_trains_as_ddp_in_float8_on_two_ranks() -> None:
    # Each rank converts before the inner wrap: under ddp every rank holds the whole float8
    # model, under fsdp the shards gather into the same weights, so each rank multiplies the
    # same float8 values and only the order of the gradients' sums differs.
    results = {
        name: sg.launch(train, sg.spawned(sg.with_float8(base)), devices=2)
        for name, base in (
            ("ddp", sg.ddp(device="cpu")),
            ("fsdp", sg.fsdp(device="cpu", shard_when=sg.every_module_of(torch.nn.Linear))),
        )
    }
    one = sg.with_float8(sg.single_device("cpu"))
    whole = train(one, one.setup(sg.Env()))
    for rank in range(2):
        for name, value in results["ddp"][rank].items():
            torch.testing.assert_close(results["fsdp"][rank][name], value, rtol=1e-5, atol=1e-6)
            # Against one process on the whole batch: each rank scales its own half, so float8
            # rounds differently; the difference stays within float8's own rounding.
            torch.testing.assert_close(value, whole[name], rtol=0.125, atol=1e-3)


@pytest.mark.slow
def test_check_all_derives_float8s_tolerance_from_the_layer(stratagem_world_of) -> None:
    # Float8Wrap declares compute_dtype (float8 e4m3): the kit derives each law's margin from its
    # epsilon as it does for bf16, with no contract written; float32's margins fail wrap-preserves.
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    strategy = sg.with_float8(sg.ddp(device="cpu"))
    assert compute_dtype(strategy) == torch.float8_e4m3fn
    assert without_precision(strategy).wrap == sg.ddp(device="cpu").wrap  # the layer peeled
    report = check_all(strategy, world=stratagem_world_of(2), module=module, batch=batch)
    assert report.passed and "precision-close-to-float32" in report.passed, report
    with pytest.raises(LawViolation, match="wrap-preserves"):
        check_all(strategy, world=stratagem_world_of(2), module=module, batch=batch,
                  contract=Contract(rtol=0.0, atol=1e-5))  # fmt: skip
