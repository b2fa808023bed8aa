"""The buckets `allreduce_grads` averages gradients in: planned, filled and sent.

`average_gradients` is the plain path: after backward, flatten every
gradient into fresh buckets, all-reduce them, copy back. `backward_buckets`
plans the buckets of the overlapped path in backward's order, and `Bucket`
is one of them with its buffer allocated once, reused every step (filling a
fresh buffer each step costs as much as the copy itself: page faults).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

from stratagem import training
from stratagem.collectives import is_distributed, reduced_values
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.replicas import MB, buckets, flatten, unflatten

__all__ = [
    "COMPRESSIONS",
    "FIRST_BUCKET_MB",
    "Bucket",
    "Compression",
    "average_gradients",
    "backward_buckets",
    "check_dense",
    "make_buckets",
]

Compression = Literal["bf16", "fp16"]
COMPRESSIONS: tuple[Compression, ...] = ("bf16", "fp16")
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_dense(params: Sequence[torch.Tensor]) -> None:
    """Raise `UsageError` on the first sparse gradient: buckets are dense."""
    for param in params:
        if param.grad is not None and param.grad.is_sparse:
            raise UsageError(
                f"update: a parameter of shape {tuple(param.shape)} has a sparse gradient, "
                "which allreduce_grads() cannot bucket; use dense gradients (e.g. "
                "nn.Embedding(sparse=False)) or ddp()."
            )


def _on_wire(dtype: torch.dtype, wire: torch.dtype | None) -> torch.dtype:
    small = not dtype.is_floating_point or dtype.itemsize <= 2  # nothing to gain
    return dtype if wire is None or small else wire


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
    check_dense(params)
    missing = [index for index, param in enumerate(params) if param.grad is None]
    # Zeros where a rank has no gradient: also where the mean lands, if another rank has one.
    grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    # Which parameters have a gradient on any rank (MAX of 0/1 flags), sent alongside the buckets.
    mine = [int(p.grad is not None) for p in params]
    present = torch.tensor(mine, dtype=torch.uint8).to(ctx.device)
    present_work = dist.all_reduce(present, op=dist.ReduceOp.MAX, group=ctx.group, async_op=True)
    wire = None if compression is None else WIRE_DTYPES[compression]
    pending = []
    with torch.no_grad():
        for bucket in buckets(grads, bucket_mb * MB):
            members = [grads[i] for i in bucket]
            flat = flatten(members)
            # Divide first, as DDP's default hook does: a 16-bit sum then overflows only where
            # the mean itself would.
            flat.div_(ctx.world_size)
            sent = flat.to(_on_wire(flat.dtype, wire))
            work = dist.all_reduce(sent, group=ctx.group, async_op=True)  # overlaps next flatten
            pending.append((members, flat, sent, work))
        for members, flat, sent, work in pending:
            work.wait()
            if sent is not flat:
                flat.copy_(sent)
            torch._foreach_copy_(members, unflatten(flat, members))
    present_work.wait()
    anywhere = reduced_values(present, lambda: mine)
    for index in missing:
        if anywhere[index]:
            params[index].grad = grads[index]


FIRST_BUCKET_MB = 1.0
"""The first bucket in backward order closes once it holds this much (DDP's first bucket too)."""


def backward_buckets(params: list[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Plan the buckets of ``params`` in the order backward produces their gradients.

    Parameters are taken last to first (backward's order for a module that
    runs its children in order), grouped by device and dtype into runs of at
    most ``bucket_mb`` MiB, a larger parameter alone; the first bucket of each
    group closes once it holds `FIRST_BUCKET_MB`, so that the first
    all-reduce starts early, as DDP's does. Buckets are listed in the order
    their first member comes. The plan depends only on shapes and dtypes:
    every rank makes the same one.
    """
    last_first = reversed(range(len(params)))
    first = min(FIRST_BUCKET_MB, bucket_mb) * MB
    plan = buckets(params, bucket_mb * MB, order=last_first, first_bytes=first)
    return sorted(plan, key=lambda bucket: -bucket[0])


@attrs.define(eq=False)
class Bucket:
    """One bucket: a buffer allocated once, its members' slices, and what is in flight.

    Attributes:
        indices: its parameters, by index into the list the plan was made of.
        flat: what travels, in the wire dtype: the members end to end, then ``flags``.
        views: each member's slice of ``flat``, shaped like it.
        flags: a tail of ``flat`` for 0/1 flags (only the bucket sent last has one), or None.
        shared: whether ``flat`` has the gradients' dtype, so a view can become the gradient.
        grads: the gradients loaded this step (None where this rank had none).
        versions: their in-place counters when loaded: a later change shows.
        work: the all-reduce carrying ``flat``, or None while it is not sent.
    """

    indices: list[int]
    flat: torch.Tensor
    views: list[torch.Tensor]
    flags: torch.Tensor | None
    shared: bool
    grads: list[torch.Tensor | None] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    work: Any = None  # dist.Work

    def load(self, grads: list[torch.Tensor | None], world_size: int) -> None:
        """Fill the buffer with ``grads`` over ``world_size`` (zeros for None), one pass each."""
        with torch.no_grad():
            for grad, view in zip(grads, self.views, strict=True):
                if grad is None:
                    view.zero_()
                else:
                    # Divide first, as DDP's default hook does: a 16-bit sum then overflows
                    # only where the mean would. Into a 16-bit view, the quotient is rounded
                    # once, as flat.div_(n).to(wire) rounds it: the same bits.
                    torch.div(grad, world_size, out=view)
        self.grads = grads
        self.versions = [-1 if g is None else g._version for g in grads]  # noqa: SLF001

    def send(self, group: Any) -> None:
        self.work = dist.all_reduce(self.flat, group=group, async_op=True)

    def reset(self) -> None:
        self.grads, self.versions, self.work = [], [], None


def make_buckets(
    params: list[torch.Tensor], plan: list[list[int]], wire: torch.dtype | None
) -> list[Bucket]:
    """Allocate a `Bucket` per bucket of ``plan``; the last gets a flag per parameter, plus one."""
    made = []
    for number, indices in enumerate(plan):
        members = [params[i] for i in indices]
        dtype = _on_wire(members[0].dtype, wire)
        tail = len(params) + 1 if number == len(plan) - 1 else 0
        size = sum(m.numel() for m in members)
        flat = torch.empty(size + tail, dtype=dtype, device=members[0].device)
        # narrow, not split_with_sizes: a split's pieces refuse in-place ops with a grad operand.
        views, offset = [], 0
        for member in members:
            views.append(flat.narrow(0, offset, member.numel()).view(member.shape))
            offset += member.numel()
        flags = flat.narrow(0, size, tail) if tail else None
        made.append(Bucket(indices, flat, views, flags, shared=dtype == members[0].dtype))
    return made
