"""``fsdp()`` and ``fsdp_spawn()``: fully sharded data parallel on ``fully_shard`` (FSDP2).

``fsdp()`` is ``ddp()`` with four fields substituted: ``setup`` joins the
process group and adds a device mesh to ``ctx.extras["mesh"]``, ``wrap``
shards the module bottom-up as a policy says, ``no_sync`` turns off gradient
synchronisation, ``update`` checks that the optimizer holds the sharded
parameters. ``fsdp_spawn()`` differs from ``fsdp()`` by its launch field only.

``torch.distributed.fsdp`` takes over a second to import, so it is imported
where it is used, never by ``import stratagem``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import attrs
import torch

from stratagem import checkpoint, collectives, training
from stratagem.arrivals import DEFAULT_TIMEOUT
from stratagem.devices import DeviceSpec, check_device_spec
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.launching import Spawn, in_place, spawned
from stratagem.meshes import JoinMesh, ShardSize, device_mesh, mesh_shape
from stratagem.process_group import DEFAULT_JOIN_TIMEOUT, JoinProcessGroup, leave_process_group
from stratagem.sharding import shard_loader
from stratagem.strategies.fsdp_units import (
    AboveParameters,
    EveryModuleOf,
    ShardPolicy,
    WrapFSDP,
    above_parameters,
    every_module_of,
    is_sharded,
)
from stratagem.strategy import Strategy
from stratagem.training import clip_grad_norm
from stratagem.validators import is_int, require

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "OPTIMIZER_BEFORE_WRAP",
    "AboveParameters",
    "EveryModuleOf",
    "JoinMesh",
    "ShardPolicy",
    "ShardSize",
    "WrapFSDP",
    "above_parameters",
    "clip_grad_norm",
    "device_mesh",
    "every_module_of",
    "fsdp",
    "fsdp_no_sync",
    "fsdp_spawn",
    "fsdp_update",
    "hsdp",
    "mesh_shape",
]

OPTIMIZER_BEFORE_WRAP = (
    "update: the optimizer holds a parameter that is not sharded ({what}): it was built "
    "before wrap, from parameters that fully_shard has replaced, so its steps would not "
    "reach the module. Build the optimizer after wrap: model = strategy.wrap(model, ctx), "
    "then optimizer = torch.optim.AdamW(model.parameters())."
)


def fsdp_update(optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context) -> None:
    """Update field: check that ``optimizer`` holds sharded parameters, then step and zero grads.

    The check looks at the first parameter of each group, so it costs the same
    for any model size.

    Raises:
        UsageError: a parameter group starts with a plain tensor, the mark of
            an optimizer built before ``wrap`` (`OPTIMIZER_BEFORE_WRAP`).
    """
    training.check_optimizer(optimizer, "update")
    check_context(ctx, "update")
    # Not imported, nothing is sharded; an import statement here would cost a µs every step.
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
    device: DeviceSpec = "auto",
    backend: str | None = None,
    timeout: float | timedelta = timedelta(minutes=30),
    arrival_timeout: float = DEFAULT_TIMEOUT,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
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
        device: ``"auto"`` (``cuda:LOCAL_RANK``, else CPU) or a device.
        backend: ``None`` picks gloo on the CPU and ``"cpu:gloo,cuda:nccl"`` on
            CUDA; or any string ``init_process_group`` takes, device mappings
            included. Without a CPU backend (``"nccl"``), setup adds a gloo
            group for CPU traffic (``ctx.cpu_group``).
        timeout: seconds (or a ``timedelta``) for process-group init and collectives.
        arrival_timeout: seconds that ``save``, ``load`` and ``barrier`` wait for every
            rank to call them (see `ddp`).
        join_timeout: seconds that setup waits for every rank to join the world;
            a rank that never comes is a `LaunchError` naming it.

    Raises:
        UsageError: an option has the wrong type or value.
    """
    return Strategy(
        name="fsdp",
        launch=in_place,
        setup=JoinMesh(
            join=JoinProcessGroup(
                device=check_device_spec(device),
                backend=backend,
                timeout=timeout,
                arrival_timeout=arrival_timeout,
                join_timeout=join_timeout,
            ),
            shard_size=shard_size,
        ),
        wrap=WrapFSDP(
            shard_when=shard_when,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            sync_module_states=sync_module_states,
            offload=offload,
        ),
        step=training.step,
        backward=training.backward,
        update=fsdp_update,
        no_sync=fsdp_no_sync,
        reduce=collectives.reduce,
        gather=collectives.gather,
        broadcast=collectives.broadcast,
        barrier=collectives.barrier,
        shard=shard_loader,
        save=checkpoint.save,
        load=checkpoint.load,
        teardown=leave_process_group,
    )


def fsdp_spawn(*, start: Spawn | None = None, **options: Any) -> Strategy:
    """Return ``spawned(fsdp(**options), start)``: `fsdp` with ranks spawned on this host.

    Example:
        >>> fsdp_spawn(shard_size=2) == spawned(fsdp(shard_size=2))
        True
    """
    return spawned(fsdp(**options), start)


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
