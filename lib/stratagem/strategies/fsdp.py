"""``fsdp()`` and ``fsdp_spawn()``: fully sharded data parallel on ``fully_shard`` (FSDP2).

``fsdp()`` is ``ddp()`` with four fields substituted: ``setup`` joins the
process group as ``ddp()`` does and adds a device mesh to ``ctx.extras["mesh"]``,
``wrap`` shards the module bottom-up as a policy says, ``no_sync`` turns off
gradient synchronisation, ``update`` checks that the optimizer holds the
sharded parameters. ``fsdp_spawn()`` differs from ``fsdp()`` by its launch field only.

``torch.distributed.fsdp`` takes over a second to import, so it is imported
where it is used, never by ``import stratagem``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Unpack, cast

import attrs
import torch

from stratagem import training
from stratagem.env import Context, MeshNames, check_context
from stratagem.env import mesh_names as env_mesh_names
from stratagem.errors import UsageError
from stratagem.launching import SpawnVariant
from stratagem.meshes import JoinMesh, ShardSize
from stratagem.process_group import JoinProcessGroup, WorldOptions
from stratagem.strategies.ddp import ddp
from stratagem.strategies.fsdp_groups import ShardGroup
from stratagem.strategies.fsdp_units import ShardPolicy, WrapFSDP, is_sharded
from stratagem.strategy import Strategy
from stratagem.validators import is_int, require

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["OPTIMIZER_BEFORE_WRAP", "fsdp", "fsdp_no_sync", "fsdp_spawn", "fsdp_update", "hsdp"]

OPTIMIZER_BEFORE_WRAP = (
    "update: the optimizer holds a parameter that is not sharded ({what}): it was built "
    "before wrap, from parameters that fully_shard has replaced, so its steps would not "
    "reach the module. Build the optimizer after wrap: model = strategy.wrap(model, ctx), "
    "then optimizer = torch.optim.AdamW(model.parameters())."
)


def fsdp_update(optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context) -> None:
    """Update field: check that ``optimizer`` holds sharded parameters, then step and zero grads.

    The check looks at the first parameter of each group, so it costs the same
    for any model size; it is made with `training.check_update`'s, once per
    (optimizer, module) pair, which is then trusted.

    Raises:
        UsageError: a parameter group starts with a plain tensor, the mark of
            an optimizer built before ``wrap`` (`OPTIMIZER_BEFORE_WRAP`).
    """
    if not training.is_trusted(optimizer, module, ctx):  # checked once per pair, then trusted
        training.check_optimizer(optimizer, "update")
        check_context(ctx, "update")
        # Not imported, nothing is sharded (an import statement costs a µs).
        tensors = sys.modules.get("torch.distributed.tensor")
        for group in optimizer.param_groups:
            params = group["params"]
            if params and (tensors is None or not isinstance(params[0], tensors.DTensor)):
                first = params[0]
                what = f"a {type(first).__name__} of shape {tuple(first.shape)}"
                raise UsageError(OPTIMIZER_BEFORE_WRAP.format(what=what))
    training.update(optimizer, module, ctx)


@contextlib.contextmanager
def _gradient_sync_off(module: Any) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def fsdp_no_sync(module: torch.nn.Module, ctx: Context) -> contextlib.AbstractContextManager[None]:
    """No-sync field: ``set_requires_gradient_sync(False)`` inside, ``True`` again on exit.

    Gradients accumulate unsharded on each rank until a backward outside the context.

    Raises:
        UsageError: ``module`` is not the sharded module that ``wrap`` returned.
    """
    check_context(ctx, "no_sync")
    module = training.original_module(module)  # wrap's result, compiled or not
    if not is_sharded(module):
        raise UsageError(
            f"no_sync: 'module' must be the module wrap returned (an FSDPModule), "
            f"got {type(module).__name__}."
        )
    return _gradient_sync_off(module)


def fsdp(
    *,
    shard_when: ShardPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_size: ShardSize = "world",
    sync_module_states: bool = True,
    offload: bool = False,
    groups: Sequence[ShardGroup] = (),
    mesh_names: MeshNames | Mapping[str, str] | None = None,
    **world: Unpack[WorldOptions],
) -> Strategy:
    """Fully sharded data parallel (``fully_shard``) on the ranks torchrun or SLURM started.

    Build the optimizer after ``wrap``, from the wrapped module's parameters:
    ``fully_shard`` replaces them with sharded ones. For ranks started here,
    use `fsdp_spawn`.

    Args:
        shard_when: a policy ``module -> bool``, asked of every submodule
            bottom-up (e.g. `every_module_of`, `above_parameters`); each ``True``
            makes one group whose parameters are gathered together. ``None``
            shards the root only: one group, gathered whole for every forward.
        reshard_after_forward: passed to ``fully_shard``; ``None`` is torch's
            default (``True`` for submodules, ``False`` for the root).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy``, or ``None``.
        shard_size: ranks per shard group: ``"world"`` shards over all ranks;
            ``"node"`` or a number builds a hybrid 2-D mesh that shards within
            groups of that size and replicates across them.
        sync_module_states: copy rank 0's parameters and buffers to every
            rank before sharding (as ``ddp()`` does), so that ranks seeded
            differently start from the same model; ``False`` shards each
            rank's own initialisation (the caller guarantees they agree).
        offload: keep sharded parameters, gradients and optimizer state in host
            memory between uses (FSDP2's ``CPUOffloadPolicy``; pinned on CUDA).
        groups: `shard_group` records, sharded before ``shard_when``'s picks:
            each group's modules are gathered together, with the group's own
            ``reshard_after_forward``, ``mp_policy`` and ``shard_placement_fn``
            where it sets them. torchtitan's layout is
            ``groups=[*(shard_group(f"layers.{i}") for i in range(n - 1)),
            shard_group(f"layers.{n - 1}", reshard_after_forward=False),
            shard_group("norm", "output", reshard_after_forward=False)]``.
        mesh_names: what the mesh calls each dimension, by role (`MeshNames`, or a
            mapping such as ``{"replicate": "dp_replicate", "shard": "dp_shard"}``);
            stratagem's own (``"replicate"``, ``"shard"``, ``"tp"``) by default.
        **world: how the ranks join their world (`WorldOptions`), as for `ddp`.

    Raises:
        UsageError: an option has the wrong type or value.
    """
    base = ddp(**world)
    names = env_mesh_names(mesh_names)
    return attrs.evolve(
        base,
        name="fsdp",
        setup=JoinMesh(join=cast(JoinProcessGroup, base.setup), shard_size=shard_size, names=names),
        wrap=WrapFSDP(
            shard_when=shard_when,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            sync_module_states=sync_module_states,
            offload=offload,
            groups=groups,
        ),
        no_sync=fsdp_no_sync,
        update=fsdp_update,
    )


fsdp_spawn = SpawnVariant(fsdp)
"""``spawned(fsdp(**options), start)``: `fsdp` with ranks spawned on this host."""


def hsdp(*, replicate: int, shard: int, **options: Any) -> Strategy:
    """Hybrid sharding: `fsdp` within groups of ``shard`` ranks, replicated ``replicate`` times.

    The mesh is 2-D, ``("replicate", "shard")``: gradients are reduce-scattered
    within a shard group and all-reduced across them. Under ``no_sync`` (and
    so under ``accumulate``), both are skipped until the last micro-batch. The
    product must be the world size (checked by ``setup``, before joining).

    Example:
        >>> hsdp(replicate=2, shard=2).setup.replicate
        2

    Raises:
        UsageError: ``replicate`` or ``shard`` is not a positive int, or an option is malformed.
    """
    require(is_int(replicate, 1), "hsdp: 'replicate'", "a positive int", replicate)
    require(is_int(shard, 1), "hsdp: 'shard'", "a positive int", shard)
    strategy = fsdp(shard_size=shard, **options)
    setup = attrs.evolve(cast(JoinMesh, strategy.setup), replicate=replicate)
    return attrs.evolve(strategy, name="hsdp", setup=setup)
