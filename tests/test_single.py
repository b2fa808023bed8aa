"""single_device(): bit-identical to plain PyTorch, identity collectives, clear errors."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import stratagem as sg
from helpers import make_batches, make_model

OPS = ["sum", "mean", "max", "min"]
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]


# A classifier of 8 features into 3 classes, and 12 batches of 10 labelled samples.
classifier = functools.partial(
    make_model, seed=1234, features=8, outputs=3, activation=torch.nn.ReLU
)
labelled_batches = functools.partial(
    make_batches, steps=12, size=10, features=8, outputs=3, labels=True, seed=99
)


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return torch.nn.functional.cross_entropy(model(inputs), labels)


def plain_loop() -> list[torch.Tensor]:
    model = classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for inputs, labels in labelled_batches():
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def strategy_loop(strategy: sg.StrategyLike, ctx: sg.Context) -> list[torch.Tensor]:
    model = strategy.wrap(classifier(), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in strategy.shard(labelled_batches(), ctx):
        loss = strategy.step(model, batch, ctx, forward=loss_fn)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return [p.detach().clone() for p in model.parameters()]


def test_single_device_loop_is_bit_identical_to_plain_pytorch():
    [ours] = sg.launch(strategy_loop, sg.single_device("cpu"))
    theirs = plain_loop()
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
    # The loop really trained: parameters moved away from their initial values.
    assert not torch.equal(ours[0], classifier()[0].weight)


def test_auto_device_is_cpu_on_a_machine_without_accelerators():
    if torch.cuda.is_available():
        pytest.skip("this check is about CPU-only machines")
    ctx = sg.single_device("auto").setup(sg.Env())
    assert ctx.device == torch.device("cpu")
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.group) == (0, 1, True, None)


@pytest.fixture
def ctx() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def tensors(dtypes: list[torch.dtype]) -> st.SearchStrategy[torch.Tensor]:
    @st.composite
    def build(draw: st.DrawFn) -> torch.Tensor:
        dtype = draw(st.sampled_from(dtypes))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        seed = draw(st.integers(0, 2**16))
        generator = torch.Generator().manual_seed(seed)
        if dtype.is_floating_point:
            return (torch.randn(shape, generator=generator) * 100).to(dtype)
        return torch.randint(0, 100, shape, generator=generator).to(dtype)

    return build()


@given(tensors(FLOAT_DTYPES), st.sampled_from(OPS))
def test_reduce_on_one_rank_is_the_identity_for_floats(tensor, op):
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    before = tensor.clone()
    result = strategy.reduce(tensor, op, ctx)
    assert result.dtype == tensor.dtype and result.shape == tensor.shape
    assert torch.equal(result, tensor)
    assert result.data_ptr() != tensor.data_ptr() or tensor.numel() == 0
    assert torch.equal(tensor, before)


@given(tensors(INT_DTYPES), st.sampled_from(["sum", "max", "min"]))
def test_reduce_on_one_rank_is_the_identity_for_integers(tensor, op):
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    result = strategy.reduce(tensor, op, ctx)
    assert result.dtype == tensor.dtype
    assert torch.equal(result, tensor)


@given(tensors(INT_DTYPES))
def test_mean_of_integers_is_a_clear_error(tensor):
    strategy = sg.single_device("cpu")
    with pytest.raises(sg.UsageError, match=r"'mean' of a torch\.\w+ tensor.*tensor\.float\(\)"):
        strategy.reduce(tensor, "mean", strategy.setup(sg.Env()))


@given(tensors(FLOAT_DTYPES + INT_DTYPES))
def test_gather_on_one_rank_adds_a_dimension_of_one(tensor):
    strategy = sg.single_device("cpu")
    result = strategy.gather(tensor, strategy.setup(sg.Env()))
    assert result.shape == (1, *tensor.shape)
    assert result.dtype == tensor.dtype
    assert torch.equal(result[0], tensor)


@given(st.sampled_from(["avg", "SUM", "product", "", None, 3]))
def test_an_unknown_reduce_op_lists_the_valid_ones(op):
    strategy = sg.single_device("cpu")
    with pytest.raises(sg.UsageError, match="'op' must be one of 'sum', 'mean', 'max', 'min'"):
        strategy.reduce(torch.ones(1), op, strategy.setup(sg.Env()))


def test_broadcast_and_barrier_on_one_rank(ctx):
    strategy = sg.single_device("cpu")
    tensor = torch.arange(3.0)
    copy = strategy.broadcast(tensor, ctx)
    assert torch.equal(copy, tensor) and copy.data_ptr() != tensor.data_ptr()
    assert strategy.broadcast({"lr": 0.1}, ctx) == {"lr": 0.1}
    with pytest.raises(sg.UsageError, match="'src' must be a rank in"):
        strategy.broadcast(tensor, ctx, src=1)
    assert strategy.barrier(ctx) is None


@dataclasses.dataclass
class Pair:
    inputs: torch.Tensor
    label: str


class Named(NamedTuple):
    x: torch.Tensor
    y: list[torch.Tensor]


def test_step_reaches_tensors_inside_containers(ctx):
    strategy = sg.single_device("cpu")
    batch = {
        "pair": Pair(torch.ones(2), "a"),
        "named": Named(torch.zeros(1), [torch.ones(1)]),
        "n": 3,
    }
    seen = strategy.step(torch.nn.Identity(), batch, ctx, forward=lambda module, b: b)
    assert isinstance(seen["pair"], Pair) and seen["pair"].label == "a"
    assert isinstance(seen["named"], Named) and isinstance(seen["named"].y, list)
    assert seen["n"] == 3
    assert torch.equal(seen["pair"].inputs, torch.ones(2))


def test_step_without_forward_calls_the_module(ctx):
    strategy = sg.single_device("cpu")
    model = strategy.wrap(torch.nn.Linear(4, 2), ctx)
    assert strategy.step(model, torch.ones(3, 4), ctx).shape == (3, 2)


def test_backward_refuses_a_non_scalar_loss(ctx):
    strategy = sg.single_device("cpu")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        sg.UsageError,
        match=r"one-element tensor \(got a tensor of shape \(4, 2\)\).*loss\.mean\(\)",
    ):
        strategy.backward(model(torch.ones(4, 2)), model, ctx)
    with pytest.raises(sg.UsageError, match="does not require grad"):
        strategy.backward(torch.tensor(1.0), model, ctx)


def test_wrap_refuses_what_is_not_a_module(ctx):
    with pytest.raises(sg.UsageError, match="'module' must be a torch.nn.Module"):
        sg.single_device("cpu").wrap("model", ctx)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", ["gpu", 3, "cuda:x"])
def test_bad_device_names_the_argument(device):
    with pytest.raises(sg.UsageError, match="'device' must be 'auto'"):
        sg.single_device(device)  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU-only machine")
def test_cuda_on_a_cpu_machine_is_a_clear_error():
    with pytest.raises(sg.UsageError, match="CUDA is not available"):
        sg.single_device("cuda").setup(sg.Env())


def test_single_device_refuses_a_multi_process_world():
    with pytest.raises(sg.LaunchError, match="use ddp"):
        sg.single_device("cpu").setup(
            sg.Env(rank=0, world_size=2, local_world_size=2, source="torchrun")
        )


def test_context_extras_are_read_only_and_never_overwritten(ctx):
    scaler = object()
    richer = ctx.with_extras(grad_scaler=scaler)
    assert richer.extras["grad_scaler"] is scaler
    assert dict(ctx.extras) == {}  # the original is unchanged
    with pytest.raises(TypeError):
        richer.extras["grad_scaler"] = None  # type: ignore[index]
    with pytest.raises(sg.UsageError, match=r"already holds \['grad_scaler'\].*applied twice"):
        richer.with_extras(grad_scaler=object())
