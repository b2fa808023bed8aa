"""The validator kit: one shape for every "X must be Y (got Z)" check.

A field validator names its owner the way the user wrote it: ``owner`` is a
template with ``{name}`` for the field, e.g. ``"ShardSampler.{name}"`` or
``"ddp({name}=...)"``. The same checks run inline through `require`, for
arguments of plain functions. Each message ends with the bad value and its
type (`describe`) and an optional hint that says how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from stratagem.errors import UsageError, describe

__all__ = [
    "MAX_SECONDS",
    "Validator",
    "a_bool",
    "callable_field",
    "choice",
    "decision",
    "field",
    "instance_of",
    "is_int",
    "is_number",
    "non_negative_int",
    "positive_int",
    "positive_number",
    "rank_and_world",
    "refusal",
    "require",
]

Validator = Callable[[Any, Any, Any], None]
"""An attrs validator: ``(instance, attribute, value) -> None``."""


def is_int(value: object, minimum: int | None = None) -> TypeGuard[int]:
    """Whether ``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return False
    return minimum is None or value >= minimum


def is_number(
    value: object, *, above: float = -math.inf, at_most: float = math.inf, finite: bool = True
) -> bool:
    """Whether ``value`` is an int or float (not a bool) with ``above < value <= at_most``.

    NaN is always refused, infinity unless ``finite=False``: torch and gloo would fail
    on them later, far away.
    """
    # value != value is NaN; an int is finite however large (math.isnan would overflow on 10**400).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return False
    finite_ok = not finite or isinstance(value, int) or math.isfinite(value)
    return finite_ok and above < value <= at_most


def require(
    ok: bool,
    label: str,
    what: str,
    value: object,
    *,
    hint: str = "",
    error: type[Exception] = UsageError,
) -> None:
    """Raise ``error`` saying ``label must be what (got value)hint.`` unless ``ok``."""
    if not ok:
        raise refusal(label, what, value, hint=hint, error=error)


def refusal(
    label: str, what: str, value: object, *, hint: str = "", error: type[Exception] = UsageError
) -> Exception:
    """Return the error `require` raises, for a branch that raises it itself (and so narrows)."""
    return error(f"{label} must be {what} (got {describe(value)}){hint}.")


def decision(
    policy: Callable[[Any], object], module: Any, who: str, name: str | None = None
) -> bool:
    """Return ``policy(module)``; ``who`` names the policy, ``name`` the module's path if known.

    Raises:
        UsageError: ``policy`` returned something other than True or False.
    """
    answer = policy(module)
    if not isinstance(answer, bool):
        kind = f"a {type(module).__name__}"
        raise UsageError(
            f"wrap: {who} must return True or False, but returned {describe(answer)} for "
            f"{kind if name is None else f'{name!r} ({kind})'}."
        )
    return answer


def field(
    ok: Callable[[Any], bool],
    owner: str,
    what: str,
    *,
    hint: str = "",
    optional: str | None = None,
    error: type[Exception] = UsageError,
) -> Validator:
    """Return an attrs validator: ``ok(value)``, else an error naming ``owner``'s field.

    ``optional`` accepts None as well and says what None means, e.g.
    ``optional="None (full precision)"`` makes the message "must be None (full
    precision) or <what>".
    """
    wanted = what if optional is None else f"{optional} or {what}"

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        if (optional is not None and value is None) or ok(value):
            return  # the label is formatted only for a message
        raise refusal(owner.format(name=attribute.name), wanted, value, hint=hint, error=error)

    return validate


def positive_int(owner: str, **options: Any) -> Validator:
    """Accept an int of at least 1."""
    return field(lambda v: is_int(v, 1), owner, "a positive int", **options)


def non_negative_int(owner: str, **options: Any) -> Validator:
    """Accept an int of at least 0."""
    return field(lambda v: is_int(v, 0), owner, "a non-negative int", **options)


def a_bool(owner: str, **options: Any) -> Validator:
    """Accept True or False (not 0, 1 or a string)."""
    return field(lambda v: isinstance(v, bool), owner, "True or False", **options)


# The pipes' wait() takes milliseconds as a C int: about 24 days at most. Longer waits are a
# typo or a wish for "forever", which a launcher should not grant a hung rank.
MAX_SECONDS = 1_000_000


def positive_number(
    owner: str, *, unit: str = "", at_most: float = math.inf, finite: bool = True, **options: Any
) -> Validator:
    """Accept a finite number above 0 (and at most ``at_most``), of ``unit`` if named."""
    what = "a positive number" + (f" of {unit}" if unit else "")
    if at_most < math.inf:
        what += f", at most {int(at_most) if float(at_most).is_integer() else at_most}"
    return field(
        lambda v: is_number(v, above=0, at_most=at_most, finite=finite), owner, what, **options
    )


def choice(
    owner: str, choices: Sequence[object], *, subclasses: bool = False, **options: Any
) -> Validator:
    """Accept one of ``choices``, of the same type as the choice it equals.

    ``subclasses=True`` also accepts a subclass of that type (a ``StrEnum`` member
    for a str choice), but never a bool for an int.
    """
    what = "one of " + ", ".join(map(repr, choices))
    kinds = tuple({type(c) for c in choices})

    def ok(v: object) -> bool:
        if not subclasses or (isinstance(v, bool) and bool not in kinds):
            return type(v) in kinds and v in choices
        return isinstance(v, kinds) and v in choices

    return field(ok, owner, what, **options)


def instance_of(owner: str, kind: type | tuple[type, ...], what: str, **options: Any) -> Validator:
    """Accept an instance of ``kind``, described to the user as ``what``."""
    return field(lambda v: isinstance(v, kind), owner, what, **options)


def callable_field(owner: str, what: str, **options: Any) -> Validator:
    """Accept a callable, described to the user as ``what`` (its arguments, result)."""
    return field(callable, owner, what, **options)


def rank_and_world(owner: str) -> tuple[Validator, Validator]:
    """Return the validators of a ``rank`` and a ``world_size`` field: ``0 <= rank < world_size``.

    attrs runs validators once every field is set and again on each assignment,
    so each side checks against the other's current value; a world size that is
    not a positive int gets its own message from its own validator.
    """
    rank_is_count, world_is_positive = non_negative_int(owner), positive_int(owner)

    def below(rank: object, world: object) -> None:
        if is_int(rank) and is_int(world) and 0 < world <= rank:
            raise UsageError(
                f"{owner.format(name='rank')} must be below world_size "
                f"(got rank={rank}, world_size={world})."
            )

    def rank(instance: Any, attribute: Any, value: Any) -> None:
        rank_is_count(instance, attribute, value)
        below(value, getattr(instance, "world_size", None))

    def world_size(instance: Any, attribute: Any, value: Any) -> None:
        world_is_positive(instance, attribute, value)
        below(getattr(instance, "rank", None), value)

    return rank, world_size
