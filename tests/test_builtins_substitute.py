"""Each built-in is its base with the fields that truly differ substituted (issue 36).

The record's field list lives in the record (`Strategy`, with its protocol twin
`StrategyLike`) and in one base, ``single_device()``; every other built-in reads
as ``attrs.evolve(base, ...)`` of what it changes, and the world options are one
value (`WorldOptions`) passed through whole.
"""

from __future__ import annotations

import ast

import attrs
import pytest

import stratagem as sg
from helpers import LIB
from stratagem.process_group import JoinProcessGroup, WorldOptions
from stratagem.strategy import FIELD_SIGNATURES


def differing(a: sg.Strategy, b: sg.Strategy) -> set[str]:
    return {f.name for f in attrs.fields(sg.Strategy) if getattr(a, f.name) != getattr(b, f.name)}


CPU = {"device": "cpu"}

# (built-in, its base, the fields its module's docstring says it substitutes)
SUBSTITUTIONS = [
    (sg.dp(), sg.single_device("cpu"), {"name", "setup", "wrap"}),
    (
        sg.ddp(**CPU),
        sg.single_device("cpu"),
        {"name", "setup", "wrap", "no_sync", "shard", "teardown"},
    ),
    (sg.fsdp(**CPU), sg.ddp(**CPU), {"name", "setup", "wrap", "no_sync", "update"}),
    (sg.allreduce_grads(**CPU), sg.ddp(**CPU), {"name", "wrap", "no_sync", "update"}),
    (
        sg.pipeline(stages=[["0"], ["1"]], microbatches=2, **CPU),
        sg.ddp(**CPU),
        {"name", "setup", "wrap", "step", "backward", "update", "no_sync"},
    ),
    (sg.hsdp(replicate=1, shard=2, **CPU), sg.fsdp(**CPU), {"name", "setup"}),
    (sg.ddp_spawn(**CPU), sg.ddp(**CPU), {"name", "launch"}),
]


@pytest.mark.parametrize(
    ("strategy", "base", "fields"), SUBSTITUTIONS, ids=lambda v: getattr(v, "name", "")
)
def test_a_builtin_differs_from_its_base_in_its_documented_fields_only(strategy, base, fields):
    assert differing(strategy, base) == fields


def test_the_world_options_are_one_value_passed_through_whole():
    world = {
        "device": "cpu",
        "backend": "gloo",
        "timeout": 7.0,
        "arrival_timeout": 3.0,
        "join_timeout": 5.0,
    }
    assert set(world) == set(WorldOptions.__annotations__)
    join = JoinProcessGroup(**world)
    assert sg.ddp(**world).setup == join
    assert sg.allreduce_grads(**world).setup == join
    assert sg.fsdp(**world).setup.join == join
    assert sg.pipeline(stages=[["0"]], microbatches=1, **world).setup.join == join


@pytest.mark.parametrize("factory", [sg.ddp, sg.fsdp, sg.allreduce_grads, sg.ddp_spawn])
def test_an_unknown_keyword_names_the_factory_and_every_keyword_it_takes(factory):
    with pytest.raises(
        TypeError, match=r"got an unexpected keyword argument 'devcie'.*device, backend, timeout"
    ):
        factory(devcie="cpu")


def test_a_bad_world_value_is_refused_naming_the_argument():
    with pytest.raises(sg.UsageError, match="'device' must be 'auto', a device string"):
        sg.ddp(device=3)
    with pytest.raises(sg.UsageError, match="'backend' must be None"):
        sg.fsdp(device="cpu", backend="carrier-pigeon")


def _lists_every_field(node: ast.AST) -> bool:
    names = set()
    if isinstance(node, ast.Call):
        names = {k.arg for k in node.keywords}
    elif isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
        items = node.keys if isinstance(node, ast.Dict) else node.elts
        names = {i.value for i in items if isinstance(i, ast.Constant)}
    elif isinstance(node, ast.ClassDef):  # a record's attributes, a protocol's properties
        names = {
            s.target.id
            for s in node.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        names |= {s.name for s in node.body if isinstance(s, ast.FunctionDef)}
    return set(FIELD_SIGNATURES) <= names


def test_the_field_list_is_written_in_the_record_and_one_base_only():
    places = []
    for path in sorted(LIB.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if _lists_every_field(node):
                places.append(f"{path.relative_to(LIB)}:{node.lineno}")
    # The record and its protocol twin (a type checker needs both spelled out), and
    # single_device(), the one built-in written whole.
    files = [place.split(":")[0] for place in places]
    assert files == [
        "stratagem/fields.py",
        "stratagem/strategies/single.py",
        "stratagem/strategy.py",
    ]
