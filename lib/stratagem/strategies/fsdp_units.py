"""FSDP units: which submodules ``fsdp()`` shards as groups of their own, and the wrap that does it.

A shard policy is a plain function ``shard_when(module) -> bool``; any
callable with that signature is one, and `every_module_of` and
`above_parameters` are the ready-made ones, as frozen attrs callables so that a
strategy holding them pickles to spawned ranks and prints readably. `WrapFSDP`
applies ``fully_shard`` bottom-up where the policy says, then to the root.
(Not to be confused with `stratagem.sharding`, which splits data loaders.)
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch

from stratagem.collectives import group_for, is_distributed
from stratagem.env import Context, check_context
from stratagem.errors import CombinatorError, UsageError, describe
from stratagem.precisions import BATCH_NORMS, precision_of
from stratagem.replicas import check_same_layout
from stratagem.strategies.fsdp_groups import (
    ShardGroup,
    as_groups,
    check_groups,
    mp_policy_field,
    reshard_field,
    shard_groups,
)
from stratagem.validators import (
    a_bool,
    callable_field,
    decision,
    is_int,
    non_negative_int,
    require,
)

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "AboveParameters",
    "EveryModuleOf",
    "ShardPolicy",
    "WrapFSDP",
    "above_parameters",
    "every_module_of",
    "is_sharded",
]


class ShardPolicy(Protocol):
    """Which submodules get their own ``fully_shard`` group."""

    def __call__(self, module: torch.nn.Module, /) -> bool:
        """Return whether to shard ``module`` (its sharded descendants are already sharded)."""
        ...


def _module_types(
    instance: object, attribute: attrs.Attribute[tuple[type, ...]], value: tuple[object, ...]
) -> None:
    bad = [t for t in value if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
    if not value or bad:
        shown = describe(bad[0]) if bad else "nothing"
        raise UsageError(
            f"every_module_of: pass one or more torch.nn.Module subclasses (got {shown}), "
            "e.g. every_module_of(torch.nn.TransformerEncoderLayer)."
        )


@attrs.frozen(repr=False)
class EveryModuleOf:
    """Shard policy: shard every module that is an instance of one of ``types``."""

    types: tuple[type[torch.nn.Module], ...] = attrs.field(validator=_module_types)

    def __call__(self, module: torch.nn.Module) -> bool:
        return isinstance(module, self.types)

    def __repr__(self) -> str:
        return f"every_module_of({', '.join(t.__qualname__ for t in self.types)})"


def every_module_of(*types: type[torch.nn.Module]) -> EveryModuleOf:
    """Return a policy that shards every module of the given types (a transformer's blocks).

    Raises:
        UsageError: no types, or one is not a ``torch.nn.Module`` subclass.

    Example:
        >>> policy = every_module_of(torch.nn.Linear)
        >>> policy(torch.nn.Linear(2, 2)), policy(torch.nn.ReLU())
        (True, False)
    """
    return EveryModuleOf(types)


_COUNT = non_negative_int("above_parameters: '{name}'")


def _unsharded_numel(module: torch.nn.Module) -> int:
    """Parameter elements of ``module`` that no sharded descendant already holds."""
    seen: set[int] = set()
    total, stack = 0, [module]
    while stack:
        current = stack.pop()
        for parameter in current.parameters(recurse=False):
            if id(parameter) not in seen:  # a shared parameter counts once
                seen.add(id(parameter))
                total += parameter.numel()
        stack.extend(child for child in current.children() if not is_sharded(child))
    return total


@attrs.frozen
class AboveParameters:
    """Shard policy: shard a module holding more than ``count`` parameter elements.

    Elements already held by a sharded descendant do not count, as in FSDP1's
    size-based policy, so parents of sharded blocks stay in the root's group.
    """

    count: int = attrs.field(validator=_COUNT)

    def __call__(self, module: torch.nn.Module) -> bool:
        return _unsharded_numel(module) > self.count

    def __repr__(self) -> str:
        return f"above_parameters({self.count})"


def above_parameters(count: int) -> AboveParameters:
    """Return a policy that shards modules with more than ``count`` unsharded parameter elements.

    Raises:
        UsageError: ``count`` is not a non-negative int.

    Example:
        >>> policy = above_parameters(100)
        >>> policy(torch.nn.Linear(10, 10)), policy(torch.nn.Linear(9, 9))  # 110 and 90 elements
        (True, False)
    """
    return AboveParameters(count)


def is_sharded(module: torch.nn.Module) -> bool:
    fsdp_module = sys.modules.get("torch.distributed.fsdp")  # not imported: nothing is sharded
    return fsdp_module is not None and isinstance(module, fsdp_module.FSDPModule)


# --- the wrap field: fully_shard bottom-up, as the policy says ---------------------------------


_POLICY = callable_field(
    "fsdp({name}=...)",
    "a function module -> bool",
    optional="None (shard the root only)",
    hint="; e.g. every_module_of(MyBlock) or above_parameters(10**6)",
)
_RESHARD = reshard_field("fsdp({name}=...)")
_MP_POLICY = mp_policy_field(
    "fsdp({name}=...)", hint=", e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16)"
)


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
    not copied. With ``offload``, FSDP keeps the sharded parameters, gradients
    and optimizer state in host memory (``CPUOffloadPolicy``, pinned on CUDA)
    and copies each group to the device for its forward and backward.
    """

    shard_when: ShardPolicy | None = attrs.field(default=None, validator=_POLICY)
    reshard_after_forward: bool | int | None = attrs.field(default=None, validator=_RESHARD)
    mp_policy: MixedPrecisionPolicy | None = attrs.field(default=None, validator=_MP_POLICY)
    sync_module_states: bool = attrs.field(default=True, validator=a_bool("fsdp({name}=...)"))
    offload: bool = attrs.field(default=False, validator=a_bool("fsdp({name}=...)"))
    groups: tuple[ShardGroup, ...] = attrs.field(
        default=(), converter=as_groups, validator=lambda _, __, v: check_groups(v)
    )

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        from torch.distributed.fsdp import fully_shard

        require(isinstance(module, torch.nn.Module), "wrap: 'module'", "a torch.nn.Module", module)
        if is_sharded(module):
            raise UsageError(
                f"wrap: {type(module).__name__} is already sharded; wrap the plain module once."
            )
        if check_context(ctx, "wrap").mesh is None:
            raise UsageError(
                "wrap: ctx.extras has no 'mesh'; pass the Context that fsdp().setup returned, "
                "or add one: ctx.with_extras(mesh=device_mesh(ctx))."
            )
        shard_size = ctx.data_mesh.shape[-1]  # HSDP shards over the last data dimension
        _check_reshard(self.reshard_after_forward, shard_size, "fsdp")  # before any change
        policy = self._policy(ctx)

        def check(group: ShardGroup) -> None:
            _check_reshard(group.reshard_after_forward, shard_size, "shard_group")
            if group.mp_policy is not None and policy is not None and self.mp_policy is None:
                raise CombinatorError(
                    f"wrap: shard_group{group.modules!r} sets mp_policy, but with_precision "
                    "sets the run's; pass either a group's mp_policy or with_precision, not both."
                )

        if self.sync_module_states:
            # Shards of different initialisations would stitch together a model no rank built.
            _copy_rank_zeros_states(module, ctx)
        # Under tensor parallelism the model's parts are already spread over "tp": shard over
        # the data-parallel dimensions only.
        options: dict[str, Any] = {"mesh": ctx.data_mesh}
        if self.reshard_after_forward is not None:  # None: torch's default for root and children
            options["reshard_after_forward"] = self.reshard_after_forward
        if policy is not None:
            options["mp_policy"] = policy
        if self.offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            # Pinned host memory speeds copies to a GPU; a CPU-only machine has none to pin.
            options["offload_policy"] = CPUOffloadPolicy(pin_memory=ctx.device.type == "cuda")
        if policy is not None and policy.param_dtype not in (None, torch.float32):
            # BatchNorm keeps float32 statistics, which batch_norm does not mix with a
            # low-precision weight: each one is a group of its own, computed in float32.
            exact = dataclasses.replace(policy, param_dtype=torch.float32)
            for norm in [m for m in _bottom_up(module) if isinstance(m, BATCH_NORMS)]:
                fully_shard(norm, **{**options, "mp_policy": exact})
        if self.groups:
            shard_groups(module, self.groups, options, check)
        if self.shard_when is not None:
            # Post-order: a policy sees a module after its chosen descendants are sharded.
            who = f"shard_when {self.shard_when!r}"
            for child in [m for m in _bottom_up(module) if _has_forward(m)]:
                if decision(self.shard_when, child, who):
                    fully_shard(child, **options)
        fully_shard(module, **options)
        return module

    def _policy(self, ctx: Context) -> MixedPrecisionPolicy | None:
        """Return ``mp_policy``, or the run's precision's (`precision_of`); never both."""
        state = precision_of(ctx)
        wanted = None if state is None else state.fsdp_policy()
        if state is None or wanted is None:
            return self.mp_policy
        if self.mp_policy is not None:
            raise CombinatorError(
                f"wrap: precision {state.precision!r} sets FSDP's mixed precision policy, "
                f"but this fsdp wrap already has mp_policy={self.mp_policy!r}; pass either "
                "fsdp(mp_policy=...) or with_precision, not both."
            )
        return wanted


def _check_reshard(reshard: object, shard_size: int, where: str) -> None:
    if is_int(reshard, 2) and shard_size % reshard:
        raise UsageError(
            f"wrap: {where}(reshard_after_forward={reshard}) must divide the shard group's "
            f"size, {shard_size} rank(s) here; pass a factor of it, True or False."
        )


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
    from torch.distributed.tensor import DTensor

    # A DTensor was distributed by tensor parallelism from a copy of rank 0's whole module.
    tensors = [t for t in (*module.parameters(), *module.buffers()) if not isinstance(t, DTensor)]
    meta = torch.tensor([int(any(t.is_meta for t in tensors))], device=ctx.device)
    agreed = [torch.zeros_like(meta) for _ in range(ctx.world_size)]
    dist.all_gather(agreed, meta, group=group_for(meta, ctx))
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
            dist.broadcast(travelling, src=0, group=group_for(travelling, ctx))
            if ctx.rank != 0:
                tensor.copy_(travelling)
