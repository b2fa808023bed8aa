"""The Strategy record: frozen, validated at construction and at every evolve, protocol-compatible."""

from __future__ import annotations

import contextlib
import pickle
from typing import Any, NamedTuple

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import stratagem as sg
from stratagem.strategy import FIELD_SIGNATURES

FUNCTION_FIELDS = sorted(FIELD_SIGNATURES)


def test_every_designed_field_is_present():
    names = {f.name for f in attrs.fields(sg.Strategy)}
    assert names == {"name", *FUNCTION_FIELDS}
    assert set(FUNCTION_FIELDS) == {
        "launch",
        "setup",
        "wrap",
        "step",
        "backward",
        "update",
        "no_sync",
        "reduce",
        "gather",
        "broadcast",
        "barrier",
        "shard",
        "save",
        "load",
        "teardown",
    }


def test_assigning_a_field_raises():
    strategy = sg.single_device("cpu")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        strategy.reduce = lambda tensor, op, ctx: tensor  # type: ignore[misc]


def test_strategy_is_picklable_and_equal_after_a_round_trip():
    strategy = sg.single_device("cpu")
    assert pickle.loads(pickle.dumps(strategy)) == strategy


non_callables = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(),
    st.lists(st.integers(), max_size=3),
)


@given(st.sampled_from(FUNCTION_FIELDS), non_callables)
def test_a_non_callable_field_is_refused_by_name(field, value):
    with pytest.raises(sg.StrategyFieldError) as info:
        attrs.evolve(sg.single_device("cpu"), **{field: value})
    message = str(info.value)
    assert f"'{field}' must be callable as {field}(" in message
    assert repr(value)[:20] in message
    assert type(value).__name__ in message
    assert isinstance(info.value, TypeError)


def _with_arity(n: int) -> Any:
    names = ", ".join(f"a{i}" for i in range(n))
    namespace: dict[str, Any] = {}
    exec(f"def f({names}):\n    return None", namespace)
    return namespace["f"]


@given(st.sampled_from(FUNCTION_FIELDS), st.integers(0, 6))
def test_a_function_with_the_wrong_arity_is_refused(field, arity):
    spec = FIELD_SIGNATURES[field]
    function = _with_arity(arity)
    fits = arity == spec.positional and not spec.keywords
    if fits:
        assert (
            attrs.evolve(sg.single_device("cpu"), **{field: function}).__getattribute__(field)
            is function
        )
    else:
        with pytest.raises(
            sg.StrategyFieldError, match=rf"'{field}' must accept the arguments of {field}\("
        ):
            attrs.evolve(sg.single_device("cpu"), **{field: function})


def test_keyword_arguments_are_part_of_the_contract():
    def step_without_forward(module, batch, ctx):
        return module(batch)

    with pytest.raises(sg.StrategyFieldError, match="forward"):
        attrs.evolve(sg.single_device("cpu"), step=step_without_forward)

    def broadcast_any(obj, ctx, **options):
        return obj

    assert attrs.evolve(sg.single_device("cpu"), broadcast=broadcast_any).broadcast is broadcast_any


def test_variadic_functions_and_callable_objects_are_accepted():
    @attrs.frozen
    class Reduce:
        scale: float

        def __call__(self, tensor, op, ctx):
            return tensor * self.scale

    strategy = attrs.evolve(sg.single_device("cpu"), reduce=Reduce(2.0), barrier=lambda *a: None)
    ctx = strategy.setup(sg.Env())
    assert strategy.reduce(torch.ones(2), "sum", ctx).tolist() == [2.0, 2.0]


@given(st.one_of(st.just(""), st.integers(), st.none()))
def test_name_must_be_a_non_empty_string(name):
    with pytest.raises(sg.StrategyFieldError, match="'name' must be a non-empty str"):
        attrs.evolve(sg.single_device("cpu"), name=name)


def test_all_fields_are_required():
    with pytest.raises(TypeError, match="missing"):
        sg.Strategy(name="half")  # type: ignore[call-arg]


class TupleStrategy(NamedTuple):
    """A user's own record type: no Strategy involved."""

    name: str
    launch: Any
    setup: Any
    wrap: Any
    step: Any
    backward: Any
    update: Any
    no_sync: Any
    reduce: Any
    gather: Any
    broadcast: Any
    barrier: Any
    shard: Any
    save: Any
    load: Any
    teardown: Any


def test_a_namedtuple_record_is_strategy_like_and_launches():
    base = sg.single_device("cpu")
    record = TupleStrategy(**{f.name: getattr(base, f.name) for f in attrs.fields(sg.Strategy)})
    assert isinstance(record, sg.StrategyLike)

    def world_size(strategy, ctx):
        assert strategy is record
        with strategy.no_sync(torch.nn.Linear(1, 1), ctx):
            return ctx.world_size

    assert sg.launch(world_size, record) == [1]


def test_launch_refuses_what_is_not_strategy_like():
    with pytest.raises(sg.UsageError, match="'strategy' must be a Strategy"):
        sg.launch(lambda s, c: None, object())  # type: ignore[arg-type]


@pytest.mark.parametrize("devices", [0, -1, 1.5, "two", True])
def test_launch_refuses_bad_devices(devices):
    with pytest.raises(sg.UsageError, match="'devices' must be a positive int"):
        sg.launch(lambda s, c: None, sg.single_device("cpu"), devices=devices)


def test_single_device_cannot_claim_two_devices_in_one_process():
    with pytest.raises(sg.LaunchError, match="devices=2.*ddp_spawn"):
        sg.launch(lambda s, c: None, sg.single_device("cpu"), devices=2)


def test_no_sync_of_single_device_is_a_context_manager():
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    with strategy.no_sync(torch.nn.Linear(1, 1), ctx) as entered:
        assert entered is None
    assert isinstance(
        strategy.no_sync(torch.nn.Linear(1, 1), ctx), contextlib.AbstractContextManager
    )


@pytest.mark.parametrize(
    ("derived", "base", "fields"),
    [
        (
            lambda: sg.ddp(device="cpu"),
            lambda: sg.single_device(device="cpu"),
            {"setup", "wrap", "no_sync", "shard", "teardown"},
        ),
        (lambda: sg.ddp_spawn(device="cpu"), lambda: sg.ddp(device="cpu"), {"launch"}),
        (
            lambda: sg.fsdp(device="cpu"),
            lambda: sg.ddp(device="cpu"),
            {"setup", "wrap", "update", "no_sync"},
        ),
        (lambda: sg.fsdp_spawn(device="cpu"), lambda: sg.fsdp(device="cpu"), {"launch"}),
        (lambda: sg.dp(), lambda: sg.single_device("cpu"), {"setup", "wrap"}),
        (
            lambda: sg.allreduce_grads(device="cpu"),
            lambda: sg.ddp(device="cpu"),
            {"wrap", "update", "no_sync"},
        ),
    ],
    ids=["ddp", "ddp_spawn", "fsdp", "fsdp_spawn", "dp", "allreduce_grads"],
)
def test_each_built_in_is_its_base_with_the_documented_fields_substituted(derived, base, fields):
    a, b = derived(), base()
    changed = {
        f.name
        for f in attrs.fields(sg.Strategy)
        if f.name != "name" and getattr(a, f.name) != getattr(b, f.name)
    }
    assert changed == fields
