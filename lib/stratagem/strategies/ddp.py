"""``ddp()``: DistributedDataParallel on the ranks of a world; ``ddp_spawn()`` = ``spawned(ddp())``.

``ddp()`` is ``single_device()`` with five fields substituted: the process
group's setup and teardown (`stratagem.process_group`), the DDP wrapper and its
``no_sync`` (here), and the shard that gives each rank its part of the data.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any, Unpack

import attrs
import torch
from torch.nn.parallel import DistributedDataParallel

from stratagem import training
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.launching import Spawn, spawned
from stratagem.process_group import WorldOptions, join_world, leave_process_group
from stratagem.replicas import broadcast_tensors
from stratagem.sharding import shard_loader
from stratagem.strategies.single import single_device
from stratagem.strategy import Strategy
from stratagem.validators import a_bool, positive_number

__all__ = ["DDPOptions", "WrapDDP", "ddp", "ddp_no_sync", "ddp_spawn"]

_FLAG = a_bool("ddp({name}=...)")
# DDP turns it into a byte count that its reducer holds in an int64: NaN, infinity and 2**43 MiB
# or more failed there, at wrap, with a raw TypeError on every rank. A cap above the model's
# size makes one bucket, so 1 TiB bounds it with room to spare.
MAX_BUCKET_CAP_MB = 2**20
_BUCKET_CAP = positive_number(
    "ddp({name}=...)",
    unit="MiB, finite",
    at_most=MAX_BUCKET_CAP_MB,
    optional="None",
    hint="; a cap above the model's size already makes one bucket",
)


@attrs.frozen(kw_only=True)
class DDPOptions:
    """Keyword arguments passed to ``DistributedDataParallel``, validated at construction."""

    find_unused_parameters: bool = attrs.field(default=False, validator=_FLAG)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=_FLAG)
    static_graph: bool = attrs.field(default=False, validator=_FLAG)
    broadcast_buffers: bool = attrs.field(default=True, validator=_FLAG)
    bucket_cap_mb: float | None = attrs.field(default=None, validator=_BUCKET_CAP)


@attrs.frozen
class WrapDDP:
    """Wrap field: move the module to the device and wrap it in ``DistributedDataParallel``."""

    options: DDPOptions = DDPOptions()

    def __call__(self, module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
        module = training.to_device(module, ctx)
        if not any(p.requires_grad for p in module.parameters()):
            raise UsageError(
                f"wrap: {type(module).__name__} has no parameters that require grad, so "
                "DistributedDataParallel has nothing to synchronise; wrap a trainable module."
            )
        if ctx.group is None:
            raise UsageError(
                "wrap: ctx has no process group; pass the Context that ddp().setup returned."
            )
        options = attrs.asdict(self.options)
        if not options.pop("broadcast_buffers"):  # the default (True) is not passed at all
            options["broadcast_buffers"] = False
            # DDP then skips buffers at construction too; every rank still starts from rank
            # 0's, as its parameters do (and as fsdp() and allreduce_grads() start).
            broadcast_tensors(list(module.buffers()), ctx, src=0)
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still
            # syncs at init; the old flag keeps its documented meaning on every supported torch.
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            wrapped = DistributedDataParallel(
                module,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.group,
                **options,
            )
        training.mark_inside_a_wrapper(module)  # step/update on it now would skip the sync
        return wrapped


def ddp_no_sync(module: torch.nn.Module, ctx: Context) -> AbstractContextManager[Any]:
    """No-sync field: the wrapper's own ``no_sync`` (under ``torch.compile`` too).

    Raises:
        UsageError: ``module`` is not the ``DistributedDataParallel`` that ``wrap`` returned.
    """
    check_context(ctx, "no_sync")
    module = training.original_module(module)  # wrap's result, compiled or not
    if not isinstance(module, DistributedDataParallel):
        raise UsageError(
            f"no_sync: 'module' must be the module wrap returned (a DistributedDataParallel), "
            f"got {type(module).__name__}."
        )
    return module.no_sync()


def ddp(
    *,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    broadcast_buffers: bool = True,
    bucket_cap_mb: float | None = None,
    **world: Unpack[WorldOptions],
) -> Strategy:
    """DistributedDataParallel on the ranks that torchrun or SLURM started (it runs in place).

    ``ddp()`` is `single_device` with a world: it joins a process group, wraps
    the module in ``DistributedDataParallel`` (whose ``no_sync`` it uses),
    gives each rank its share of the data, and leaves the group at teardown.
    For ranks started here, use ``spawned(ddp())`` (alias `ddp_spawn`), the
    same record with a launch field that spawns.

    Args:
        find_unused_parameters: passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: passed to ``DistributedDataParallel``.
        static_graph: passed to ``DistributedDataParallel``.
        broadcast_buffers: passed to ``DistributedDataParallel``.
        bucket_cap_mb: passed to ``DistributedDataParallel`` (``None``: its default).
        **world: how the ranks join their world (`WorldOptions`: ``device``,
            ``backend``, ``timeout``, ``arrival_timeout``, ``join_timeout``),
            documented on `JoinProcessGroup`.

    Raises:
        UsageError: an option has the wrong type or value.

    Example:
        >>> import stratagem as sg
        >>> sg.ddp(device="cpu", bucket_cap_mb=8).wrap
        WrapDDP(options=DDPOptions(..., bucket_cap_mb=8))
    """
    options = DDPOptions(
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
        static_graph=static_graph,
        broadcast_buffers=broadcast_buffers,
        bucket_cap_mb=bucket_cap_mb,
    )
    return attrs.evolve(
        single_device(),
        name="ddp",
        setup=join_world("ddp", world),
        wrap=WrapDDP(options),
        no_sync=ddp_no_sync,
        shard=shard_loader,
        teardown=leave_process_group,
    )


def ddp_spawn(*, start: Spawn | None = None, **options: Any) -> Strategy:
    """Return ``spawned(ddp(**options), start)``: `ddp` with ranks spawned on this host.

    Example:
        >>> import stratagem as sg
        >>> sg.ddp_spawn(bucket_cap_mb=8) == sg.spawned(sg.ddp(bucket_cap_mb=8))
        True
    """
    return spawned(ddp(**options), start)
