"""``allreduce_grads()``: the Horovod way of training, as ``ddp()`` with four fields substituted.

No wrapper around the model. ``wrap`` moves it to the device and gives every
rank rank 0's parameters and buffers; ``backward`` only accumulates local
gradients; ``update`` all-reduces them in fused buckets (optionally cast to
16 bits for the wire), averages, and steps the optimizer. ``no_sync`` is
``training.no_sync``, the empty context of a single device: backward never
communicates here, so several backward passes before one ``update`` already
accumulate locally, and the one all-reduce in ``update`` covers them all.
Setup, collectives, sharding, checkpoints and teardown are ``ddp()``'s own
functions.

``allreduce_grads_spawn(**options)`` is the same record with ``launch=Spawn()``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

from stratagem import checkpoint, collectives, training
from stratagem.arrivals import DEFAULT_TIMEOUT
from stratagem.collectives import is_distributed
from stratagem.devices import DeviceSpec, check_device_spec
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.launching import Spawn, in_place, spawned
from stratagem.process_group import DEFAULT_JOIN_TIMEOUT, JoinProcessGroup, leave_process_group
from stratagem.replicas import (
    MB,
    broadcast_optimizer_state,
    broadcast_tensors,
    buckets,
    check_same_layout,
    flatten,
    unflatten,
)
from stratagem.sharding import shard_loader
from stratagem.strategy import Strategy
from stratagem.validators import choice, positive_number

__all__ = [
    "COMPRESSIONS",
    "AllreduceThenStep",
    "Compression",
    "allreduce_grads",
    "allreduce_grads_spawn",
    "average_gradients",
    "broadcast_module",
    "broadcast_optimizer_state",
    "check_same_layout",
]

Compression = Literal["bf16", "fp16"]
COMPRESSIONS: tuple[Compression, ...] = ("bf16", "fp16")
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def broadcast_module(module: torch.nn.Module, ctx: Context) -> torch.nn.Module:
    """Wrap field: move ``module`` to the device and copy rank 0's parameters and buffers to all.

    Returns the module itself, not a wrapper: ranks that built it from
    different random seeds leave with identical weights.

    Raises:
        UsageError: ``module`` is not a module, or ranks' modules differ in
            parameter or buffer names, shapes, dtypes or ``requires_grad``
            (raised on every rank).
    """
    module = training.to_device(module, ctx)
    if is_distributed(ctx):
        check_same_layout(module, ctx)
        broadcast_tensors([*module.parameters(), *module.buffers()], ctx, src=0)
    return module


def average_gradients(
    module: torch.nn.Module,
    ctx: Context,
    *,
    bucket_mb: float = 25.0,
    compression: Compression | None = None,
) -> None:
    """Replace every rank's gradients by their mean over ranks, in buckets of ``bucket_mb``.

    A parameter whose gradient is ``None`` on some ranks counts as zero there;
    it stays ``None`` only when it is ``None`` on every rank (one small extra
    all-reduce of a presence mask per call, as DDP does for unused
    parameters), so an optimizer skips exactly the parameters that a single
    process on the whole batch would skip.

    Args:
        module: the module ``wrap`` returned, the same layout on every rank.
        ctx: the joined world; on a world of one nothing happens.
        bucket_mb: most MiB fused into one all-reduce, per dtype.
        compression: ``"bf16"`` or ``"fp16"`` to send 32- and 64-bit
            gradients as 16-bit values (cast back on arrival), or ``None``.

    Raises:
        UsageError: ``module`` is not a module, or a gradient is sparse.
    """
    training.check_module(module, "update")
    if not is_distributed(check_context(ctx, "update")):
        return
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return
    grads, missing = [], []
    for index, param in enumerate(params):
        grad = param.grad
        if grad is None:
            missing.append(index)
            grad = torch.zeros_like(param)  # also where the mean lands, if another rank has one
        elif grad.is_sparse:
            raise UsageError(
                f"update: a parameter of shape {tuple(param.shape)} has a sparse gradient, "
                "which allreduce_grads() cannot bucket; use dense gradients (e.g. "
                "nn.Embedding(sparse=False)) or ddp()."
            )
        grads.append(grad)
    # Which parameters have a gradient on any rank (MAX of 0/1 flags), sent alongside the buckets.
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8).to(ctx.device)
    present_work = dist.all_reduce(present, op=dist.ReduceOp.MAX, group=ctx.group, async_op=True)
    wire = None if compression is None else _WIRE_DTYPES[compression]
    pending = []
    with torch.no_grad():
        for bucket in buckets(grads, bucket_mb * MB):
            members = [grads[i] for i in bucket]
            flat = flatten(members)
            # Divide first, as DDP's default hook does: a 16-bit sum then overflows only where
            # the mean itself would.
            flat.div_(ctx.world_size)
            small = not flat.is_floating_point() or flat.element_size() <= 2  # nothing to gain
            sent = flat if wire is None or small else flat.to(wire)
            work = dist.all_reduce(sent, group=ctx.group, async_op=True)  # overlaps next flatten
            pending.append((members, flat, sent, work))
        for members, flat, sent, work in pending:
            work.wait()
            if sent is not flat:
                flat.copy_(sent)
            torch._foreach_copy_(members, unflatten(flat, members))
    present_work.wait()
    anywhere = present.tolist()
    for index in missing:
        if anywhere[index]:
            params[index].grad = grads[index]


_BUCKET_MB = positive_number(
    "allreduce_grads({name}=...)",
    unit="MiB",
    finite=False,  # infinity: one bucket per dtype
    hint="; 25.0 is DDP's default, smaller buckets only add calls",
)
_COMPRESSION = choice("allreduce_grads({name}=...)", COMPRESSIONS, optional="None (full precision)")


@attrs.frozen(kw_only=True)
class AllreduceThenStep:
    """Update field: average gradients over ranks (`average_gradients`), then ``training.update``.

    Attributes:
        bucket_mb: most MiB fused into one all-reduce, per dtype.
        compression: ``"bf16"``, ``"fp16"`` or ``None``, the gradients' wire precision.
    """

    bucket_mb: float = attrs.field(default=25.0, validator=_BUCKET_MB)
    compression: Compression | None = attrs.field(default=None, validator=_COMPRESSION)

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context
    ) -> None:
        training.check_optimizer(optimizer, "update")  # before any collective: fail alike
        average_gradients(module, ctx, bucket_mb=self.bucket_mb, compression=self.compression)
        training.update(optimizer, module, ctx)


def allreduce_grads(
    *,
    bucket_mb: float = 25.0,
    compression: Compression | None = None,
    device: DeviceSpec = "auto",
    backend: str | None = None,
    timeout: float | timedelta = timedelta(minutes=30),
    arrival_timeout: float = DEFAULT_TIMEOUT,
    join_timeout: float = DEFAULT_JOIN_TIMEOUT,
) -> Strategy:
    """Train the Horovod way: no wrapper, gradients all-reduced in buckets just before the step.

    Its record differs from `ddp`'s in ``wrap``, ``no_sync`` and ``update``
    (``step`` is the same plain ``training.step``: neither needs a step of its
    own). DDP overlaps communication with backward; this strategy
    communicates after it, in fewer, larger calls, and can halve the bytes
    with ``compression``. It runs in place, in ranks that torchrun or SLURM
    started; `allreduce_grads_spawn` starts them here.

    Args:
        bucket_mb: most MiB of gradients fused into one all-reduce, per dtype.
        compression: ``"bf16"`` or ``"fp16"`` sends 32/64-bit gradients as
            16-bit values; ``None`` sends them as they are.
        device: ``"auto"`` (``cuda:LOCAL_RANK``, else CPU) or a device.
        backend: ``None`` picks gloo on CPU and nccl on CUDA.
        timeout: seconds (or a ``timedelta``) that process-group init and every
            collective wait before failing.
        arrival_timeout: seconds that ``save``, ``load`` and ``barrier`` wait for every
            rank to call them (see `ddp`).
        join_timeout: seconds that setup waits for every rank to join the world;
            a rank that never comes is a `LaunchError` naming it.

    Raises:
        UsageError: an option has the wrong type or value.

    Example:
        >>> import stratagem as sg
        >>> sg.allreduce_grads(bucket_mb=4, compression="bf16").update
        AllreduceThenStep(bucket_mb=4, compression='bf16')
    """
    return Strategy(
        name="allreduce_grads",
        launch=in_place,
        setup=JoinProcessGroup(
            device=check_device_spec(device),
            backend=backend,
            timeout=timeout,
            arrival_timeout=arrival_timeout,
            join_timeout=join_timeout,
        ),
        wrap=broadcast_module,
        step=training.step,
        backward=training.backward,
        update=AllreduceThenStep(bucket_mb=bucket_mb, compression=compression),
        no_sync=training.no_sync,
        reduce=collectives.reduce,
        gather=collectives.gather,
        broadcast=collectives.broadcast,
        barrier=collectives.barrier,
        shard=shard_loader,
        save=checkpoint.save,
        load=checkpoint.load,
        teardown=leave_process_group,
    )


def allreduce_grads_spawn(*, start: Spawn | None = None, **options: Any) -> Strategy:
    """Return ``spawned(allreduce_grads(**options), start)``: ranks spawned on this host.

    Example:
        >>> import stratagem as sg
        >>> sg.allreduce_grads_spawn(bucket_mb=8) == sg.spawned(sg.allreduce_grads(bucket_mb=8))
        True
    """
    return spawned(allreduce_grads(**options), start)
