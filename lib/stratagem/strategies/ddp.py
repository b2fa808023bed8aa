"""``ddp()``: DistributedDataParallel on the ranks of a world; ``ddp_spawn()`` = ``spawned(ddp())``.

Every field is named in `ddp` below: the process group's setup and teardown
(`stratagem.process_group`), the DDP wrapper and its ``no_sync`` (here), and the
step, collectives and checkpoints every built-in shares.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import attrs
import torch
from torch.nn.parallel import DistributedDataParallel

from stratagem import checkpoint, collectives, training
from stratagem.arrivals import DEFAULT_TIMEOUT
from stratagem.devices import DeviceSpec, check_device_spec
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.launching import Spawn, in_place, spawned
from stratagem.process_group import DEFAULT_JOIN_TIMEOUT, JoinProcessGroup, leave_process_group
from stratagem.replicas import broadcast_tensors
from stratagem.sharding import shard_loader
from stratagem.strategy import Strategy
from stratagem.validators import a_bool, positive_number

__all__ = [
    "UNWRAPPED_UNDER_DDP",
    "DDPOptions",
    "JoinProcessGroup",
    "WrapDDP",
    "ddp",
    "ddp_no_sync",
    "ddp_spawn",
    "leave_process_group",
]

UNWRAPPED_UNDER_DDP = training.UNWRAPPED_UNDER_DDP

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
    """No-sync field: the wrapper's own ``no_sync``.

    Raises:
        UsageError: ``module`` is not the ``DistributedDataParallel`` that ``wrap`` returned.
    """
    check_context(ctx, "no_sync")
    if not isinstance(module, DistributedDataParallel):
        raise UsageError(
            f"no_sync: 'module' must be the module wrap returned (a DistributedDataParallel), "
            f"got {type(module).__name__}."
        )
    return module.no_sync()


def ddp(
    *,
    device: DeviceSpec = "auto",
    backend: str | None = None,
    timeout: float | timedelta = timedelta(minutes=30),
    arrival_timeout: float = DEFAULT_TIMEOUT,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    broadcast_buffers: bool = True,
    bucket_cap_mb: float | None = None,
) -> Strategy:
    """DistributedDataParallel on the ranks that torchrun or SLURM started (it runs in place).

    For ranks started here, use ``spawned(ddp())`` (alias `ddp_spawn`), the
    same record with a launch field that spawns.

    Args:
        device: ``"auto"`` (``cuda:LOCAL_RANK``, else CPU) or a device.
        backend: ``None`` picks gloo on the CPU and ``"cpu:gloo,cuda:nccl"`` on
            CUDA; or any string ``init_process_group`` takes, device mappings
            included. Without a CPU backend (``"nccl"``), setup adds a gloo
            group for CPU traffic (``ctx.cpu_group``).
        timeout: seconds (or a ``timedelta``) that process-group init and every
            collective wait before failing.
        arrival_timeout: seconds that ``save``, ``load`` and ``barrier`` wait
            for every rank to call them before raising `CollectiveCallError`
            (the mark of a call made on some ranks only).
        find_unused_parameters: passed to ``DistributedDataParallel``.
        gradient_as_bucket_view: passed to ``DistributedDataParallel``.
        static_graph: passed to ``DistributedDataParallel``.
        broadcast_buffers: passed to ``DistributedDataParallel``.
        bucket_cap_mb: passed to ``DistributedDataParallel`` (``None``: its default).
        join_timeout: seconds that setup waits for every rank to join the world;
            a rank that never comes is a `LaunchError` naming it.

    Raises:
        UsageError: an option has the wrong type or value.
    """
    return Strategy(
        name="ddp",
        launch=in_place,
        setup=JoinProcessGroup(
            device=check_device_spec(device),
            backend=backend,
            timeout=timeout,
            arrival_timeout=arrival_timeout,
            join_timeout=join_timeout,
        ),
        wrap=WrapDDP(
            DDPOptions(
                find_unused_parameters=find_unused_parameters,
                gradient_as_bucket_view=gradient_as_bucket_view,
                static_graph=static_graph,
                broadcast_buffers=broadcast_buffers,
                bucket_cap_mb=bucket_cap_mb,
            )
        ),
        step=training.step,
        backward=training.backward,
        update=training.update,
        no_sync=ddp_no_sync,
        reduce=collectives.reduce,
        gather=collectives.gather,
        broadcast=collectives.broadcast,
        barrier=collectives.barrier,
        shard=shard_loader,
        save=checkpoint.save,
        load=checkpoint.load,
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
