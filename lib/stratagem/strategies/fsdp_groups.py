"""FSDP groups as data: modules sharded together, each group with its own options.

``fsdp(groups=[...])`` takes `ShardGroup` records, so torchtitan's layout (each
block a group, the last one kept gathered after forward, the final norm and
the output layer one group together) is one ``fsdp(...)`` call rather than a
substituted ``wrap``. A group names its modules by their names in the model
(``"layers.3"``, ``"norm"``), which pickle to spawned ranks and print readably.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch

from stratagem.errors import UsageError, describe
from stratagem.validators import Validator, callable_field, field, is_int

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "ShardGroup",
    "as_groups",
    "check_groups",
    "is_mp_policy",
    "is_reshard",
    "mp_policy_field",
    "reshard_field",
    "shard_group",
    "shard_groups",
]


def _names(instance: object, attribute: attrs.Attribute[tuple[str, ...]], value: object) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(n, str) and n for n in value)
        or len(set(value)) != len(value)
    ):
        raise UsageError(
            f"shard_group: name one or more submodules, each once, by their names in the model "
            f"(got {describe(value)}), e.g. shard_group('norm', 'output')."
        )


def is_mp_policy(value: object) -> bool:
    """Whether ``value`` is a ``MixedPrecisionPolicy`` (imports FSDP, slowly: only when asked)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return isinstance(value, MixedPrecisionPolicy)


def is_reshard(value: object) -> bool:
    """Whether ``value`` is a ``reshard_after_forward``: None, a bool or a group size >= 2."""
    return value is None or isinstance(value, bool) or is_int(value, 2)


def reshard_field(owner: str) -> Validator:
    """Return the validator of ``owner``'s ``reshard_after_forward`` (`is_reshard`)."""
    return field(is_reshard, owner, "None, True, False or a shard group size of at least 2")


def mp_policy_field(owner: str, hint: str = "") -> Validator:
    """Return the validator of ``owner``'s ``mp_policy``, None allowed (`is_mp_policy`)."""
    wanted = "a torch.distributed.fsdp.MixedPrecisionPolicy"
    return field(is_mp_policy, owner, wanted, optional="None", hint=hint)


_OWNER = "shard_group({name}=...)"


@attrs.frozen
class ShardGroup:
    """Modules that ``fully_shard`` makes one group (gathered together), and that group's options.

    ``None`` leaves an option as ``fsdp()`` sets it for every group.
    """

    modules: tuple[str, ...] = attrs.field(validator=_names)
    reshard_after_forward: bool | int | None = attrs.field(
        default=None, validator=reshard_field(_OWNER)
    )
    mp_policy: MixedPrecisionPolicy | None = attrs.field(
        default=None, validator=mp_policy_field(_OWNER)
    )
    shard_placement_fn: Callable[[torch.nn.Parameter], Any] | None = attrs.field(
        default=None,
        validator=callable_field(
            _OWNER,
            "a function parameter -> Shard or None",
            optional="None (shard dimension 0)",
        ),
    )


def shard_group(
    *modules: str,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_placement_fn: Callable[[torch.nn.Parameter], Any] | None = None,
) -> ShardGroup:
    """Return a group of the submodules named, for ``fsdp(groups=[...])``.

    Raises:
        UsageError: no name, a name twice, or an option of the wrong type.

    Example:
        >>> shard_group("norm", "output", reshard_after_forward=False).modules
        ('norm', 'output')
    """
    return ShardGroup(modules, reshard_after_forward, mp_policy, shard_placement_fn)


def as_groups(value: object) -> object:
    """Return a list of groups as a tuple (a record holds no list); anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


def check_groups(groups: object) -> None:
    """Refuse ``groups`` that are not `ShardGroup` records naming each module once."""
    if not isinstance(groups, tuple) or not all(isinstance(g, ShardGroup) for g in groups):
        raise UsageError(
            f"fsdp(groups=...) must be a list of shard_group(...) records (got "
            f"{describe(groups)}); e.g. groups=[shard_group('norm', 'output')]."
        )
    named: dict[str, int] = {}
    for index, group in enumerate(groups):
        for name in group.modules:
            if name in named:
                raise UsageError(
                    f"fsdp(groups=...): {name!r} is in group {named[name]} and group {index}; "
                    "a module is sharded once: name it in one group."
                )
            named[name] = index


def _resolved(module: torch.nn.Module, group: ShardGroup) -> list[torch.nn.Module]:
    found = []
    for name in group.modules:
        try:
            found.append(module.get_submodule(name))
        except AttributeError:
            children = ", ".join(repr(n) for n, _ in module.named_children())
            raise UsageError(
                f"wrap: fsdp(groups=...) names {name!r}, which {type(module).__name__} does not "
                f"hold; its children are {children} (name a submodule by its dotted path)."
            ) from None
    return found


def _inside(name: str, ancestor: str) -> bool:
    return name.startswith(f"{ancestor}.")


def shard_groups(
    module: torch.nn.Module,
    groups: Sequence[ShardGroup],
    options: dict[str, Any],
    check: Callable[[ShardGroup], None],
) -> None:
    """``fully_shard`` each group, deepest first, with ``options`` and the group's own.

    Every group is checked (``check``, its names, the order) before any is sharded.
    """
    from torch.distributed.fsdp import fully_shard

    # fully_shard takes a module after its sharded descendants: deepest groups go first.
    ordered = sorted(groups, key=lambda g: -max(n.count(".") for n in g.modules))
    for position, group in enumerate(ordered):
        for later in ordered[position + 1 :]:
            clash = [(a, b) for a in group.modules for b in later.modules if _inside(b, a)]
            if clash:
                outer, inner = clash[0]
                raise UsageError(
                    f"wrap: fsdp(groups=...) shards {outer!r} with {list(group.modules)} "
                    f"before {inner!r}, which it holds, with {list(later.modules)}; put "
                    f"{inner!r} in a group whose modules are all at least as deep."
                )
    for group in ordered:
        check(group)
    resolved = [(group, _resolved(module, group)) for group in ordered]
    for group, modules in resolved:
        own = dict(options)
        for name in ("reshard_after_forward", "mp_policy", "shard_placement_fn"):
            if getattr(group, name) is not None:  # None: as fsdp() sets it for every group
                own[name] = getattr(group, name)
        fully_shard(modules if len(modules) > 1 else modules[0], **own)
