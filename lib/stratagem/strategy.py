"""The `Strategy` record, the `StrategyLike` protocol, and the validation of their fields.

A strategy is a frozen record of functions. A new strategy is an old one with
some functions substituted (``attrs.evolve``), and ``attrs.evolve`` re-runs the
validators here, so every substitution is checked as construction is.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar, cast

import attrs

from stratagem.errors import StrategyFieldError, describe
from stratagem.fields import (
    BackwardFn,
    BarrierFn,
    BroadcastFn,
    GatherFn,
    LaunchFn,
    LoadFn,
    NoSyncFn,
    ReduceFn,
    SaveFn,
    SetupFn,
    ShardFn,
    StepFn,
    TeardownFn,
    UpdateFn,
    WrapFn,
)
from stratagem.fields import StrategyLike as StrategyLike  # defined beside its field types
from stratagem.layers import peel, repointed
from stratagem.validators import refusal, require

__all__ = [
    "BUILT_IN_FACTORIES",
    "FIELD_SIGNATURES",
    "Strategy",
    "StrategyLike",
    "applied",
    "not_a_strategy",
]

T = TypeVar("T")


@attrs.frozen
class _Accepts:
    """Validator: the value is callable with ``positional`` arguments and ``keywords``."""

    signature: str
    positional: int
    keywords: tuple[str, ...] = ()

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        name = attribute.name
        expected = f"{name}{self.signature}"
        if not callable(value):
            raise refusal(f"'{name}'", f"callable as {expected}", value, error=StrategyFieldError)
        try:
            signature = inspect.signature(value)
        except (TypeError, ValueError):
            return  # builtins and some C callables hide their signature: trust them
        try:
            signature.bind(*[None] * self.positional, **dict.fromkeys(self.keywords))
        except TypeError as error:
            raise StrategyFieldError(
                f"'{name}' must accept the arguments of {expected}, but {value!r} has "
                f"signature {signature} ({error}). Give it that signature, or wrap it: "
                f"the leading arguments are passed by position."
            ) from None

    def __repr__(self) -> str:
        return f"<accepts {self.signature}>"


def _name(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    ok = isinstance(value, str) and value != ""
    require(ok, "'name'", "a non-empty str", value, error=StrategyFieldError)


@attrs.frozen(kw_only=True)
class Strategy:
    """A training strategy: a frozen record of the functions a training loop calls.

    Build one with a factory (`single_device`, `ddp`, ...) and derive new ones by
    substitution, ``attrs.evolve(strategy, reduce=my_reduce)``, or with a
    combinator. Every field is validated at construction and at every
    ``attrs.evolve``; assigning to a field raises ``attrs.exceptions.FrozenInstanceError``.

    Raises:
        StrategyFieldError: a field is not callable or cannot accept its
            documented arguments (see `FIELD_SIGNATURES`).

    Example:
        >>> import attrs, stratagem as sg
        >>> def my_barrier(ctx):
        ...     pass
        >>> custom = attrs.evolve(sg.single_device("cpu"), name="custom", barrier=my_barrier)
        >>> custom.barrier is my_barrier
        True
    """

    name: str = attrs.field(validator=_name)
    launch: LaunchFn = attrs.field(validator=_Accepts("(fn, strategy, devices, args) -> list", 4))
    setup: SetupFn = attrs.field(validator=_Accepts("(env) -> Context", 1))
    wrap: WrapFn = attrs.field(validator=_Accepts("(module, ctx) -> module", 2))
    step: StepFn = attrs.field(
        validator=_Accepts("(module, batch, ctx, *, forward=None) -> output", 3, ("forward",))
    )
    backward: BackwardFn = attrs.field(validator=_Accepts("(loss, module, ctx) -> None", 3))
    update: UpdateFn = attrs.field(validator=_Accepts("(optimizer, module, ctx) -> None", 3))
    no_sync: NoSyncFn = attrs.field(validator=_Accepts("(module, ctx) -> ContextManager", 2))
    reduce: ReduceFn = attrs.field(validator=_Accepts("(tensor, op, ctx) -> Tensor", 3))
    gather: GatherFn = attrs.field(validator=_Accepts("(tensor, ctx) -> Tensor", 2))
    broadcast: BroadcastFn = attrs.field(
        validator=_Accepts("(obj, ctx, *, src=0) -> obj", 2, ("src",))
    )
    barrier: BarrierFn = attrs.field(validator=_Accepts("(ctx) -> None", 1))
    shard: ShardFn = attrs.field(validator=_Accepts("(loader, ctx) -> loader", 2))
    save: SaveFn = attrs.field(validator=_Accepts("(path, state, ctx) -> None", 3))
    load: LoadFn = attrs.field(validator=_Accepts("(path, state, ctx) -> dict", 3))
    teardown: TeardownFn = attrs.field(validator=_Accepts("(ctx) -> None", 1))

    def __attrs_post_init__(self) -> None:
        # A layer that holds another field besides its inner one (accumulate's step holds the
        # no_sync it enters) holds this record's own, however the record was built: a field
        # substituted after the layer (traced, a user's no_sync) is the one it calls.
        fields = {name: getattr(self, name) for name in FIELD_SIGNATURES}
        for name, value in fields.items():
            current = repointed(value, fields)
            if current is not value:
                object.__setattr__(self, name, current)  # frozen: this is construction


FIELD_SIGNATURES: dict[str, _Accepts] = {
    field.name: cast(_Accepts, field.validator)
    for field in attrs.fields(Strategy)
    if field.name != "name"
}
"""The calling convention of every function field, as validated at construction."""


def applied(strategy: StrategyLike, kind: type[T]) -> T | None:
    """Return the first layer, or base, of type ``kind`` in any field of ``strategy``, or None.

    Example:
        >>> import stratagem as sg
        >>> from stratagem.combinators.clipping import ClipUpdate
        >>> applied(sg.with_clipping(sg.ddp(), max_norm=1.0), ClipUpdate).max_norm
        1.0
    """
    for name in FIELD_SIGNATURES:
        layers, base = peel(getattr(strategy, name))
        for value in (*layers, base):
            if isinstance(value, kind):
                return value
    return None


BUILT_IN_FACTORIES = frozenset(
    {
        "allreduce_grads",
        "allreduce_grads_spawn",
        "ddp",
        "ddp_spawn",
        "dp",
        "fsdp",
        "fsdp_spawn",
        "hsdp",
        "pipeline",
        "single_device",
    }
)
"""The public names that build a strategy (tests/test_structure.py holds this to ``sg.__all__``)."""


def _returns_a_strategy(function: Any) -> bool:
    try:
        returns = inspect.signature(function).return_annotation
    except (TypeError, ValueError):  # a builtin or C callable has no signature to read
        return False
    return returns in ("Strategy", Strategy)


def not_a_strategy(value: object, function: str) -> str:
    """Return the message for ``value`` given where a strategy was expected, with the fix.

    The two usual mistakes get their own fix: a factory passed uncalled
    (``sg.ddp_spawn`` for ``sg.ddp_spawn()``) and a built-in's name as a string.
    """
    head = f"{function}: 'strategy' must be a Strategy (got {describe(value)})"
    if callable(value) and not isinstance(value, type):
        name = getattr(value, "__name__", "factory")
        ours = getattr(value, "__module__", "").startswith("stratagem.")
        if ours and _returns_a_strategy(value):
            return f"{head}; call the factory: sg.{name}() instead of sg.{name}."
        return f"{head}; if it builds one, call it: {name}()."
    if isinstance(value, str):
        name = value.strip().lower().replace("-", "_")
        if name in BUILT_IN_FACTORIES:
            return f"{head}; strategies are records, not names: write sg.{name}()."
        return f"{head}; strategies are records, not names: build one, e.g. sg.ddp()."
    return f"{head}; build one with a factory such as sg.single_device() or sg.ddp()."
