"""pipeline() on real gloo ranks: every schedule trains as one process, with the loop of ddp().

Each test trains with `train`, the loop of test_tensor_parallel (wrap, shard,
step, backward, update), and compares every parameter and AdamW slot, by key,
and every step's loss, with ``single_device()`` training on the whole batch.
A pipeline's ranks hold different keys: together they must hold each key of
the unsplit module once per pipeline, equal to the reference.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from helpers import Block

STEPS = 3
BATCH = 8
MICROBATCHES = 4
# Each schedule with its stages on 2 ranks: one stage per rank, or two (interleaved, V).
TWO = (("0", "1", "2", "3"), ("4", "5", "6"))
FOUR = (("0", "1"), ("2", "3"), ("4", "5"), ("6",))
SCHEDULES = {
    "gpipe": TWO,
    "1f1b": TWO,
    "interleaved-1f1b": FOUR,
    "looped-bfs": FOUR,
    "interleaved-zero-bubble": FOUR,
    "zbv-zero-bubble": FOUR,
}


def make_mlp(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for inputs, outputs in ((6, 16), (16, 16), (16, 16)):
        layers += [torch.nn.Linear(inputs, outputs), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(16, 2))


def make_transformer(seed: int = 0) -> torch.nn.Sequential:
    """A projection in, three transformer blocks, a projection out: sequences of 6 x 8."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), Block(), Block(), Block(), torch.nn.Linear(16, 8)
    )


def mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def dataset(shape: tuple[int, ...], outputs: tuple[int, ...]) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(STEPS * BATCH, *shape, generator=generator),
        torch.randn(STEPS * BATCH, *outputs, generator=generator),
    )


MODELS = {
    "mlp": (make_mlp, ((6,), (2,))),
    "transformer": (make_transformer, ((6, 8), (6, 8))),
}


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW slot (but the step count), by the unsplit module's names."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for parameter, slots in optimizer.state.items():
        for slot, value in slots.items():
            if slot != "step":
                state[f"optimizer.{names[id(parameter)]}.{slot}"] = value.clone()
    return state


def train(strategy, ctx, model_name: str = "mlp", seed: int | None = None) -> dict[str, object]:
    """The loop of ddp(): wrap, shard, step, backward, update; ranks start from different weights."""
    build, shapes = MODELS[model_name]
    model = strategy.wrap(build(seed=ctx.rank if seed is None else seed), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _, replicas = ctx.data_parallel
    loader = DataLoader(dataset(*shapes), batch_size=BATCH // replicas)
    losses = []
    for batch in strategy.shard(loader, ctx):
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        losses.append(float(strategy.reduce(loss.detach(), "mean", ctx)))
    return {
        "state": state_of(model, optimizer),
        "losses": losses,
        "dp": ctx.data_parallel,
        "mesh": getattr(ctx.mesh, "mesh_dim_names", None),
    }


def reference(model_name: str = "mlp") -> dict[str, object]:
    strategy = sg.single_device("cpu")
    return train(strategy, strategy.setup(sg.Env()), model_name, seed=0)


def assert_trains_as_one_process(results: list[dict], expected: dict, pipelines: int) -> None:
    """Each pipeline's ranks hold every key once, equal to one process; every loss equals its."""
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["losses"], expected["losses"], rtol=1e-6, atol=1e-7)
        for key, value in result["state"].items():
            torch.testing.assert_close(
                value, expected["state"][key], rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {key}"
            )
    size = len(results) // pipelines
    for first in range(0, len(results), size):
        keys = [k for result in results[first : first + size] for k in result["state"]]
        assert sorted(keys) == sorted(expected["state"]), f"pipeline of ranks {first}.."


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_schedule_on_two_ranks_trains_as_one_process(schedule):
    strategy = sg.spawned(
        sg.pipeline(
            stages=SCHEDULES[schedule],
            schedule=schedule,
            microbatches=MICROBATCHES,
            timeout=60,
            device="cpu",
        )
    )
    results = sg.launch(train, strategy, devices=2)
    assert [r["dp"] for r in results] == [(0, 1), (0, 1)]
    assert_trains_as_one_process(results, reference(), pipelines=1)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_schedule_as_dp_x_pp_on_four_ranks_trains_as_one_process(schedule):
    stages = SCHEDULES[schedule]
    names = {"replicate": "dp_replicate", "pp": "stage"}  # the user's (issue 36), not "dp", "pp"
    strategy = sg.spawned(
        sg.pipeline(
            stages=stages,
            schedule=schedule,
            microbatches=2,
            size=2,
            mesh_names=names,
            timeout=60,
            device="cpu",
        )
    )
    results = sg.launch(train, strategy, devices=4)
    assert {r["mesh"] for r in results} == {("dp_replicate", "stage")}
    # Pipelines of consecutive ranks, each replica its own half of the batch.
    assert [r["dp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # A replica's loss is its half's; their mean (reduced in train) is the whole batch's.
    assert_trains_as_one_process(results, reference(), pipelines=2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zbv-zero-bubble"])
def test_a_transformer_trains_as_one_process(schedule):
    stages = {
        "1f1b": (("0", "1"), ("2", "3", "4")),
        "zbv-zero-bubble": (("0",), ("1",), ("2",), ("3", "4")),
    }
    strategy = sg.spawned(
        sg.pipeline(
            stages=stages[schedule],
            schedule=schedule,
            microbatches=MICROBATCHES,
            timeout=60,
            device="cpu",
        )
    )
    results = sg.launch(train, strategy, devices=2, args=("transformer",))
    assert_trains_as_one_process(results, reference("transformer"), pipelines=1)


# ------------------------------------------------------------------------------ combinators


def clipped_to_2(strategy: sg.Strategy) -> sg.Strategy:
    return sg.with_clipping(strategy, max_norm=0.05)  # below the norms of these steps: clips


def clipped_to_inf(strategy: sg.Strategy) -> sg.Strategy:
    return sg.with_clipping(strategy, max_norm=0.01, norm_type=float("inf"))


def in_bf16(strategy: sg.Strategy) -> sg.Strategy:
    return sg.with_precision(strategy, "bf16-mixed")


def train_reporting_norms(strategy, ctx) -> dict[str, object]:
    result = train(strategy, ctx, seed=0)
    clipping = ctx.extras.get("clipping")
    result["norm"] = None if clipping is None else clipping.last_norm
    return result


def recomputing(strategy: sg.Strategy) -> sg.Strategy:
    return sg.with_activation_checkpointing(strategy, sg.every_module_of(torch.nn.Linear))


# (combinator, tolerance): bf16's rounding depends on how the batch is split.
COMBINED = {
    "clip-2": (clipped_to_2, 1e-5),
    "clip-inf": (clipped_to_inf, 1e-5),
    "bf16": (in_bf16, 2e-2),
    "activation-checkpointing": (recomputing, 1e-5),
}


@pytest.mark.slow
@pytest.mark.parametrize("combined", COMBINED)
def test_a_combinator_on_a_pipeline_trains_as_on_one_process(combined):
    # Clipping: the norm is the whole model's, over every stage, not each rank's own.
    combinator, tolerance = COMBINED[combined]
    strategy = sg.spawned(
        combinator(sg.pipeline(stages=TWO, schedule="1f1b", microbatches=4, device="cpu"))
    )
    results = sg.launch(train_reporting_norms, strategy, devices=2)
    alone = combinator(sg.single_device("cpu"))
    expected = train_reporting_norms(alone, alone.setup(sg.Env()))
    for rank, result in enumerate(results):
        if expected["norm"] is not None:
            assert result["norm"] == pytest.approx(expected["norm"], rel=1e-5), rank
        for key, value in result["state"].items():
            torch.testing.assert_close(
                value, expected["state"][key], rtol=tolerance, atol=tolerance, msg=key
            )


def test_combinators_that_change_the_loss_before_backward_refuse_a_pipeline():
    # A pipeline's step has run the backward: a loss scaled afterwards would reach no gradient.
    strategy = sg.pipeline(stages=TWO, schedule="1f1b", microbatches=4, device="cpu")
    with pytest.raises(sg.CombinatorError, match=r"microbatches=8"):
        sg.accumulate(strategy, 2)
    with pytest.raises(sg.CombinatorError, match=r"'16-mixed'.*bf16-mixed"):
        sg.with_precision(strategy, "16-mixed")
    sg.accumulate(sg.with_precision(sg.ddp(device="cpu"), "16-mixed"), 2)  # no pipeline: accepted


def train_two_steps_an_update(strategy, ctx) -> dict[str, object]:
    """The loop of ddp() with an update every second batch: gradients of two batches add up."""
    model = strategy.wrap(make_mlp(seed=0), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = DataLoader(dataset((6,), (2,)), batch_size=BATCH // 2)
    for index, batch in enumerate(strategy.shard(loader, ctx)):
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        if index % 2:
            strategy.update(optimizer, model, ctx)
    return {"state": state_of(model, optimizer)}


@pytest.mark.slow
def test_two_steps_before_an_update_add_their_gradients_as_one_process_does():
    strategy = sg.spawned(sg.pipeline(stages=TWO, schedule="1f1b", microbatches=2, device="cpu"))
    results = sg.launch(train_two_steps_an_update, strategy, devices=2)
    alone = sg.single_device("cpu")
    expected = train_two_steps_an_update(alone, alone.setup(sg.Env()))
    for result in results:
        for key, value in result["state"].items():
            torch.testing.assert_close(value, expected["state"][key], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- a failing rank


class FailsOn(torch.nn.Module):
    """Identity that raises on rank `rank` in the second step, in the middle of the schedule."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.calls = rank, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        self.calls += 1
        if dist.get_rank() == self.rank and self.calls == MICROBATCHES + 2:
            raise ValueError(f"bad micro-batch on rank {self.rank}")
        return x


def train_failing(strategy, ctx, failing: int) -> None:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)]
    layers.insert(2 if failing == 1 else 1, FailsOn(failing))  # into the stage of that rank
    model = strategy.wrap(torch.nn.Sequential(*layers), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    for batch in strategy.shard(DataLoader(dataset((6,), (2,)), batch_size=BATCH), ctx):
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "failing"), [("gpipe", 1), ("1f1b", 1), ("1f1b", 0)])
def test_a_rank_raising_mid_schedule_stops_the_others_naming_it(schedule, failing):
    # Mid-schedule: the other rank waits for activations or gradients that never come (gloo
    # pipelining has hung there before, pytorch#132644); the launcher must end it, promptly.
    stages = (("0", "1"), ("2", "3"))
    strategy = sg.spawned(
        sg.pipeline(
            stages=stages, schedule=schedule, microbatches=MICROBATCHES, timeout=60, device="cpu"
        ),
        sg.Spawn(stop_grace=5),
    )
    started = time.monotonic()
    with pytest.raises(sg.RankError) as caught:
        sg.launch(train_failing, strategy, devices=2, args=(failing,))
    elapsed = time.monotonic() - started
    # The module's own error, as under ddp() (torch's stage wraps it in a RuntimeError).
    assert (caught.value.rank, caught.value.exc_type) == (failing, "ValueError")
    assert f"bad micro-batch on rank {failing}" in str(caught.value)
    assert elapsed < 45, f"the other rank took {elapsed:.0f} s to stop"


# ------------------------------------------------------------------------------- bad input


def test_a_bad_configuration_is_refused_at_construction_naming_the_fix():
    with pytest.raises(sg.UsageError, match=r"'schedule' must be one of 'gpipe', '1f1b'"):
        sg.pipeline(stages=TWO, schedule="zigzag", microbatches=4, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(sg.UsageError, match=r"'microbatches' must be a positive int \(got 0"):
        sg.pipeline(stages=TWO, microbatches=0, device="cpu")
    with pytest.raises(sg.UsageError, match=r"'stages' must be a list of stages"):
        sg.pipeline(stages="0123", microbatches=4, device="cpu")  # type: ignore[arg-type]
    with pytest.raises(sg.UsageError, match=r"needs at least as many micro-batches as stages"):
        sg.pipeline(stages=TWO, schedule="1f1b", microbatches=1, size=2, device="cpu")
    with pytest.raises(sg.UsageError, match=r"'mesh_names' must be a MeshNames or a mapping"):
        sg.pipeline(stages=TWO, microbatches=4, mesh_names={"dp": "x"}, device="cpu")
    with pytest.raises(sg.UsageError, match=r"each role needs a name of its own"):
        sg.pipeline(stages=TWO, microbatches=4, mesh_names={"pp": "dp"}, device="cpu")
    with pytest.raises(sg.UsageError, match=r"several stages on each rank.*module paths"):
        sg.pipeline(
            stages=lambda module, index, count: module,
            schedule="zbv-zero-bubble",
            microbatches=4,
            device="cpu",
        )


def test_a_stage_count_or_size_that_does_not_fit_the_world_is_refused_before_joining():
    env = sg.Env(rank=0, world_size=4, local_world_size=4, master_port=1)  # nothing listens there
    strategy = sg.pipeline(stages=TWO, schedule="1f1b", microbatches=4, device="cpu")
    with pytest.raises(
        sg.UsageError,
        match=r"needs exactly 4 \(one per pipeline rank\) stages, but 'stages' gives 2",
    ):
        strategy.setup(env)
    with pytest.raises(sg.UsageError, match=r"size=3 does not divide the world of 4 ranks"):
        sg.pipeline(
            stages=(("0", "1"), ("2", "3"), ("4", "5", "6")), microbatches=4, size=3, device="cpu"
        ).setup(env)
    zbv = sg.pipeline(stages=FOUR, schedule="zbv-zero-bubble", microbatches=4, device="cpu")
    with pytest.raises(sg.UsageError, match=r"needs exactly 8 \(two per pipeline rank, a V\)"):
        zbv.setup(env)


def test_a_split_that_names_no_submodule_or_leaves_parameters_out_is_refused_at_wrap():
    ctx = sg.Context(env=sg.Env(), device=torch.device("cpu"))
    unknown = sg.pipeline(stages=(("0", "1"), ("2", "head")), microbatches=4, device="cpu")
    with pytest.raises(sg.UsageError, match=r"stages\[1\] names 'head', which is no submodule"):
        unknown.wrap(make_mlp(), ctx)
    partial = sg.pipeline(stages=(("0", "1"), ("2", "3")), microbatches=4, device="cpu")
    with pytest.raises(
        sg.UsageError, match=r"\['4.weight', '4.bias', '6.weight', '6.bias'\].* belong to no stage"
    ):
        partial.wrap(make_mlp(), ctx)
    twice = sg.pipeline(stages=(("0", "2"), ("2", "4", "6")), microbatches=4, device="cpu")
    with pytest.raises(sg.UsageError, match=r"'2.weight' belongs to stages \[0, 1\]"):
        twice.wrap(make_mlp(), ctx)


@pytest.fixture
def alone():
    """A pipeline of one rank in this process: the whole MLP one stage, 4 micro-batches."""
    strategy = sg.pipeline(
        stages=(tuple("0123456"),), schedule="gpipe", microbatches=4, device="cpu"
    )
    ctx = strategy.setup(sg.Env())
    try:
        yield strategy, ctx, strategy.wrap(make_mlp(), ctx)
    finally:
        strategy.teardown(ctx)


def test_a_pipeline_of_one_rank_steps_as_one_process(alone):
    strategy, ctx, model = alone
    batch = (torch.randn(8, 6), torch.randn(8, 2))
    expected = make_mlp()
    mse(expected, batch).backward()
    loss = strategy.step(model, batch, ctx, forward=mse)
    assert not loss.requires_grad and loss.shape == ()
    strategy.backward(loss, model, ctx)  # a no-op that checks: the schedule backpropagated
    for (name, mine), theirs in zip(model.named_parameters(), expected.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=1e-7, msg=name)
    with strategy.no_sync(model, ctx):
        pass
    strategy.update(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)
    assert all(p.grad is None for p in model.parameters())


def twice(model, batch):
    return mse(model, batch) + mse(model, batch)


def scaled(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs * 2), targets)


def test_what_a_pipeline_cannot_honour_is_a_usage_error(alone):
    from stratagem.strategies.pipeline_stages import NOT_A_PIPELINE_MODULE
    from stratagem.strategies.pipeline_step import (
        FORWARD_NOT_HONOURED,
        NEEDS_A_FORWARD,
        NOT_THE_STEP_LOSS,
    )

    strategy, ctx, model = alone
    batch = (torch.randn(8, 6), torch.randn(8, 2))
    with pytest.raises(
        sg.UsageError, match=r"microbatches=4\) does not divide this batch of 6 rows"
    ):
        strategy.step(model, (batch[0][:6], batch[1][:6]), ctx, forward=mse)
    with pytest.raises(sg.UsageError, match=r"'batch' must be a pair \(inputs, targets\)"):
        strategy.step(model, batch[0], ctx, forward=mse)
    with pytest.raises(sg.UsageError) as caught:
        strategy.step(model, batch, ctx)
    assert str(caught.value) == NEEDS_A_FORWARD
    for forward, what in ((twice, "it called model twice"), (scaled, "with other arguments")):
        with pytest.raises(sg.UsageError) as caught:
            strategy.step(model, batch, ctx, forward=forward)
        assert what in str(caught.value)
        assert str(caught.value).startswith(FORWARD_NOT_HONOURED.split("{")[0])
    loss = strategy.step(model, batch, ctx, forward=mse)
    with pytest.raises(sg.UsageError) as caught:
        strategy.backward(loss * 2, model, ctx)  # a term added after step would be lost
    assert str(caught.value).startswith(NOT_THE_STEP_LOSS.split("{")[0])
    with pytest.raises(sg.UsageError) as caught:
        strategy.step(make_mlp(), batch, ctx, forward=mse)
    assert str(caught.value).startswith(
        NOT_A_PIPELINE_MODULE.format(function="step", got="X").split("X")[0]
    )


# ------------------------------------------------------------------------------ checkpoints


def test_a_pipeline_of_one_rank_saves_and_loads_under_single_device(alone, tmp_path):
    _, ctx, model = alone
    path = str(tmp_path / "ckpt")
    sg.checkpoint.save(path, {"model": model}, ctx)
    other = make_mlp(seed=3)
    sg.checkpoint.load(path, {"model": other}, ctx)
    assert sorted(other.state_dict()) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
