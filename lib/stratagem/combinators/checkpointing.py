"""``with_activation_checkpointing``: recompute chosen submodules' activations in backward.

Memory for compute: a checkpointed submodule keeps only its inputs through the
forward and runs again during backward to rebuild what backward needs. The
policy is a plain function ``module -> bool``, the same shape as ``fsdp()``'s
``shard_when`` (`every_module_of`, `above_parameters` serve both). It is
applied before the inner ``wrap`` shards or splits the module, with torch's
composable ``checkpoint``, which hooks the module in place: parameter names,
and so checkpoints, stay as they were.

With ``save=`` the recomputation is selective, by op (torchtitan's default):
the outputs of the ops named are kept from the forward (matrix multiplies,
attention: the expensive ones), and only the rest is recomputed, through
``torch.utils.checkpoint.create_selective_checkpoint_contexts``. The ops are
held by name (``"aten.mm.default"``), which pickles to spawned ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import torch

from stratagem.combinators._base import check_once, check_strategy, outermost_picks
from stratagem.env import Context, check_context
from stratagem.errors import UsageError, describe
from stratagem.fields import WrapFn
from stratagem.strategy import Strategy
from stratagem.validators import require

__all__ = ["CheckpointPolicy", "CheckpointWrap", "with_activation_checkpointing"]

CheckpointPolicy = Callable[[torch.nn.Module], bool]
"""Which submodules to checkpoint: asked of each submodule (not the root), ``True`` for yes."""


@attrs.frozen
class CheckpointWrap:
    """Wrap field: checkpoint each submodule ``policy`` picks, then run ``inner``.

    A picked module's own descendants are not asked: recomputing the outer one
    recomputes them.
    """

    inner: WrapFn
    policy: CheckpointPolicy
    save: tuple[str, ...] = ()

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        from torch.distributed._composable.checkpoint_activation import checkpoint

        require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
        check_context(ctx, "wrap")
        options: dict[str, Any] = {}
        if self.save:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            ops = [_op(name) for name in self.save]
            options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, ops)
        for child in outermost_picks(
            module, self.policy, f"the checkpointing policy {self.policy!r}"
        ):
            checkpoint(child, **options)
        return self.inner(module, ctx)


def _op(name: str) -> Any:
    """Return the op overload called ``name`` (``"aten.mm.default"``)."""
    found: Any = torch.ops
    # No early exit: past a missing part, found is None or an attribute of None, never an op.
    for part in name.split("."):
        found = getattr(found, part, None)
    if type(found).__name__ != "OpOverload":
        raise UsageError(
            f"with_activation_checkpointing: save names {name!r}, which is not an op overload "
            "of torch.ops; name one as 'aten.mm.default' or pass torch.ops.aten.mm.default."
        )
    return found


def _op_names(save: Iterable[object]) -> tuple[str, ...]:
    if isinstance(save, (str, bytes)) or not isinstance(save, Iterable):
        raise UsageError(
            f"with_activation_checkpointing: 'save' must be a list of ops (got {describe(save)}), "
            "e.g. save=[torch.ops.aten.mm.default]."
        )
    names = []
    for op in save:
        if type(op).__name__ == "OpOverloadPacket":
            raise UsageError(
                f"with_activation_checkpointing: save names {op}, every overload of an op; "
                f"name the one meant, e.g. {op}.default."
            )
        name = op if isinstance(op, str) else str(op)
        _op(name)  # refuses a name that is not an overload, before any rank starts
        names.append(name)
    return tuple(names)


def with_activation_checkpointing(
    strategy: Strategy, policy: CheckpointPolicy, *, save: Iterable[object] = ()
) -> Strategy:
    """Recompute the activations of the submodules ``policy`` picks during backward.

    ``save`` makes it selective by op: the outputs of these ops (overloads,
    such as ``torch.ops.aten.mm.default``, or their names) are kept from the
    forward, everything else in a picked module is recomputed.

    Fields touched: ``wrap`` only (`CheckpointWrap`, before the inner wrap).
    Training is unchanged: the recomputed forward gives the same values, so a
    checkpointed strategy passes the same laws against the same reference.

    Example:
        >>> import stratagem as sg
        >>> s = with_activation_checkpointing(sg.fsdp(), sg.every_module_of(torch.nn.Linear))
        >>> s.name
        'fsdp+checkpointing'

    Raises:
        UsageError: ``strategy`` is not a `Strategy`, or ``policy`` is not callable.
        CombinatorError: the strategy already checkpoints activations.
    """
    check_strategy(strategy, "with_activation_checkpointing")
    require(
        callable(policy),
        "with_activation_checkpointing: 'policy'",
        "a function module -> bool (e.g. sg.every_module_of(MyBlock))",
        policy,
    )
    already, fix = "already checkpoints activations", "apply it once, with one policy"
    check_once(strategy, CheckpointWrap, "with_activation_checkpointing", already, fix)
    wrap = CheckpointWrap(strategy.wrap, policy, _op_names(save))
    return attrs.evolve(strategy, name=f"{strategy.name}+checkpointing", wrap=wrap)
