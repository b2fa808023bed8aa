"""How `allreduce_grads` averages gradients: after backward, or bucket by bucket during it.

`average_gradients` all-reduces every gradient in fused buckets (optionally
on a 16-bit wire) after backward. `GradientHooks` sends those buckets as
backward produces them, from post-accumulate-grad hooks; `pause_hooks` (the
``no_sync`` field) holds them back; `average_gradients_overlapped` waits for
what they sent, and falls back to `average_gradients` when a gradient changed
after it was sent.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist

from stratagem import training
from stratagem.collectives import is_distributed
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.replicas import (
    MB,
    buckets,
    flatten,
    unflatten,
)

__all__ = [
    "COMPRESSIONS",
    "FIRST_BUCKET_MB",
    "Compression",
    "GradientHooks",
    "average_gradients",
    "average_gradients_overlapped",
    "backward_buckets",
    "pause_hooks",
]

Compression = Literal["bf16", "fp16"]
COMPRESSIONS: tuple[Compression, ...] = ("bf16", "fp16")
_WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    cap, first = bucket_mb * MB, min(FIRST_BUCKET_MB, bucket_mb) * MB
    done: list[list[int]] = []
    filling: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    closed: set[tuple[torch.device, torch.dtype]] = set()
    for index in reversed(range(len(params))):
        tensor = params[index]
        key = (tensor.device, tensor.dtype)
        members = filling.setdefault(key, [])
        if members and sizes[key] + tensor.nbytes > cap:
            done.append(members.copy())
            members.clear()
            sizes[key] = 0
            closed.add(key)
        members.append(index)
        sizes[key] = sizes.get(key, 0) + tensor.nbytes
        if key not in closed and sizes[key] >= first:
            done.append(members.copy())
            members.clear()
            sizes[key] = 0
            closed.add(key)
    plan = done + [members for members in filling.values() if members]
    return sorted(plan, key=lambda bucket: -bucket[0])


@attrs.define(eq=False)
class _Sent:
    """One bucket in flight: what it holds, as sent, and the all-reduce carrying it."""

    indices: list[int]
    members: list[torch.Tensor]  # the gradients flattened into it (zeros where a rank had none)
    versions: list[int]  # their version counters when sent: a later in-place change shows
    flat: torch.Tensor
    sent: torch.Tensor  # flat, or its 16-bit copy on the wire
    work: Any  # dist.Work


@attrs.define(eq=False)
class GradientHooks:
    """Per-module overlap state: hooks that all-reduce buckets as backward produces them.

    `AllreduceThenStep` makes one on its first call (`attach`) and keeps it
    with the module (a weak mapping: it goes when the module goes). Buckets
    are sent strictly in plan order, a bucket only after the ones before it,
    so every rank issues the same all-reduces in the same order whatever order
    its gradients arrive in, and whichever bucket a rank's backward did not
    complete (a parameter without a gradient there) is sent by `finish` in
    ``update``. Each wait is bounded by the process group's timeout (the
    strategy's ``timeout``).

    Attributes:
        params: the module's parameters that require grad, in module order.
        plan: `backward_buckets` of ``params``.
        key: what the hooks were made for (bucket size, compression, group).
        paused: how many `pause_hooks` contexts are open; while any is, hooks send nothing.
    """

    params: list[torch.Tensor]
    plan: list[list[int]]
    key: tuple[float, Compression | None, Any]
    world_size: int
    group: Any
    wire: torch.dtype | None
    handles: list[Any] = attrs.field(factory=list)
    bucket_of: dict[int, int] = attrs.field(factory=dict)
    ready: list[set[int]] = attrs.field(factory=list)
    sent: list[_Sent] = attrs.field(factory=list)
    paused: int = 0

    def __attrs_post_init__(self) -> None:
        self.bucket_of = {i: b for b, bucket in enumerate(self.plan) for i in bucket}
        self.ready = [set() for _ in self.plan]

    @classmethod
    def attach(
        cls,
        params: list[torch.Tensor],
        ctx: Context,
        *,
        bucket_mb: float,
        compression: Compression | None,
    ) -> GradientHooks:
        """Plan the buckets of ``params`` and hook every one of them."""
        hooks = cls(
            params=params,
            plan=backward_buckets(params, bucket_mb),
            key=(bucket_mb, compression, ctx.group),
            world_size=ctx.world_size,
            group=ctx.group,
            wire=None if compression is None else _WIRE_DTYPES[compression],
        )
        for index, param in enumerate(params):
            register = param.register_post_accumulate_grad_hook
            hooks.handles.append(register(hooks.hook(index)))  # type: ignore[no-untyped-call]
        return hooks

    def hook(self, index: int) -> Any:
        def on_gradient(param: torch.Tensor) -> None:
            # Not ours if the tensor is another (a copy carries no hooks, but be sure); nothing
            # to send to once the world is gone (a module trained on after teardown).
            if param is self.params[index] and not self.paused and dist.is_initialized():
                self.arrived(index)

        return on_gradient

    def arrived(self, index: int) -> None:
        """Parameter ``index`` has its gradient for this backward: send what is complete."""
        bucket = self.bucket_of[index]
        if bucket < len(self.sent):
            return  # sent already: `finish` sees the gradient changed and sends again
        self.ready[bucket].add(index)
        while len(self.sent) < len(self.plan):
            upcoming = len(self.sent)
            if len(self.ready[upcoming]) < len(self.plan[upcoming]):
                break
            grads = [self.params[i].grad for i in self.plan[upcoming]]
            if any(g is None or g.is_sparse for g in grads):
                break  # `finish` sends it, or raises on the sparse gradient
            self.send(self.plan[upcoming], [g for g in grads if g is not None])

    def send(self, indices: list[int], members: list[torch.Tensor]) -> None:
        with torch.no_grad():
            flat = flatten(members)
            # Divide first, as DDP's default hook does: a 16-bit sum then overflows only where
            # the mean itself would.
            flat.div_(self.world_size)
            small = not flat.is_floating_point() or flat.element_size() <= 2  # nothing to gain
            wire = flat if self.wire is None or small else flat.to(self.wire)
            work = dist.all_reduce(wire, group=self.group, async_op=True)
        versions = [m._version for m in members]  # noqa: SLF001  # torch's in-place counter
        self.sent.append(_Sent(indices, members, versions, flat, wire, work))

    def finish(self, module: torch.nn.Module, ctx: Context) -> None:
        """Send the buckets backward did not, wait for all, and set the averaged gradients."""
        try:
            _check_dense(self.params)
        except UsageError:
            self.drain()  # every rank sent the same buckets: wait, and start the next step clean
            raise
        missing: list[int] = []
        for unsent in self.plan[len(self.sent) :]:
            members = []
            for index in unsent:
                grad = self.params[index].grad
                if grad is None:
                    missing.append(index)
                    grad = torch.zeros_like(self.params[index])  # where the mean lands, if any
                members.append(grad)
            self.send(unsent, members)
        absent = set(missing)
        changed = any(
            (self.params[i].grad is not None)
            if i in absent
            else (self.params[i].grad is not m or m._version != v)  # noqa: SLF001
            for sent in self.sent
            for i, m, v in zip(sent.indices, sent.members, sent.versions, strict=True)
        )
        # Which parameters have a gradient on any rank, and whether any rank's changed after it
        # was sent (MAX of 0/1 flags), after the buckets: the same order on every rank.
        flags = [p.grad is not None for p in self.params] + [changed]
        present = torch.tensor(flags, dtype=torch.uint8).to(ctx.device)
        present_work = dist.all_reduce(
            present, op=dist.ReduceOp.MAX, group=self.group, async_op=True
        )
        sent, self.sent = self.sent, []
        self.ready = [set() for _ in self.plan]
        for bucket in sent:
            bucket.work.wait()
        present_work.wait()
        anywhere = present.tolist()
        if anywhere[-1]:  # some rank's gradients are not what it sent: average them again
            average_gradients(module, ctx, bucket_mb=self.key[0], compression=self.key[1])
            return
        with torch.no_grad():
            for bucket in sent:
                if bucket.sent is not bucket.flat:
                    bucket.flat.copy_(bucket.sent)
                torch._foreach_copy_(bucket.members, unflatten(bucket.flat, bucket.members))
        for bucket in sent:
            for index, member in zip(bucket.indices, bucket.members, strict=True):
                if index in absent and anywhere[index]:
                    self.params[index].grad = member

    def drain(self) -> None:
        """Wait for whatever is in flight (every rank sent it) and forget it."""
        sent, self.sent = self.sent, []
        self.ready = [set() for _ in self.plan]
        for bucket in sent:
            bucket.work.wait()

    def detach(self) -> None:
        """`drain`, then remove the hooks."""
        self.drain()
        for handle in self.handles:
            handle.remove()
        self.handles = []


_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, GradientHooks] = weakref.WeakKeyDictionary()


def _check_dense(params: list[torch.Tensor]) -> None:
    for param in params:
        if param.grad is not None and param.grad.is_sparse:
            raise UsageError(
                f"update: a parameter of shape {tuple(param.shape)} has a sparse gradient, "
                "which allreduce_grads() cannot bucket; use dense gradients (e.g. "
                "nn.Embedding(sparse=False)) or ddp()."
            )


def average_gradients_overlapped(
    module: torch.nn.Module,
    ctx: Context,
    *,
    bucket_mb: float = 25.0,
    compression: Compression | None = None,
) -> None:
    """`average_gradients`, finishing what the module's `GradientHooks` sent during backward.

    The first call (or one with other options, or after the module's
    parameters changed) averages after backward and hooks the module, so
    that from the next backward on buckets are sent as their gradients
    arrive. The result equals `average_gradients` on the gradients found here.

    Raises:
        UsageError: ``module`` is not a module, or a gradient is sparse.
    """
    training.check_module(module, "update")
    if not is_distributed(check_context(ctx, "update")):
        return
    owner = training.original_module(module)
    params: list[torch.Tensor] = [p for p in owner.parameters() if p.requires_grad]
    hooks = _HOOKS.get(owner)
    fits = hooks is not None and hooks.key == (bucket_mb, compression, ctx.group)
    if hooks is not None and fits and len(hooks.params) == len(params):
        fits = all(a is b for a, b in zip(hooks.params, params, strict=True))
    if hooks is not None and fits:
        hooks.finish(module, ctx)
        return
    if hooks is not None:
        hooks.detach()
        del _HOOKS[owner]
    average_gradients(module, ctx, bucket_mb=bucket_mb, compression=compression)
    if params:
        _HOOKS[owner] = GradientHooks.attach(
            params, ctx, bucket_mb=bucket_mb, compression=compression
        )


def pause_hooks(module: torch.nn.Module, ctx: Context) -> contextlib.AbstractContextManager[None]:
    """No-sync field: hold back the gradient hooks, so that backward sends nothing.

    Gradients of the backward passes inside accumulate locally; the first
    backward outside sends them (or ``update`` does), as ``ddp()``'s
    ``no_sync`` does. Before the first ``update`` there are no hooks, and
    nothing to hold back.

    Raises:
        UsageError: ``module`` is not a module, or ``ctx`` not a `Context`.
    """
    training.check_module(module, "no_sync")
    check_context(ctx, "no_sync")
    return _paused(training.original_module(module))


@contextlib.contextmanager
def _paused(owner: torch.nn.Module) -> Iterator[None]:
    hooks = _HOOKS.get(owner)
    if hooks is None:
        yield
        return
    hooks.paused += 1
    try:
        yield
    finally:
        hooks.paused -= 1
