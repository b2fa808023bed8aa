"""``allreduce_grads()``: the Horovod way of training, as ``ddp()`` with three fields substituted.

No wrapper around the model. ``wrap`` moves it to the device and gives every
rank rank 0's parameters and buffers; ``update`` averages the gradients over
ranks in fused buckets (optionally cast to 16 bits for the wire) and steps
the optimizer. From the second ``update`` on, the buckets are sent *during*
backward, as Horovod does: the first ``update`` allocates each bucket's
buffer once and puts a post-accumulate-grad hook on the parameters
(`GradientHooks`); a bucket is all-reduced asynchronously as soon as
backward has produced all of its gradients, except the last, which
``update`` sends with a tail of flags (which parameters have a gradient on
any rank, and whether any rank's changed after it was sent), so that the
world agrees on both without another all-reduce; then it waits for all.
``no_sync`` (`pause_hooks`) holds the hooks back, so that accumulation sends
once, after the last micro-batch. If a gradient changed after it was sent
(a second backward without ``no_sync``, a change in place), ``update``
sends them all again, so the result is always that of averaging the
gradients ``update`` finds. Everything else (setup, step, collectives,
sharding, checkpoints, teardown) is ``ddp()``'s own.

``allreduce_grads_spawn(**options)`` is the same record with ``launch=Spawn()``.
"""

from __future__ import annotations

from typing import Unpack

import attrs
import torch

from stratagem import training
from stratagem.env import Context
from stratagem.launching import SpawnVariant
from stratagem.process_group import WorldOptions
from stratagem.replicas import copy_rank0
from stratagem.strategies.allreduce_buckets import COMPRESSIONS, Compression
from stratagem.strategies.allreduce_hooks import average_gradients_overlapped, pause_hooks
from stratagem.strategies.ddp import ddp
from stratagem.strategy import Strategy
from stratagem.validators import choice, positive_number

__all__ = ["AllreduceThenStep", "allreduce_grads", "allreduce_grads_spawn", "broadcast_module"]


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
    copy_rank0(module, ctx)
    return module


_BUCKET_MB = positive_number(
    "allreduce_grads({name}=...)",
    unit="MiB",
    finite=False,  # infinity: one bucket per dtype after the first
    hint="; 25.0 is DDP's default, smaller buckets only add calls",
)
_COMPRESSION = choice("allreduce_grads({name}=...)", COMPRESSIONS, optional="None (full precision)")


@attrs.frozen(kw_only=True)
class AllreduceThenStep:
    """Update field: average gradients over ranks, then ``training.update``.

    Averaging is `average_gradients_overlapped`: from the second call on, it
    sends the last bucket and waits for those the module's gradient hooks sent
    during backward. The optimizer then steps on gradients that are views of
    the buckets' buffers (full-precision wire), as DDP's with
    ``gradient_as_bucket_view``.

    Attributes:
        bucket_mb: most MiB fused into one all-reduce, per dtype.
        compression: ``"bf16"``, ``"fp16"`` or ``None``, the gradients' wire precision.
    """

    bucket_mb: float = attrs.field(default=25.0, validator=_BUCKET_MB)
    compression: Compression | None = attrs.field(default=None, validator=_COMPRESSION)

    def __call__(
        self, optimizer: torch.optim.Optimizer, module: torch.nn.Module, ctx: Context
    ) -> None:
        last_optimizer, last_module = training.TRUSTED_PAIR  # training.is_trusted, inline
        if not (
            last_optimizer() is optimizer and last_module() is module and ctx.__class__ is Context
        ):
            # Before any collective, so that every rank fails alike.
            training.check_update(optimizer, module, ctx)
            training.check_module(module, "update")
        # is_distributed(ctx), without its two calls: a world of one has nothing to average.
        if ctx.group is not None and ctx.env.world_size > 1:
            average_gradients_overlapped(
                module, ctx, bucket_mb=self.bucket_mb, compression=self.compression
            )
        optimizer.step()  # training.update, whose checks have passed
        optimizer.zero_grad(set_to_none=True)


def allreduce_grads(
    *,
    bucket_mb: float = 25.0,
    compression: Compression | None = None,
    **world: Unpack[WorldOptions],
) -> Strategy:
    """Train the Horovod way: no wrapper, gradient hooks all-reduce buckets during backward.

    Its record differs from `ddp`'s in ``wrap``, ``no_sync`` and ``update``
    (``step`` is the same plain ``training.step``: neither needs a step of its
    own). The first ``update`` attaches post-accumulate-grad hooks to the
    module's parameters (`GradientHooks`); from then on a bucket is sent as
    soon as backward has produced its gradients (the last by ``update``, with
    the flags that replace a separate all-reduce), ``no_sync`` holds the hooks
    back, and ``update`` waits for the buckets before the step. The buckets'
    buffers are allocated once and kept, as DDP keeps its own. It can halve
    the bytes with ``compression``. It runs in place, in ranks that torchrun or
    SLURM started; `allreduce_grads_spawn` starts them here.

    Args:
        bucket_mb: most MiB of gradients fused into one all-reduce, per dtype
            (the first bucket in backward order closes at `FIRST_BUCKET_MB`).
        compression: ``"bf16"`` or ``"fp16"`` sends 32/64-bit gradients as
            16-bit values; ``None`` sends them as they are.
        **world: how the ranks join their world (`WorldOptions`), as for `ddp`.

    Raises:
        UsageError: an option has the wrong type or value.

    Example:
        >>> import stratagem as sg
        >>> sg.allreduce_grads(bucket_mb=4, compression="bf16").update
        AllreduceThenStep(bucket_mb=4, compression='bf16')
    """
    return attrs.evolve(
        ddp(**world),
        name="allreduce_grads",
        wrap=broadcast_module,
        update=AllreduceThenStep(bucket_mb=bucket_mb, compression=compression),
        no_sync=pause_hooks,
    )


allreduce_grads_spawn = SpawnVariant(allreduce_grads)
"""``spawned(allreduce_grads(**options), start)``: ranks spawned on this host."""
