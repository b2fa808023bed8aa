"""``ddp()`` and ``ddp_spawn()``: DistributedDataParallel, in place or on spawned local ranks.

``ddp_spawn(**options)`` is ``attrs.evolve(ddp(**options), name="ddp_spawn",
launch=Spawn())``: the launch field is the whole difference.
"""

from __future__ import annotations

import gc
import math
import os
import warnings
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch.distributed import (  # type: ignore[attr-defined]  # exported at run time
    HashStore,
    PrefixStore,
    Store,
    TCPStore,
)
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import TypedDict, Unpack

from stratagem import training
from stratagem.arrivals import DEFAULT_TIMEOUT, Arrivals, check_arrival_timeout
from stratagem.devices import DeviceSpec, check_device_spec, resolve_device
from stratagem.env import Context, Env, check_context, check_env
from stratagem.errors import LaunchError, UsageError, describe
from stratagem.sharding import shard_loader
from stratagem.spawn import MAX_SECONDS, Spawn, spawn_launcher
from stratagem.strategies.single import single_device
from stratagem.strategy import Strategy

__all__ = [
    "DDPArgs",
    "DDPOptions",
    "JoinProcessGroup",
    "WrapDDP",
    "ddp",
    "ddp_no_sync",
    "ddp_spawn",
    "leave_process_group",
]

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


def _to_timedelta(value: float | timedelta) -> timedelta:
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(
            f"'timeout' must be seconds (a number) or a datetime.timedelta (got {describe(value)})."
        )
    if not -MAX_SECONDS <= value <= MAX_SECONDS:  # NaN, infinity: timedelta cannot hold them
        raise UsageError(_timeout_range(f"{value} seconds"))
    return timedelta(seconds=value)


def _timeout_range(shown: str) -> str:
    return (
        f"'timeout' must be positive and at most {MAX_SECONDS} seconds (got {shown}); "
        "a collective that waits longer has hung."
    )


def _positive_timeout(
    instance: object, attribute: attrs.Attribute[timedelta], value: timedelta
) -> None:
    # gloo refuses larger values (a negative count after conversion) deep inside init;
    # the same bound for every backend, as no real collective should wait 11 days.
    if not 0 < value.total_seconds() <= MAX_SECONDS:
        raise UsageError(_timeout_range(f"{value.total_seconds()} seconds"))


def _backend(instance: object, attribute: attrs.Attribute[str | None], value: object) -> None:
    if value is not None and (not isinstance(value, str) or value not in BACKENDS):
        raise UsageError(
            f"'backend' must be None (gloo on CPU, nccl on CUDA) or one of "
            f"{', '.join(map(repr, BACKENDS))} (got {describe(value)})."
        )


@attrs.frozen(kw_only=True)
class JoinProcessGroup:
    """Setup field of a multi-process world: choose the device, join the default process group.

    Every rank connects to the store at ``master_addr:master_port``; rank 0
    hosts it unless a launcher agent already does (``env.agent_store``). A
    world of one uses an in-memory store and needs no port. The store also
    serves the `Arrivals` checks of save, load and barrier, which give up
    after ``arrival_timeout`` seconds.

    Raises:
        UsageError: ``env`` is not an `Env`, or the device is not available.
        LaunchError: a multi-rank world without a port, a process group already
            initialised, or a store that cannot be served or reached.
    """

    device: DeviceSpec = "auto"
    backend: str | None = attrs.field(default=None, validator=_backend)
    timeout: timedelta = attrs.field(
        default=timedelta(minutes=30), converter=_to_timedelta, validator=_positive_timeout
    )
    arrival_timeout: float = attrs.field(default=DEFAULT_TIMEOUT, converter=check_arrival_timeout)

    def __call__(self, env: Env) -> Context:
        check_env(env, "setup")
        if env.world_size > 1 and env.master_port == 0:
            # Port 0 would let rank 0's store pick any port, which the others cannot know.
            raise LaunchError(
                f"setup: a world of {env.world_size} needs a rendezvous port, but "
                f"master_port is 0 ({env.source!r}); set MASTER_PORT, or launch with "
                "ddp_spawn(), which picks one."
            )
        device = resolve_device(self.device, env.local_rank)
        backend = self.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and (device.type != "cuda" or not dist.is_nccl_available()):
            raise UsageError(
                f"setup: backend 'nccl' runs on CUDA devices only, but this rank's device is "
                f"{str(device)!r} (CUDA available: {torch.cuda.is_available()}, NCCL built: "
                f"{dist.is_nccl_available()}); use backend=None (gloo on the CPU) or 'gloo'."
            )
        if dist.is_initialized():
            raise LaunchError(
                "setup: a default process group is already initialised in this process; "
                "call torch.distributed.destroy_process_group() first, or let stratagem own it."
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store: Store
        if env.world_size == 1:
            store = HashStore()
        else:
            hosting = env.rank == 0 and not env.agent_store
            try:
                store = TCPStore(
                    env.master_addr,
                    env.master_port,
                    world_size=env.world_size,
                    is_master=hosting,
                    timeout=self.timeout,
                    wait_for_workers=False,
                )
            except RuntimeError as error:  # DistNetworkError, DistStoreError
                raise LaunchError(_store_failure(env, hosting, error)) from error
        dist.init_process_group(
            backend, store=store, rank=env.rank, world_size=env.world_size, timeout=self.timeout
        )
        # A torchrun agent's store outlives a restart: each attempt signs in under its own prefix.
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        arrivals = Arrivals(PrefixStore(f"attempt_{attempt}", store), timeout=self.arrival_timeout)
        return Context(env=env, device=device, group=dist.group.WORLD, arrivals=arrivals)


def _store_failure(env: Env, hosting: bool, error: RuntimeError) -> str:
    where = f"{env.master_addr}:{env.master_port}"
    if hosting:
        return (
            f"setup: rank 0 could not serve the rendezvous store on port {env.master_port}: "
            f"it is in use or not available ({error}). Set MASTER_PORT to a free port "
            "(under SLURM the default port comes from the job id)."
        )
    return (
        f"setup: rank {env.rank} could not reach the rendezvous store at {where} within "
        f"the timeout ({error}); check MASTER_ADDR/MASTER_PORT and that rank 0 started."
    )


def leave_process_group(ctx: Context) -> None:
    """Teardown field: destroy the process group once nothing uses it any more."""
    check_context(ctx, "teardown")
    # A DDP reducer still alive when a gloo group is destroyed can deadlock: collect first.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _bucket_cap(instance: object, attribute: attrs.Attribute[float | None], value: object) -> None:
    # DDP turns it into a byte count: NaN and infinity would fail there, at wrap, on every rank.
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf
    ):
        raise UsageError(
            f"'bucket_cap_mb' must be None or a positive number of MiB, finite "
            f"(got {describe(value)})."
        )


def _flag(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise UsageError(f"'{attribute.name}' must be True or False (got {describe(value)}).")


@attrs.frozen(kw_only=True)
class DDPOptions:
    """Keyword arguments passed to ``DistributedDataParallel``, validated at construction."""

    find_unused_parameters: bool = attrs.field(default=False, validator=_flag)
    gradient_as_bucket_view: bool = attrs.field(default=False, validator=_flag)
    static_graph: bool = attrs.field(default=False, validator=_flag)
    broadcast_buffers: bool = attrs.field(default=True, validator=_flag)
    bucket_cap_mb: float | None = attrs.field(default=None, validator=_bucket_cap)


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
            _broadcast_buffers(module, ctx)
        with warnings.catch_warnings():
            # torch 2.13 deprecates broadcast_buffers for forward_sync_buffers, which still
            # syncs at init; the old flag keeps its documented meaning on every supported torch.
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            return DistributedDataParallel(
                module,
                device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
                process_group=ctx.group,
                **options,
            )


def _broadcast_buffers(module: torch.nn.Module, ctx: Context) -> None:
    if ctx.world_size > 1:
        with torch.no_grad():
            for buffer in module.buffers():
                dist.broadcast(buffer, src=0, group=ctx.group)


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
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    static_graph: bool = False,
    broadcast_buffers: bool = True,
    bucket_cap_mb: float | None = None,
) -> Strategy:
    """DistributedDataParallel on the ranks that torchrun or SLURM started (it runs in place).

    For ranks started here, use `ddp_spawn`, the same record with a launch
    field that spawns.

    Args:
        device: ``"auto"`` (``cuda:LOCAL_RANK``, else CPU) or a device.
        backend: ``None`` picks gloo on CPU and nccl on CUDA.
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

    Raises:
        UsageError: an option has the wrong type or value.
    """
    return attrs.evolve(
        single_device(),
        name="ddp",
        setup=JoinProcessGroup(
            device=check_device_spec(device),
            backend=backend,
            timeout=timeout,
            arrival_timeout=arrival_timeout,
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
        no_sync=ddp_no_sync,
        shard=shard_loader,
        teardown=leave_process_group,
    )


# Functional syntax on purpose: no class statement in lib/ derives from anything but
# Protocol or an exception, and a TypedDict is a plain dict at run time anyway.
DDPArgs = TypedDict(  # noqa: UP013
    "DDPArgs",
    {
        "device": DeviceSpec,
        "backend": "str | None",
        "timeout": "float | timedelta",
        "arrival_timeout": float,
        "find_unused_parameters": bool,
        "gradient_as_bucket_view": bool,
        "static_graph": bool,
        "broadcast_buffers": bool,
        "bucket_cap_mb": "float | None",
    },
    total=False,
)
"""The keyword arguments of `ddp`, for factories that forward them."""


def ddp_spawn(*, start: Spawn | None = None, **options: Unpack[DDPArgs]) -> Strategy:
    """`ddp` whose ranks are spawned on this host: ``ddp()`` with the launch field substituted.

    Args:
        start: the spawn launcher and its timeouts (default ``Spawn()``).
        **options: the keyword arguments of `ddp`.

    Raises:
        UsageError: ``start`` is not a `Spawn`, or an option is malformed.

    Example:
        >>> import attrs, stratagem as sg
        >>> attrs.evolve(sg.ddp_spawn(), name="ddp", launch=sg.ddp().launch) == sg.ddp()
        True
    """
    return attrs.evolve(ddp(**options), name="ddp_spawn", launch=spawn_launcher(start, "ddp_spawn"))
