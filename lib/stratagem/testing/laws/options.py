"""The keywords the laws share: typed once, given their defaults once, checked once.

A law takes the keywords of its kind as ``**options``, typed by one of the
groups below (PEP 692), so a type checker reads each keyword's type and
refuses one the law does not take; `settings` fills in the defaults, checks
the values, and refuses at run time too a keyword the law does not take,
naming those it does. A law's own keywords (``check_accumulation``'s
``micro_batches``) stay in its signature.

- ``world``: a running `World` to run on (fast across many calls); None, the
  default, starts a `World` of ``world_size`` ranks for the call.
- ``world_size``: ranks to start when ``world`` is omitted (2).
- ``forward``: a module-level function ``(module, batch) -> loss``, a mean
  over samples (`squares_mean`, the mean of a tensor batch's squared outputs).
- ``optimizer``: a module-level function ``parameters -> optimizer``
  (`sgd_momentum`).
- ``contract``: what the strategy promises (`Contract`; ``Contract()``).
- ``steps``: optimizer steps, each compared (3).
- ``reference``: a strategy that trains the same way in one process (derived
  from the strategy, `stratagem.testing.reference.undistributed`).

A law whose default differs says so (``check_accumulation``: ``steps=2``;
``check_combinator_arithmetic``: ``optimizer=sgd``).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypedDict

import attrs
import torch

from stratagem.strategy import StrategyLike
from stratagem.testing.contract import Contract
from stratagem.testing.laws._core import squares_mean
from stratagem.testing.world import World
from stratagem.validators import callable_field, field, instance_of, positive_int

__all__ = [
    "DEFAULTS",
    "Forward",
    "LawSettings",
    "LossOptions",
    "OptimizerFactory",
    "ReferenceOptions",
    "RunOptions",
    "TrainingOptions",
    "adamw",
    "refuse_unknown",
    "settings",
    "sgd",
    "sgd_momentum",
]

Forward = Callable[[torch.nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def sgd(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Plain SGD, ``lr=0.1``: the laws' simplest optimizer."""
    return torch.optim.SGD(parameters, lr=0.1)


def sgd_momentum(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum 0.9, ``lr=0.1``: optimizer state that a strategy must keep right."""
    return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)


def adamw(parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW, ``lr=0.01``: two moments per parameter and a step count."""
    return torch.optim.AdamW(parameters, lr=0.01)


# Functional syntax: a TypedDict class statement would derive from TypedDict, and no class in
# lib/ derives from anything but Protocol or an exception. Each group names its keys whole.
RunOptions = TypedDict(  # noqa: UP013
    "RunOptions", {"world": World | None, "world_size": int}, total=False
)
"""Where a law runs: ``world``, else a `World` of ``world_size`` ranks started for the call."""

LossOptions = TypedDict(  # noqa: UP013
    "LossOptions", {"world": World | None, "world_size": int, "forward": Forward}, total=False
)
"""`RunOptions` and the loss the law trains with, ``forward``."""

TrainingOptions = TypedDict(  # noqa: UP013
    "TrainingOptions",
    {
        "world": World | None,
        "world_size": int,
        "forward": Forward,
        "optimizer": OptimizerFactory,
        "contract": Contract | None,
    },
    total=False,
)
"""`LossOptions`, the ``optimizer`` to train with, and what the strategy promises (``contract``)."""

ReferenceOptions = TypedDict(  # noqa: UP013
    "ReferenceOptions",
    {
        "world": World | None,
        "world_size": int,
        "forward": Forward,
        "optimizer": OptimizerFactory,
        "contract": Contract | None,
        "steps": int,
        "reference": StrategyLike | None,
    },
    total=False,
)
"""`TrainingOptions` for ``steps`` updates, compared with a ``reference`` trained in one process."""

_OWNER = "laws: '{name}'"


@attrs.frozen
class LawSettings:
    """A law's keywords with the defaults filled in, each value checked: what `settings` returns.

    Attributes:
        world: the running `World` to run on, or None to start one for the call.
        world_size: ranks to start when ``world`` is None.
        forward: ``(module, batch) -> loss``.
        optimizer: ``parameters -> optimizer``.
        contract: what the strategy promises; None for ``Contract()`` (see `terms`).
        steps: optimizer steps, each compared.
        reference: the one-process strategy to compare with; None to derive it.
    """

    world: World | None = attrs.field(
        default=None, validator=instance_of(_OWNER, World, "a World", optional="None")
    )
    world_size: int = attrs.field(default=2, validator=positive_int(_OWNER))
    forward: Forward = attrs.field(
        default=squares_mean,
        validator=callable_field(_OWNER, "a module-level function (module, batch) -> loss"),
    )
    optimizer: OptimizerFactory = attrs.field(
        default=sgd_momentum,
        validator=callable_field(_OWNER, "a module-level function parameters -> optimizer"),
    )
    contract: Contract | None = attrs.field(
        default=None,
        validator=field(lambda v: isinstance(v, Contract), _OWNER, "a Contract", optional="None"),
    )
    steps: int = attrs.field(default=3, validator=positive_int(_OWNER))
    reference: StrategyLike | None = attrs.field(
        default=None,
        validator=instance_of(_OWNER, StrategyLike, "a strategy", optional="None (derived)"),
    )

    @property
    def ranks(self) -> int:
        """How many ranks the law runs on: the world's, else ``world_size``."""
        return self.world.world_size if self.world is not None else self.world_size

    def terms(self, tolerance: float | None = None) -> Contract:
        """Return the contract (``Contract()`` when none was given), ``atol=tolerance`` if given."""
        terms = self.contract if self.contract is not None else Contract()
        return terms if tolerance is None else attrs.evolve(terms, atol=tolerance)


DEFAULTS = LawSettings()
"""Every shared keyword's default; a law whose defaults differ passes its own to `settings`."""


def refuse_unknown(
    law: str,
    options: Mapping[str, object],
    accepted: type[Mapping[str, Any]],
    *,
    own: Sequence[str] = (),
) -> None:
    """Raise unless every key of ``options`` is one of the TypedDict ``accepted``'s keys.

    ``own`` names the law's other keywords (those in its signature), for the message.

    Raises:
        TypeError: as Python's own for an unexpected keyword, listing every keyword
            ``law`` takes and the closest one to what was given.

    Example:
        >>> refuse_unknown("check_no_sync", {"world_sise": 4}, LossOptions)
        Traceback (most recent call last):
        ...
        TypeError: check_no_sync() got an unexpected keyword argument 'world_sise' (did you mean 'world_size'?); its keywords are world, world_size, forward.
    """  # noqa: E501
    keys = [*own, *accepted.__annotations__]
    for name in options:
        if name not in accepted.__annotations__:
            close = difflib.get_close_matches(name, keys, n=1)
            guess = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{law}() got an unexpected keyword argument {name!r}{guess}; its keywords are "
                f"{', '.join(keys)}."
            )


def settings(
    law: str,
    options: Mapping[str, object],
    accepted: type[Mapping[str, Any]],
    *,
    own: Sequence[str] = (),
    defaults: LawSettings = DEFAULTS,
) -> LawSettings:
    """Return ``defaults`` with ``options`` (a group of ``accepted``'s keys) laid over them.

    Raises:
        TypeError: a keyword ``law`` does not take (`refuse_unknown`).
        UsageError: a value the laws cannot work with.
    """
    refuse_unknown(law, options, accepted, own=own)
    return attrs.evolve(defaults, **options)  # type: ignore[arg-type]  # keys checked above
