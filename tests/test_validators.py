"""The validator kit: each factory accepts what it names and refuses the rest with one message shape."""

from __future__ import annotations

import enum
import math

import attrs
import pytest

import stratagem as sg
from stratagem import validators as v


@attrs.frozen
class Record:
    count: int = attrs.field(default=1, validator=v.positive_int("make({name}=...)"))
    seconds: float = attrs.field(
        default=1.0, validator=v.positive_number("make({name}=...)", unit="seconds", at_most=100)
    )
    mode: str | None = attrs.field(
        default=None, validator=v.choice("make({name}=...)", ("a", "b"), optional="None (auto)")
    )
    flag: bool = attrs.field(default=False, validator=v.a_bool("make({name}=...)"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"count": 0}, "make(count=...) must be a positive int (got 0, an int)."),
        ({"count": True}, "make(count=...) must be a positive int (got True, a bool)."),
        ({"seconds": 101}, "make(seconds=...) must be a positive number of seconds, at most 100"),
        ({"seconds": math.nan}, "(got nan, a float)"),
        ({"seconds": math.inf}, "(got inf, a float)"),
        ({"mode": "c"}, "make(mode=...) must be None (auto) or one of 'a', 'b' (got 'c', a str)."),
        ({"flag": 1}, "make(flag=...) must be True or False (got 1, an int)."),
    ],
)
def test_a_refused_value_is_named_with_its_owner_type_and_what_is_wanted(options, message):
    with pytest.raises(sg.UsageError) as caught:
        Record(**options)
    assert message in str(caught.value)


def test_accepted_values_pass_and_assignment_is_checked_as_construction():
    assert Record(count=3, seconds=100, mode="b", flag=True).mode == "b"
    assert Record(mode=None).mode is None


def test_numbers_beyond_floats_and_infinity_on_request():
    assert v.is_number(10**400)  # an int is finite however large; no OverflowError
    assert not v.is_number(math.inf)
    assert v.is_number(math.inf, finite=False)
    assert not v.is_number(math.nan, finite=False)


def test_choices_take_subclasses_only_when_asked():
    class Mode(enum.StrEnum):
        A = "a"

    strict = v.choice("x.{name}", ("a",))
    loose = v.choice("x.{name}", ("a",), subclasses=True)
    field = attrs.fields(Record).mode
    loose(None, field, Mode.A)
    with pytest.raises(sg.UsageError, match="one of 'a'"):
        strict(None, field, Mode.A)


def test_rank_and_world_refuse_a_rank_outside_the_world_from_either_side():
    rank_ok, world_ok = v.rank_and_world("Thing.{name}")

    @attrs.define
    class Thing:
        rank: int = attrs.field(validator=rank_ok)
        world_size: int = attrs.field(validator=world_ok)

    thing = Thing(rank=1, world_size=2)
    with pytest.raises(sg.UsageError, match=r"Thing.rank must be below world_size \(got rank=2"):
        thing.rank = 2
    with pytest.raises(sg.UsageError, match=r"got rank=1, world_size=1"):
        thing.world_size = 1


def test_require_raises_the_error_type_asked_for():
    v.require(True, "f: 'x'", "an int", 1)
    with pytest.raises(sg.EnvError, match=r"^RANK must be an int \(got 'a', a str\); set it\.$"):
        v.require(False, "RANK", "an int", "a", hint="; set it", error=sg.EnvError)
