"""The laws' shared keywords: typed once, defaults once, a misspelt one refused by name.

Nothing here starts a world: every refusal comes before the law runs, and the defaults
are read where the law hands them on.
"""

from __future__ import annotations

import inspect
import typing

import attrs
import pytest
import torch

import stratagem as sg
from stratagem.testing import Contract, laws
from stratagem.testing.laws import options as shared
from stratagem.testing.laws import oracles, parallel

STRATEGY = sg.ddp(device="cpu")
MODULE = torch.nn.Linear(4, 2)
BATCH = torch.randn(8, 4)

# Each law that takes a group of the shared keywords, with the arguments before them.
LAWS = {
    laws.check_data_parallel_step: (STRATEGY, MODULE, BATCH),
    laws.check_accumulation: (STRATEGY, MODULE, BATCH),
    laws.check_precision: (STRATEGY, MODULE, BATCH),
    laws.check_master_weights: (STRATEGY, MODULE, BATCH),
    laws.check_no_sync: (STRATEGY, MODULE, BATCH),
    laws.check_purity: (STRATEGY, MODULE, BATCH),
    laws.check_wrap: (STRATEGY, MODULE, BATCH),
    laws.check_step_autocast: (STRATEGY, MODULE, BATCH, torch.bfloat16),
    laws.check_combinator_arithmetic: (STRATEGY, MODULE, BATCH),
    laws.check_ranks_in_sync: (STRATEGY, MODULE, BATCH),
    laws.check_checkpoint_round_trip: (STRATEGY, MODULE, BATCH),
    laws.check_checkpoint_resume: (STRATEGY, MODULE, BATCH),
    laws.check_checkpoint_strict: (STRATEGY, MODULE),
    laws.check_tensor_parallel: ({"0": object()},),
    laws.tensor_parallel_run: ({"0": object()},),
}
GROUPS = [
    laws.RunOptions,
    laws.LossOptions,
    laws.TrainingOptions,
    laws.ReferenceOptions,
]


def keywords(law: typing.Callable[..., object]) -> list[str]:
    """Every keyword ``law`` takes: its signature's, then its ``**options`` group's, in order."""
    own = [
        name
        for name, p in inspect.signature(law).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    [group] = typing.get_args(typing.get_type_hints(law, include_extras=True)["options"])
    return [*own, *typing.get_type_hints(group)]


SPLIT = (laws.check_tensor_parallel, laws.tensor_parallel_run)


@pytest.mark.parametrize("law", LAWS, ids=lambda law: law.__name__)
def test_a_misspelt_keyword_is_refused_naming_it_and_every_keyword_the_law_takes(law):
    required = {"module": MODULE, "batch": BATCH} if law in SPLIT else {}
    with pytest.raises(TypeError) as caught:
        law(*LAWS[law], **required, wrld=4)
    message = str(caught.value)
    assert message.startswith(f"{law.__name__}() got an unexpected keyword argument 'wrld'")
    assert message.endswith(f"; its keywords are {', '.join(keywords(law))}.")


def test_the_refusal_names_the_closest_keyword():
    with pytest.raises(TypeError) as caught:
        laws.check_accumulation(STRATEGY, MODULE, BATCH, micro_batch=4)
    assert str(caught.value) == (
        "check_accumulation() got an unexpected keyword argument 'micro_batch' (did you mean "
        "'micro_batches'?); its keywords are micro_batches, tolerance, world, world_size, "
        "forward, optimizer, contract, steps, reference."
    )


def test_a_keyword_of_another_law_is_refused_too():
    with pytest.raises(TypeError, match=r"check_no_sync\(\) got an unexpected keyword .*'steps'"):
        laws.check_no_sync(STRATEGY, MODULE, BATCH, steps=2)
    with pytest.raises(TypeError, match=r"its keywords are world, world_size, forward\.$"):
        laws.check_purity(STRATEGY, MODULE, BATCH, optimizer=laws.sgd)


def test_every_group_is_typed_as_the_settings_it_fills():
    fields = {f.name: f.type for f in attrs.fields(attrs.resolve_types(shared.LawSettings))}
    for group in GROUPS:
        hints = typing.get_type_hints(group)
        assert hints == {name: fields[name] for name in hints}, group.__name__
        assert not group.__required_keys__  # every keyword may be left out


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"steps": 0}, "laws: 'steps' must be a positive int (got 0, an int)."),
        ({"world_size": 0}, "laws: 'world_size' must be a positive int (got 0, an int)."),
        ({"world": 2}, "laws: 'world' must be None or a World (got 2, an int)."),
        ({"contract": 1e-3}, "laws: 'contract' must be None or a Contract (got 0.001, a float)."),
        ({"forward": 3}, "laws: 'forward' must be a module-level function (module, batch)"),
        ({"optimizer": "sgd"}, "laws: 'optimizer' must be a module-level function parameters"),
    ],
)
def test_a_bad_value_is_refused_before_any_rank_starts(given, message):
    with pytest.raises(sg.UsageError) as caught:
        laws.check_data_parallel_step(STRATEGY, MODULE, BATCH, **given)
    assert str(caught.value).startswith(message)


class Handed(Exception):
    """Raised where a law hands its settings on, to read them without starting a world."""


def test_each_law_keeps_its_own_defaults(monkeypatch):
    handed = []

    def check(law, strategy, module, batch, given, *, plan, contract, **_):
        handed.append((law, plan.steps, given.optimizer, given.forward, contract))
        raise Handed

    monkeypatch.setattr(parallel, "_check", check)
    for law in (laws.check_data_parallel_step, laws.check_accumulation):
        with pytest.raises(Handed):
            law(STRATEGY, MODULE, BATCH)
    with pytest.raises(Handed):
        laws.check_accumulation(STRATEGY, MODULE, BATCH, steps=5, tolerance=0.5)
    assert handed == [
        ("data-parallel-step", 3, laws.sgd_momentum, shared.squares_mean, Contract()),
        ("accumulation", 2, laws.sgd_momentum, shared.squares_mean, Contract()),
        ("accumulation", 5, laws.sgd_momentum, shared.squares_mean, Contract(atol=0.5)),
    ]

    def run_on(world, size, fn, strategy, module, batch, updates, optimizer, forward):
        handed.append((size, updates, optimizer))
        raise Handed

    monkeypatch.setattr(oracles, "run_on", run_on)
    with pytest.raises(Handed):
        laws.check_combinator_arithmetic(STRATEGY, MODULE, BATCH, world_size=4)
    assert handed[-1] == (4, 2, laws.sgd)


def test_an_options_dict_passes_through_whole():
    given: laws.ReferenceOptions = {"steps": 4, "world_size": 4, "optimizer": laws.adamw}
    settings = shared.settings("law", given, laws.ReferenceOptions)
    assert (settings.steps, settings.ranks, settings.optimizer) == (4, 4, laws.adamw)
    assert settings.terms() == Contract() and settings.reference is None
