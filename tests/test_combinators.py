"""Combinators: each one's law, their composition on single_device and ddp, and refusals."""

from __future__ import annotations

import functools

import attrs
import pytest
import torch

import stratagem as sg
from helpers import make_inputs, make_model
from stratagem import training
from stratagem.testing import LawViolation, laws
from stratagem.testing.check import default_module

BATCH = torch.randn(8, 4, generator=torch.Generator().manual_seed(5))
STEPS = 4


model_factory = functools.partial(make_model, seed=3, features=4)
batches = functools.partial(make_inputs, features=4, seed=9)


def squares(model, batch):
    return model(batch).float().pow(2).mean()


def plain_training(steps: int = STEPS, lr: float = 0.1) -> list[torch.Tensor]:
    model = model_factory()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches(steps=steps):
        squares(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().float() for p in model.parameters()]


def train(strategy, ctx, micro: int = 1, steps: int = STEPS, lr: float = 0.1):
    """Each rank takes its share of each batch, split into ``micro`` micro-batches."""
    model = strategy.wrap(model_factory(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches(steps=steps):
        mine = batch.chunk(ctx.world_size)[ctx.rank]
        for piece in mine.chunk(micro):
            loss = strategy.step(model, piece, ctx, forward=squares)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
    return [p.detach().float().clone() for p in sg.unwrap(model).parameters()]


def close(ours, theirs, atol):
    return max(float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)) <= atol


# --- precision ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("precision", "atol"),
    [
        ("32-true", 0.0),
        ("bf16-mixed", 2e-2),
        ("16-mixed", 5e-3),
        ("bf16-true", 5e-2),
        ("16-true", 1e-2),
        ("64-true", 1e-6),
    ],
)
def test_precision_trains_close_to_32_true(precision, atol):
    [params] = sg.launch(train, sg.with_precision(sg.single_device("cpu"), precision))
    assert close(params, plain_training(), atol)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("bf16-mixed", torch.bfloat16),
        ("16-mixed", torch.float16),
        ("64-true", torch.float64),
        ("bf16-true", torch.bfloat16),
    ],
)
def test_precision_sets_the_compute_dtype(precision, dtype):
    strategy = sg.with_precision(sg.single_device("cpu"), precision)
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(4, 2), ctx)
    assert strategy.step(model, torch.ones(2, 4), ctx).dtype == dtype
    if precision.endswith("-true"):
        assert model.weight.dtype == dtype


def test_16_mixed_scales_the_loss_and_skips_overflowing_steps():
    strategy = sg.with_precision(sg.single_device("cpu"), "16-mixed")
    ctx = strategy.setup(sg.Env())
    scaler = ctx.extras["precision"].scaler
    assert scaler is not None and scaler.get_scale() == 65536.0
    model = strategy.wrap(torch.nn.Linear(4, 1), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    loss = strategy.step(
        model, torch.full((2, 4), 1e4), ctx, forward=lambda m, b: m(b).float().pow(2).sum() * 1e30
    )
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)
    assert torch.equal(model.weight, before)  # the step was skipped
    assert scaler.get_scale() < 65536.0  # and the scale backed off
    assert model.weight.grad is None


def test_an_unknown_precision_lists_the_valid_ones():
    with pytest.raises(sg.UsageError, match="'precision' must be one of '32-true'"):
        sg.with_precision(sg.single_device("cpu"), "fp8")  # type: ignore[arg-type]


# --- clipping ----------------------------------------------------------------------------


def one_step_delta(strategy, lr=1.0):
    ctx = strategy.setup(sg.Env())
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(4, 3), ctx)
    start = [p.detach().float().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss = strategy.step(model, torch.ones(2, 4) * 3, ctx, forward=squares)
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)
    delta = torch.cat(
        [(s - p.detach().float()).flatten() for s, p in zip(start, model.parameters(), strict=True)]
    )
    return delta, ctx


def test_clipping_makes_the_norm_exactly_the_bound_when_above():
    unclipped, _ = one_step_delta(sg.single_device("cpu"))
    assert unclipped.norm() > 1.0
    clipped, ctx = one_step_delta(sg.with_clipping(sg.single_device("cpu"), max_norm=1.0))
    assert clipped.norm().item() == pytest.approx(1.0, abs=1e-6)
    assert ctx.extras["clipping"].last_norm == pytest.approx(unclipped.norm().item(), rel=1e-6)


def test_clipping_leaves_gradients_below_the_bound_unchanged():
    unclipped, _ = one_step_delta(sg.single_device("cpu"))
    clipped, _ = one_step_delta(sg.with_clipping(sg.single_device("cpu"), max_norm=1e6))
    assert torch.equal(clipped, unclipped)


def test_clipping_by_value():
    clipped, _ = one_step_delta(sg.with_clipping(sg.single_device("cpu"), max_value=0.5))
    assert clipped.abs().max().item() == pytest.approx(0.5)


def summed(model, batch):
    return (
        model(batch).float().sum() / 1024
    )  # output gradients of 64 once scaled: float16 holds them


@pytest.mark.parametrize("order", ["precision-first", "clipping-first"])
def test_clipping_under_16_mixed_sees_unscaled_gradients_in_either_order(order):
    base = sg.single_device("cpu")
    if order == "precision-first":
        strategy = sg.with_clipping(sg.with_precision(base, "16-mixed"), max_norm=1.0)
    else:
        strategy = sg.with_precision(sg.with_clipping(base, max_norm=1.0), "16-mixed")
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(256, 256, bias=False), ctx)
    start = model.weight.detach().clone()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    # Each weight gradient is 2 * 5 / 1024 (640 once scaled); their norm is 2.5.
    strategy.backward(
        strategy.step(model, torch.full((2, 256), 5.0), ctx, forward=summed), model, ctx
    )
    strategy.update(optimizer, model, ctx)
    delta = (start - model.weight.detach()).norm().item()
    assert delta == pytest.approx(1.0, rel=1e-3)  # clipping scaled gradients would give ~1/65536
    assert ctx.extras["clipping"].last_norm == pytest.approx(256 * 10 / 1024, rel=1e-3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "give max_norm"),
        ({"max_norm": 0}, "'max_norm' must be a positive"),
        ({"max_value": -1.0}, "'max_value' must be a positive"),
        ({"max_norm": 1.0, "norm_type": 0}, "'norm_type' must be positive"),
    ],
)
def test_clipping_options_are_checked(options, message):
    with pytest.raises(sg.UsageError, match=message):
        sg.with_clipping(sg.single_device("cpu"), **options)


# --- accumulation ------------------------------------------------------------------------


def test_accumulation_equals_the_large_batch():
    [params] = sg.launch(train, sg.accumulate(sg.single_device("cpu"), 4), args=(4,))
    assert close(params, plain_training(), 1e-6)


def test_accumulation_normalisation_is_explicit():
    def run(normalize, count=None):
        strategy = sg.accumulate(sg.single_device("cpu"), 2, normalize=normalize)
        ctx = strategy.setup(sg.Env())
        model = strategy.wrap(torch.nn.Linear(4, 1, bias=False), ctx)
        torch.nn.init.ones_(model.weight)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        if count is not None:
            ctx.extras["accumulation"].count = count
        for _ in range(2):
            strategy.backward(strategy.step(model, torch.ones(1, 4), ctx).sum(), model, ctx)
            strategy.update(optimizer, model, ctx)
        return 1.0 - model.weight[0, 0].item()  # the applied gradient

    assert run("sum") == pytest.approx(2.0)
    assert run("mean") == pytest.approx(1.0)
    assert run("count", count=8) == pytest.approx(0.25)
    with pytest.raises(sg.UsageError, match=r"set ctx.extras\['accumulation'\].count"):
        run("count")


def test_accumulation_updates_only_at_the_end_of_a_window():
    strategy = sg.accumulate(sg.single_device("cpu"), 3)
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(2, 1), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = model.weight.detach().clone()
    for index in range(3):
        strategy.backward(strategy.step(model, torch.ones(1, 2), ctx).sum(), model, ctx)
        strategy.update(optimizer, model, ctx)
        assert torch.equal(model.weight, start) == (index < 2)


def test_accumulation_refuses_a_context_without_its_window():
    """A Context from another strategy's setup has no window: refused before a gradient moves.

    With one process's ``no_sync`` the step has nothing to enter and passes the batch on; the
    backward, which divides by the window, names the missing state and runs no backward.
    """
    strategy = sg.accumulate(sg.single_device("cpu"), 2)
    foreign = sg.single_device("cpu").setup(sg.Env())
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = strategy.step(model, torch.ones(1, 2), foreign).sum()
    with pytest.raises(sg.UsageError, match="ctx has no accumulation state; pass the Context"):
        strategy.backward(loss, model, foreign)
    assert all(parameter.grad is None for parameter in model.parameters())
    with pytest.raises(sg.UsageError, match="ctx has no accumulation state; pass the Context"):
        strategy.update(optimizer, model, foreign)
    waits = attrs.evolve(strategy, no_sync=lambda module, ctx: training.no_sync(module, ctx))
    with pytest.raises(sg.UsageError, match="ctx has no accumulation state; pass the Context"):
        waits.step(model, torch.ones(1, 2), foreign)


# --- refusals ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("apply", "message"),
    [
        (
            lambda s: sg.with_precision(sg.with_precision(s, "bf16-mixed"), "16-mixed"),
            "already has precision 'bf16-mixed'",
        ),
        (
            lambda s: sg.with_clipping(sg.with_clipping(s, max_norm=1.0), max_norm=2.0),
            "already clipped",
        ),
        (
            lambda s: sg.accumulate(sg.with_precision(sg.accumulate(s, 2), "bf16-mixed"), 4),
            "already accumulates",
        ),
    ],
)
def test_applying_a_combinator_twice_is_refused(apply, message):
    with pytest.raises(sg.CombinatorError, match=message):
        apply(sg.single_device("cpu"))


def test_combinators_touch_only_their_fields():
    base = sg.single_device("cpu")
    touched = {
        "precision bf16-mixed": (
            sg.with_precision(base, "bf16-mixed"),
            {"name", "setup", "wrap", "step"},
        ),
        "precision 16-mixed": (
            sg.with_precision(base, "16-mixed"),
            {"name", "setup", "wrap", "step", "backward", "update"},
        ),
        "clipping": (sg.with_clipping(base, max_norm=1.0), {"name", "setup", "update"}),
        "accumulate": (
            sg.accumulate(base, 2),
            {"name", "setup", "step", "backward", "update", "save"},
        ),
    }
    for what, (derived, fields) in touched.items():
        changed = {
            f.name
            for f in attrs.fields(sg.Strategy)
            if getattr(derived, f.name) != getattr(base, f.name)
        }
        assert changed == fields, what


# --- two ranks: composition and the kit's laws -----------------------------------------


def two_rank_runs(strategy, ctx):
    return {"stacked": train(strategy, ctx, micro=2)}


def stacked(base):
    return sg.accumulate(sg.with_clipping(sg.with_precision(base, "32-true"), max_norm=1e6), 2)


@pytest.mark.slow
def test_stacked_combinators_on_ddp_equal_the_plain_loop():
    ranks = sg.launch(two_rank_runs, stacked(sg.ddp_spawn(device="cpu")), devices=2)
    reference = plain_training()
    for result in ranks:
        assert close(result["stacked"], reference, 1e-6)


@pytest.mark.slow
def test_stacked_combinators_on_single_device_equal_the_plain_loop():
    [result] = sg.launch(two_rank_runs, stacked(sg.single_device("cpu")))
    assert close(result["stacked"], plain_training(), 1e-6)


@pytest.mark.slow
def test_ddp_with_combinators_obeys_the_laws(stratagem_world):
    strategy = sg.with_clipping(sg.with_precision(sg.ddp(device="cpu"), "bf16-mixed"), max_norm=1e6)
    laws.check_step_autocast(
        strategy, default_module(), BATCH, torch.bfloat16, world=stratagem_world
    )
    laws.check_data_parallel_step(
        strategy, default_module(), BATCH, world=stratagem_world, tolerance=2e-2
    )
    laws.check_no_sync(strategy, default_module(), BATCH, world=stratagem_world)


@pytest.mark.slow
def test_a_step_that_skips_the_autocast_is_caught(stratagem_world):
    broken = attrs.evolve(
        sg.with_precision(sg.ddp(device="cpu"), "bf16-mixed"),
        name="no-autocast",
        step=training.step,
    )
    with pytest.raises(LawViolation, match=r"(?s)'step-autocast'.*'no-autocast'.*autocast off"):
        laws.check_step_autocast(
            broken, default_module(), BATCH, torch.bfloat16, world=stratagem_world
        )
