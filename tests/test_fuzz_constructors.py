"""Random input to every public constructor: a valid object, or one of stratagem's errors.

Never an AttributeError, KeyError, OverflowError or an error from deep inside
torch: the constructors check what they are given before they use it. What
does construct is checked to be usable (its invariants hold). ``detect_env``
is fuzzed in tests/test_env.py; argument names outside a signature are
Python's own TypeError and are not drawn here.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.process_group import WorldOptions
from stratagem.strategy import FIELD_SIGNATURES
from stratagem.validators import MAX_SECONDS

T = TypeVar("T")

FUNCTIONS: list[Callable[..., Any]] = [
    lambda: None,
    lambda a: None,
    lambda a, b: None,
    lambda a, b, c: None,
    lambda a, b, c, d: None,
    lambda *args, **kwargs: None,
    lambda a, b, c, /, *, forward=None: None,
    lambda a, b, /, *, src=0: None,
    lambda a, *, required: None,
    print,
    len,
    int,
    torch.nn.Linear,
    sg.single_device("cpu").reduce,
    sg.Spawn(),
    sg.every_module_of(torch.nn.Linear),
]

WORDS = [
    "",
    "auto",
    "cpu",
    "cuda",
    "cuda:0",
    "meta",
    "mps",
    "world",
    "node",
    "gloo",
    "nccl",
    "32-true",
    "16-mixed",
    "bf16",
    "fp16",
    "mean",
    "sum",
    "count",
    "single",
    "torchrun",
    "spawn",
    "127.0.0.1",
    "inductor",
    "eager",
    "max-autotune",
]

OBJECTS: list[Any] = [
    torch.device("cpu"),
    torch.device("meta"),
    timedelta(seconds=5),
    timedelta(0),
    timedelta(days=-1),
    timedelta.max,
    sg.Env(),
    torch.nn.Linear,
    torch.nn.Module,
    int,
    torch.ones(2),
    torch.tensor(3),
    np.array([1, 2]),
    np.int64(2),
    Path("x"),
    range(2),
    [torch.nn.Linear],
    (0, 1),
    {"epoch": 1, "consumed": 0},
]

junk: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 5),
    st.integers(),
    st.floats(),
    st.sampled_from([math.inf, -math.inf, math.nan, 1e300, 1e-300, 0.5, MAX_SECONDS + 1.0]),
    st.text(max_size=6),
    st.sampled_from(WORDS),
    st.binary(max_size=3),
    st.lists(st.integers(-2, 4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 3), max_size=2),
    st.sampled_from(FUNCTIONS),
    st.sampled_from(OBJECTS),
    st.builds(object),
)


def maybe(build: Callable[[], T], kind: type[Any]) -> T | None:
    """Return what ``build`` makes (checked to be a ``kind``), or None if it raised our error."""
    try:
        made = build()
    except sg.StratagemError:
        return None
    assert isinstance(made, kind), made
    return made


def options(names: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(st.sampled_from(names), junk, max_size=len(names))


def keywords(function: Callable[..., Any], *leave_out: str) -> list[str]:
    """The keywords ``function`` takes; ``**world`` stands for the `WorldOptions` keys."""
    out = []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            out += [] if name != "world" else list(WorldOptions.__annotations__)
        elif name not in leave_out:
            out.append(name)
    return out


SINGLE = sg.single_device("cpu")
BASES = [
    SINGLE,
    sg.ddp(device="cpu"),
    sg.allreduce_grads(device="cpu"),
    sg.dp(),
    sg.ddp_spawn(device="cpu"),
]
strategies_or_junk = st.one_of(st.sampled_from(BASES), junk)


def assert_usable(strategy: sg.Strategy) -> None:
    for name in FIELD_SIGNATURES:
        assert callable(getattr(strategy, name))
    assert isinstance(strategy.name, str) and strategy.name
    assert attrs.evolve(strategy) == strategy  # validators accept what they built


FEW = settings(max_examples=60, deadline=None)
MANY = settings(max_examples=150, deadline=None)


# --- the record ------------------------------------------------------------------------------


@MANY
@given(st.dictionaries(st.sampled_from(["name", *FIELD_SIGNATURES]), junk, min_size=1))
def test_evolving_a_strategy_with_random_fields(changes):
    made = maybe(lambda: attrs.evolve(SINGLE, **changes), sg.Strategy)
    if made is not None:
        assert_usable(made)
        assert all(getattr(made, k) is v for k, v in changes.items())


@FEW
@given(st.fixed_dictionaries(dict.fromkeys(["name", *FIELD_SIGNATURES], junk)))
def test_building_a_strategy_from_random_fields(fields):
    made = maybe(lambda: sg.Strategy(**fields), sg.Strategy)
    if made is not None:
        assert_usable(made)


# --- factories -------------------------------------------------------------------------------


@MANY
@given(junk)
def test_single_device(device):
    made = maybe(lambda: sg.single_device(device), sg.Strategy)
    if made is not None:
        assert_usable(made)


@MANY
@given(junk)
def test_dp(device_ids):
    made = maybe(lambda: sg.dp(device_ids=device_ids), sg.Strategy)
    if made is not None:
        assert made.setup.device_ids is None or all(i >= 0 for i in made.setup.device_ids)


@MANY
@given(options(keywords(sg.ddp)), st.one_of(st.none(), st.just(sg.Spawn()), junk), st.booleans())
def test_ddp_and_ddp_spawn(chosen, start, spawned):
    build = (lambda: sg.ddp_spawn(start=start, **chosen)) if spawned else lambda: sg.ddp(**chosen)
    made = maybe(build, sg.Strategy)
    if made is not None:
        assert_usable(made)
        assert 0 < made.setup.timeout.total_seconds() <= MAX_SECONDS


@FEW
@given(options(keywords(sg.fsdp)), st.one_of(st.none(), junk), st.booleans())
def test_fsdp_and_fsdp_spawn(chosen, start, spawned):
    build = (lambda: sg.fsdp_spawn(start=start, **chosen)) if spawned else lambda: sg.fsdp(**chosen)
    made = maybe(build, sg.Strategy)
    if made is not None:
        assert_usable(made)


@MANY
@given(options(keywords(sg.allreduce_grads)), st.one_of(st.none(), junk), st.booleans())
def test_allreduce_grads_and_its_spawn(chosen, start, spawned):
    build = (
        (lambda: sg.allreduce_grads_spawn(start=start, **chosen))
        if spawned
        else lambda: sg.allreduce_grads(**chosen)
    )
    made = maybe(build, sg.Strategy)
    if made is not None:
        assert_usable(made)
        assert made.update.bucket_mb > 0


@MANY
@given(options(["stop_grace", "exit_timeout", "store_timeout"]))
def test_spawn(chosen):
    made = maybe(lambda: sg.Spawn(**chosen), sg.Spawn)
    if made is not None:
        for value in attrs.astuple(made):
            assert 0 < value <= MAX_SECONDS


@MANY
@given(st.lists(junk, max_size=3), junk)
def test_shard_policies(types, count):
    for made in (
        maybe(lambda: sg.every_module_of(*types), Callable),
        maybe(lambda: sg.above_parameters(count), Callable),
    ):
        if made is not None:
            assert made(torch.nn.Linear(2, 2)) in (True, False)
            assert repr(made)


# --- the world ---------------------------------------------------------------------------------

ENV_FIELDS = [field.name for field in attrs.fields(sg.Env)]


@MANY
@given(options(ENV_FIELDS))
def test_env(chosen):
    made = maybe(lambda: sg.Env(**chosen), sg.Env)
    if made is not None:
        assert 0 <= made.rank < made.world_size
        assert 0 <= made.local_rank < made.local_world_size <= made.world_size
        assert 0 <= made.master_port <= 65535
        assert made.is_distributed == (made.source != "single")


@MANY
@given(
    st.one_of(st.just(sg.Env()), junk),
    st.one_of(st.just(torch.device("cpu")), junk),
    st.one_of(st.none(), junk),
    st.one_of(st.just({}), st.dictionaries(st.text(max_size=3), junk, max_size=2), junk),
)
def test_context(env, device, group, extras):
    made = maybe(lambda: sg.Context(env=env, device=device, group=group, extras=extras), sg.Context)
    if made is not None:
        assert (made.rank, made.world_size, made.is_main) == (0, 1, True)
        assert made.device.type in ("cpu", "meta")
        assert dict(made.extras) == dict(extras)
        assert maybe(lambda: made.with_extras(fuzzed=1), sg.Context) is not None


# --- samplers and loaders -------------------------------------------------------------------


SAMPLER_FIELDS = [field.name for field in attrs.fields(sg.ShardSampler)]
small = st.integers(0, 12)


@MANY
@given(
    st.fixed_dictionaries(
        {"size": st.one_of(small, junk), "rank": st.one_of(small, junk)},
        optional={
            "world_size": st.one_of(st.integers(1, 4), junk),
            **dict.fromkeys(SAMPLER_FIELDS[3:], junk),
        },
    )
)
def test_shard_sampler(chosen):
    chosen.setdefault("world_size", 1)
    made = maybe(lambda: sg.ShardSampler(**chosen), sg.ShardSampler)
    if made is not None and made.size <= 10_000:
        # A source's draws are known only when it draws: one that disagrees with `size` is
        # our error then, naming the fix (a str "0" drew one index where size was 0).
        taken = list(made) if made.source is None else maybe(lambda: list(made), list)
        if taken is None:
            return
        assert len(taken) == len(made)
        assert all(0 <= i < made.size for i in taken)
        assert len(set(taken)) == len(taken)


LOADER = DataLoader(TensorDataset(torch.arange(6)), batch_size=2)


@FEW
@given(
    st.one_of(st.just(LOADER), junk),
    st.one_of(
        st.builds(sg.ShardSampler, size=st.just(6), rank=st.just(0), world_size=st.just(1)), junk
    ),
    st.one_of(st.integers(0, 3), junk),
    st.one_of(st.fixed_dictionaries({"epoch": junk, "consumed": junk}), junk),
)
def test_sharded_loader(loader, sampler, epoch, state):
    made = maybe(
        lambda: sg.ShardedLoader(loader=loader, sampler=sampler, epoch=epoch), sg.ShardedLoader
    )
    if made is not None:
        assert made.state_dict() == {"epoch": made.epoch, "consumed": 0}
        try:
            made.load_state_dict(state)
        except sg.StratagemError:
            return
        assert made.state_dict() == dict(state)


# --- combinators -----------------------------------------------------------------------------


@MANY
@given(strategies_or_junk, junk)
def test_with_precision(strategy, precision):
    made = maybe(lambda: sg.with_precision(strategy, precision), sg.Strategy)
    if made is not None:
        assert_usable(made)
        assert made.name.endswith(precision)


@MANY
@given(strategies_or_junk, options(["max_norm", "max_value", "norm_type"]))
def test_with_clipping(strategy, chosen):
    made = maybe(lambda: sg.with_clipping(strategy, **chosen), sg.Strategy)
    if made is not None:
        assert_usable(made)
        update = made.update
        assert update.max_norm is None or 0 < update.max_norm < math.inf
        assert update.max_value is None or 0 < update.max_value < math.inf
        assert update.norm_type > 0


@MANY
@given(
    strategies_or_junk,
    st.one_of(st.integers(1, 4), st.just(lambda world_size: max(1, 4 // world_size)), junk),
    options(["normalize"]),
)
def test_accumulate(strategy, every, chosen):
    made = maybe(lambda: sg.accumulate(strategy, every, **chosen), sg.Strategy)
    if made is not None:
        assert_usable(made)
        # A function of the world size is resolved by setup (tests/test_small_defects.py).
        assert callable(made.setup.every) or made.setup.every >= 1


@MANY
@given(strategies_or_junk, st.one_of(st.builds(sg.ListSink), junk))
def test_traced(strategy, sink):
    made = maybe(lambda: sg.traced(strategy, sink), sg.Strategy)
    if made is not None:
        assert_usable(made)


@MANY
@given(strategies_or_junk, options(["compare_sites"]))
def test_checked(strategy, chosen):
    made = maybe(lambda: sg.checked(strategy, **chosen), sg.Strategy)
    if made is not None:
        assert_usable(made)


@FEW
@given(
    strategies_or_junk,
    options([*keywords(torch.compile, "model"), "modes", "fullgraf"]),
)
def test_compiled(strategy, chosen):
    made = maybe(lambda: sg.compiled(strategy, **chosen), sg.Strategy)
    if made is not None:
        assert_usable(made)


@MANY
@given(junk)
def test_sinks(value):
    if maybe(lambda: sg.JsonLinesSink(value), sg.JsonLinesSink) is not None:
        assert isinstance(value, (str, Path)) and str(value)
    made = maybe(lambda: sg.ListSink(value), sg.ListSink)
    if made is not None:
        assert made.events is value
