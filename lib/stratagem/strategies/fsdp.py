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
import dataclasses
from collections.abc import Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import attrs
import torch

from stratagem import training
from stratagem.arrivals import DEFAULT_TIMEOUT
from stratagem.devices import DeviceSpec
from stratagem.env import Context, Env, check_context, check_env
from stratagem.errors import UsageError, describe
from stratagem.fields import SetupFn
from stratagem.launching import Spawn, spawned
from stratagem.process_group import JoinProcessGroup
from stratagem.replicas import check_same_layout, is_distributed
from stratagem.strategies.ddp import ddp
from stratagem.strategies.shard_policies import (
    AboveParameters,
    EveryModuleOf,
    ShardPolicy,
    above_parameters,
    every_module_of,
    is_sharded,
)
from stratagem.strategy import Strategy

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
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
    "mesh_shape",
]

ShardSize = int | Literal["world", "node"]
"""Ranks per shard group: ``"world"`` (all), ``"node"`` (the ranks of a node), or a number."""

OPTIMIZER_BEFORE_WRAP = (
    "update: the optimizer holds a parameter that is not sharded ({what}): it was built "
    "before wrap, from parameters that fully_shard has replaced, so its steps would not "
    "reach the module. Build the optimizer after wrap: model = strategy.wrap(model, ctx), "
    "then optimizer = torch.optim.AdamW(model.parameters())."
)


def _check_shard_size(value: object) -> None:
    if isinstance(value, str) and value in ("world", "node"):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(
            f"'shard_size' must be 'world', 'node' or a positive int (got {describe(value)})."
        )


def _shard_size(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _check_shard_size(value)


def mesh_shape(env: Env, shard_size: ShardSize = "world") -> tuple[int, ...]:
    """Return the mesh shape for ``shard_size``: ``(world,)``, or ``(replicas, shard_size)``.

    Raises:
        UsageError: the shard groups do not divide the world evenly.

    Example:
        >>> mesh_shape(Env(world_size=8, local_world_size=4), "node")
        (2, 4)
    """
    _check_shard_size(shard_size)
    world = env.world_size
    if isinstance(shard_size, int):
        size = shard_size
    else:
        size = world if shard_size == "world" else env.local_world_size
    if world % size:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        what = f"{size} ranks per node" if shard_size == "node" else f"{size} ranks"
        raise UsageError(
            f"fsdp: shard_size={shard_size!r} ({what}) does not divide the world of {world} "
            f"ranks into equal shard groups; use one of {divisors}, or shard_size='world'."
        )
    return (world,) if size == world else (world // size, size)


def device_mesh(ctx: Context, shard_size: ShardSize = "world") -> DeviceMesh:
    """Build the device mesh of a joined world: 1-D (shard over all), or 2-D ``(replicate, shard)``.

    Raises:
        UsageError: the shard groups do not divide the world (see `mesh_shape`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(ctx.env, shard_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)


@attrs.frozen(kw_only=True)
class JoinMesh:
    """Setup field: run ``join`` (join the process group), then add ``ctx.extras["mesh"]``."""

    join: SetupFn = attrs.field(factory=JoinProcessGroup)
    shard_size: ShardSize = attrs.field(default="world", validator=_shard_size)

    def __call__(self, env: Env) -> Context:
        check_env(env, "setup")
        mesh_shape(env, self.shard_size)  # a world that does not factor fails before joining
        ctx = self.join(env)
        return ctx.with_extras(mesh=device_mesh(ctx, self.shard_size))


def _policy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not callable(value):
        raise UsageError(
            f"'shard_when' must be None (shard the root only) or a function module -> bool, "
            f"e.g. every_module_of(MyBlock) or above_parameters(10**6) (got {describe(value)})."
        )


def _reshard(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None or isinstance(value, bool):
        return
    if not isinstance(value, int) or value < 2:
        raise UsageError(
            f"'reshard_after_forward' must be None, True, False or a shard group size of at "
            f"least 2 (got {describe(value)})."
        )


def _mp_policy(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(value, MixedPrecisionPolicy):
        raise UsageError(
            f"'mp_policy' must be None or a torch.distributed.fsdp.MixedPrecisionPolicy "
            f"(got {describe(value)}), e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)."
        )


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"'{attribute.name}' must be True or False (got {describe(value)}).")


def _bottom_up(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Yield the descendants of ``module`` children first, each once, skipping sharded subtrees."""
    seen: set[int] = set()

    def visit(current: torch.nn.Module) -> Iterator[torch.nn.Module]:
        for child in current.children():
            if id(child) in seen or is_sharded(child):
                continue
            seen.add(id(child))
            yield from visit(child)
            yield child

    return visit(module)


def _has_forward(module: torch.nn.Module) -> bool:
    # fully_shard hooks forward; containers without one (ModuleList, ModuleDict) never run it.
    return type(module).forward is not torch.nn.Module.forward


@attrs.frozen(kw_only=True)
class WrapFSDP:
    """Wrap field: ``fully_shard`` the submodules ``shard_when`` picks, bottom-up, then the root.

    Under a low-precision ``mp_policy``, every BatchNorm is a group of its own
    with ``param_dtype=float32`` (its statistics are float32, and batch_norm
    takes no bfloat16 weight beside them). The module is sharded in place on
    ``ctx.extras["mesh"]`` and returned;
    ``fully_shard`` moves its parameters to the mesh's device. With
    ``sync_module_states`` (the default), rank 0's parameters and buffers are
    first copied to every rank, as ``ddp()`` does, so ranks seeded differently
    start from one model; a module on the meta device (initialised later) is
    not copied.
    """

    shard_when: ShardPolicy | None = attrs.field(default=None, validator=_policy)
    reshard_after_forward: bool | int | None = attrs.field(default=None, validator=_reshard)
    mp_policy: MixedPrecisionPolicy | None = attrs.field(default=None, validator=_mp_policy)
    sync_module_states: bool = attrs.field(default=True, validator=_flag)

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        if not isinstance(module, torch.nn.Module):
            raise UsageError(f"wrap: 'module' must be a torch.nn.Module (got {describe(module)}).")
        if is_sharded(module):
            raise UsageError(
                f"wrap: {type(module).__name__} is already sharded; wrap the plain module once."
            )
        mesh = check_context(ctx, "wrap").extras.get("mesh")
        if mesh is None:
            raise UsageError(
                "wrap: ctx.extras has no 'mesh'; pass the Context that fsdp().setup returned, "
                "or add one: ctx.with_extras(mesh=device_mesh(ctx))."
            )
        if self.sync_module_states:
            # Shards of different initialisations would stitch together a model no rank built.
            _copy_rank_zeros_states(module, ctx)
        options: dict[str, Any] = {"mesh": mesh}
        if self.reshard_after_forward is not None:  # None: torch's default for root and children
            options["reshard_after_forward"] = self.reshard_after_forward
        if self.mp_policy is not None:
            options["mp_policy"] = self.mp_policy
        policy = self.mp_policy
        if policy is not None and policy.param_dtype not in (None, torch.float32):
            # BatchNorm keeps float32 statistics, which batch_norm does not mix with a
            # low-precision weight: each one is a group of its own, computed in float32.
            exact = dataclasses.replace(policy, param_dtype=torch.float32)
            for norm in [m for m in _bottom_up(module) if isinstance(m, _BATCH_NORMS)]:
                fully_shard(norm, **{**options, "mp_policy": exact})
        if self.shard_when is not None:
            # Post-order: a policy sees a module after its chosen descendants are sharded.
            for child in [m for m in _bottom_up(module) if _has_forward(m)]:
                if _decide(self.shard_when, child):
                    fully_shard(child, **options)
        fully_shard(module, **options)
        return module


def _copy_rank_zeros_states(module: torch.nn.Module, ctx: Context) -> None:
    """Overwrite every rank's parameters and buffers with rank 0's, one tensor at a time.

    Nothing is moved for good: a tensor on the CPU travels through the device
    and comes back, so the unsharded model never sits whole on the device. A
    module on the meta device (initialised after sharding) is left as it is;
    ranks must agree on that.
    """
    if not is_distributed(ctx):
        return
    import torch.distributed as dist

    tensors = [*module.parameters(), *module.buffers()]
    meta = torch.tensor([int(any(t.is_meta for t in tensors))], device=ctx.device)
    agreed = [torch.zeros_like(meta) for _ in range(ctx.world_size)]
    dist.all_gather(agreed, meta, group=ctx.group)
    on_meta = [rank for rank, flag in enumerate(agreed) if int(flag)]
    if on_meta and len(on_meta) < ctx.world_size:
        raise UsageError(
            f"wrap: rank(s) {on_meta} hold the module on the meta device and the others do "
            "not; build it the same way on every rank (all on meta, then initialise after "
            "wrap, or all real: fsdp() copies rank 0's weights to the others)."
        )
    if on_meta:
        return
    check_same_layout(module, ctx)
    with torch.no_grad():
        for tensor in tensors:
            travelling = tensor.detach().to(ctx.device)
            dist.broadcast(travelling, src=0, group=ctx.group)
            if ctx.rank != 0:
                tensor.copy_(travelling)


_BATCH_NORMS = (
    torch.nn.BatchNorm1d,
    torch.nn.BatchNorm2d,
    torch.nn.BatchNorm3d,
    torch.nn.SyncBatchNorm,
)


def _decide(policy: ShardPolicy, module: torch.nn.Module) -> bool:
    decision = policy(module)
    if not isinstance(decision, bool):
        raise UsageError(
            f"wrap: shard_when {policy!r} must return True or False, but returned "
            f"{describe(decision)} for a {type(module).__name__}."
        )
    return decision


def fsdp_update(optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context) -> None:
    """Update field: check that ``optimizer`` holds sharded parameters, then step and zero grads.

    The check looks at the first parameter of each group, so it costs the same
    for any model size.

    Raises:
        UsageError: a parameter group starts with a plain tensor, the mark of
            an optimizer built before ``wrap`` (`OPTIMIZER_BEFORE_WRAP`).
    """
    from torch.distributed.tensor import DTensor

    training.check_optimizer(optimizer, "update")
    check_context(ctx, "update")
    for group in optimizer.param_groups:
        params = group["params"]
        if params and not isinstance(params[0], DTensor):
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


def fsdp_no_sync(module: torch.nn.Module, ctx: Context) -> AbstractContextManager[None]:
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


def clip_grad_norm(
    module: torch.nn.Module, max_norm: float, *, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale ``module``'s gradients so that their total norm is at most ``max_norm``.

    Works on sharded (DTensor) gradients, computing the norm over every
    shard, and on plain ones, so one call serves every strategy. Gradients
    must all live on one mesh (as ``fsdp()`` puts them).

    Args:
        module: the wrapped module, after ``backward``.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``float("inf")`` for the largest entry).

    Returns:
        The total norm before clipping, a plain tensor, the same on every rank.

    Raises:
        UsageError: ``module`` is not a module, or ``max_norm`` or ``norm_type``
            is not a positive number.
    """
    training.check_module(module, "clip_grad_norm")
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise UsageError(
            f"clip_grad_norm: 'max_norm' must be a positive number (got {describe(max_norm)})."
        )
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise UsageError(
            f"clip_grad_norm: 'norm_type' must be a positive number, float('inf') for the "
            f"largest entry (got {describe(norm_type)})."
        )
    return training.clip_norm_(list(module.parameters()), max_norm, norm_type)


def fsdp(
    *,
    shard_when: ShardPolicy | None = None,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    shard_size: ShardSize = "world",
    sync_module_states: bool = True,
    device: DeviceSpec = "auto",
    backend: str | None = None,
    timeout: float | timedelta = timedelta(minutes=30),
    arrival_timeout: float = DEFAULT_TIMEOUT,
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
        device: ``"auto"`` (``cuda:LOCAL_RANK``, else CPU) or a device.
        backend: ``None`` picks gloo on CPU and nccl on CUDA.
        timeout: seconds (or a ``timedelta``) for process-group init and collectives.
        arrival_timeout: seconds that ``save``, ``load`` and ``barrier`` wait for every
            rank to call them (see `ddp`).

    Raises:
        UsageError: an option has the wrong type or value.
    """
    base = ddp(device=device, backend=backend, timeout=timeout, arrival_timeout=arrival_timeout)
    return attrs.evolve(
        base,
        name="fsdp",
        setup=JoinMesh(join=base.setup, shard_size=shard_size),
        wrap=WrapFSDP(
            shard_when=shard_when,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            sync_module_states=sync_module_states,
        ),
        update=fsdp_update,
        no_sync=fsdp_no_sync,
    )


def fsdp_spawn(*, start: Spawn | None = None, **options: Any) -> Strategy:
    """Return ``spawned(fsdp(**options), start)``: `fsdp` with ranks spawned on this host.

    Example:
        >>> fsdp_spawn(shard_size=2) == spawned(fsdp(shard_size=2))
        True
    """
    return spawned(fsdp(**options), start)
