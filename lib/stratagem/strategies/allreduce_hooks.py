"""How `allreduce_grads` overlaps its all-reduces with backward: gradient hooks.

`GradientHooks` sends the buckets (`allreduce_buckets`) as backward produces
them, from post-accumulate-grad hooks; `pause_hooks` (the ``no_sync`` field)
holds them back; `average_gradients_overlapped` sends the last bucket, waits
for all, and falls back to `average_gradients` when a gradient changed after
it was sent.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch
import torch.distributed as dist

from stratagem import training
from stratagem.collectives import is_distributed, reduced_values
from stratagem.env import Context, check_context
from stratagem.errors import UsageError
from stratagem.strategies.allreduce_buckets import (
    WIRE_DTYPES,
    Bucket,
    Compression,
    average_gradients,
    backward_buckets,
    check_dense,
    make_buckets,
)

__all__ = ["GradientHooks", "average_gradients_overlapped", "pause_hooks"]


@attrs.define(eq=False)
class GradientHooks:
    """Per-module overlap state: hooks that all-reduce buckets as backward produces them.

    `average_gradients_overlapped` makes one on its first call (`attach`) and
    keeps it with the module (a weak mapping: it goes when the module goes).
    Buckets are sent strictly in plan order, a bucket only after the ones
    before it, so every rank issues the same all-reduces in the same order
    whatever order its gradients arrive in. The hooks send every bucket but
    the last; `finish` (in ``update``) sends the rest, the last with a tail of
    flags: which parameters have a gradient, and whether one changed after it
    was sent. So the world agrees on both without an all-reduce of its own.
    Each wait is bounded by the process group's timeout (the strategy's
    ``timeout``).

    After ``update`` a gradient is a view of its bucket's buffer (unless the
    wire is 16-bit), as with DDP's ``gradient_as_bucket_view``: no copy back,
    and no second copy of the gradients alive in the optimizer step; the next
    step's average overwrites it (clone a gradient to keep it past a step). A
    gradient found to be such a view when its bucket is filled again (zeroed
    rather than set to None) is cloned first: the buffer in flight is never a
    gradient. The price of keeping the buffers is DDP's: during backward they
    are alive beside the gradients (+0.5 MiB at the peak of
    ``benchmarks/memory.py``'s MLP, up to the gradients' size in general).

    Attributes:
        params: the module's parameters that require grad, in module order.
        plan: `backward_buckets` of ``params``.
        bucket_mb: the bucket size the plan was made for.
        compression: the wire the buffers were made for.
        world_size: the ranks each gradient is divided by.
        group: the process group the buckets are sent over.
        buckets: a `Bucket` per bucket of the plan, buffers allocated once.
        sent: how many buckets (the first of the plan) are in flight.
        paused: how many `pause_hooks` contexts are open; while any is, hooks send nothing.
    """

    params: list[torch.Tensor]
    plan: list[list[int]]
    bucket_mb: float
    compression: Compression | None
    world_size: int
    group: Any
    buckets: list[Bucket]
    handles: list[Any] = attrs.field(factory=list)
    bucket_of: dict[int, int] = attrs.field(factory=dict)
    ready: list[set[int]] = attrs.field(factory=list)
    sent: int = 0
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
        """Plan the buckets of ``params``, allocate them, and hook their parameters."""
        plan = backward_buckets(params, bucket_mb)
        wire = None if compression is None else WIRE_DTYPES[compression]
        hooks = cls(
            params=params,
            plan=plan,
            bucket_mb=bucket_mb,
            compression=compression,
            world_size=ctx.world_size,
            group=ctx.group,
            buckets=make_buckets(params, plan, wire),
        )
        for index in [i for bucket in plan[:-1] for i in bucket]:  # the last waits for update
            register = params[index].register_post_accumulate_grad_hook
            hooks.handles.append(register(hooks.hook(index)))  # type: ignore[no-untyped-call]
        return hooks

    def made_for(self, bucket_mb: float, compression: Compression | None, group: Any) -> bool:
        """Whether these hooks were made for these options and this group."""
        return (self.bucket_mb, self.compression, self.group) == (bucket_mb, compression, group)

    def hook(self, index: int) -> Any:
        # Held weakly: a parameter holds its hooks where the garbage collector cannot look, so
        # a strong reference back to these hooks (and through them to the parameters) would
        # keep every wrapped model alive after the user dropped it.
        held = weakref.ref(self)

        def on_gradient(param: torch.Tensor) -> None:
            hooks = held()
            # Not ours if the tensor is another (a copy carries no hooks, but be sure); nothing
            # to send to once the world is gone (a module trained on after teardown).
            if hooks is None or param is not hooks.params[index] or hooks.paused:
                return
            if dist.is_initialized():
                hooks.arrived(index)

        return on_gradient

    def arrived(self, index: int) -> None:
        """Parameter ``index`` has its gradient for this backward: send what is complete."""
        bucket = self.bucket_of[index]
        if bucket < self.sent:
            return  # sent already: `finish` sees the gradient changed and averages again
        self.ready[bucket].add(index)
        last = len(self.plan) - 1
        while self.sent < last and len(self.ready[self.sent]) == len(self.plan[self.sent]):
            upcoming = self.buckets[self.sent]
            if any(self.params[i].grad is None for i in upcoming.indices):
                break  # `finish` sends it
            if any(self.params[i].grad.is_sparse for i in upcoming.indices):  # type: ignore[union-attr]
                break  # `finish` raises
            self.load(upcoming)
            upcoming.send(self.group)
            self.sent += 1

    def load(self, bucket: Bucket) -> None:
        grads = []
        for index in bucket.indices:
            param = self.params[index]
            grad = param.grad
            if grad is not None and grad._base is bucket.flat:  # noqa: SLF001  # last average
                grad = param.grad = grad.clone()
            grads.append(grad)
        bucket.load(grads, self.world_size)

    def changed(self) -> bool:
        """Whether a gradient the hooks sent is not the one found now, or changed in place."""
        for bucket in self.buckets[: self.sent]:
            for index, grad, version in zip(
                bucket.indices, bucket.grads, bucket.versions, strict=True
            ):
                now = self.params[index].grad
                if now is None or now is not grad or now._version != version:  # noqa: SLF001
                    return True
        return False

    def finish(self, module: torch.nn.Module, ctx: Context) -> None:
        """Send the buckets backward did not, wait for all, and set the averaged gradients."""
        try:
            check_dense(self.params)
        except UsageError:
            self.drain()  # every rank sent the same buckets: wait, and start the next step clean
            raise
        changed = self.changed()
        absent = [index for index, param in enumerate(self.params) if param.grad is None]
        for bucket in self.buckets[self.sent :]:
            self.load(bucket)
            if bucket.flags is not None:  # the last: which have a gradient, whether any changed
                # Summed 0/1 flags are nonzero exactly where some rank set one, in any dtype.
                bucket.flags.fill_(1)
                if absent:
                    bucket.flags[absent] = 0
                bucket.flags[-1] = float(changed)
            bucket.send(self.group)
        self.sent = len(self.buckets)
        self.wait()
        flags = self.buckets[-1].flags
        assert flags is not None
        anywhere = reduced_values(flags, lambda: _flags(len(self.params), absent, changed))
        if anywhere[-1] != 0:  # some rank's gradients are not what it sent: average them again
            self.reset()
            average_gradients(module, ctx, bucket_mb=self.bucket_mb, compression=self.compression)
            return
        with torch.no_grad():
            for bucket in self.buckets:
                self.unload(bucket, anywhere)
        self.reset()

    def unload(self, bucket: Bucket, anywhere: list[Any]) -> None:
        """Give the parameters their averages: a view of the buffer, or a copy off the wire."""
        found = [(g, v) for g, v in zip(bucket.grads, bucket.views, strict=True) if g is not None]
        if found and not bucket.shared:
            torch._foreach_copy_([g for g, _ in found], [v for _, v in found])
        for index, grad, view in zip(bucket.indices, bucket.grads, bucket.views, strict=True):
            param = self.params[index]
            if bucket.shared and (grad is not None or anywhere[index] != 0):
                param.grad = view
            elif grad is None and anywhere[index] != 0:
                param.grad = torch.empty_like(param).copy_(view)

    def wait(self) -> None:
        """Wait for whatever is in flight (every rank sent it)."""
        for bucket in self.buckets[: self.sent]:
            bucket.work.wait()

    def drain(self) -> None:
        """`wait`, and start the next step clean."""
        self.wait()
        self.reset()

    def reset(self) -> None:
        """Forget this step: nothing in flight, nothing ready."""
        for bucket in self.buckets:
            bucket.reset()
        for ready in self.ready:
            ready.clear()
        self.sent = 0

    def detach(self) -> None:
        """`drain`, then remove the hooks."""
        self.drain()
        for handle in self.handles:
            handle.remove()
        self.handles = []


def _flags(count: int, absent: list[int], changed: bool) -> list[float]:
    """Return what a rank sends: 1 per parameter with a gradient, 0 per absent one, then changed."""
    missing = set(absent)
    return [float(index not in missing) for index in range(count)] + [float(changed)]


_HOOKS: weakref.WeakKeyDictionary[torch.nn.Module, GradientHooks] = weakref.WeakKeyDictionary()


def average_gradients_overlapped(
    module: torch.nn.Module,
    ctx: Context,
    *,
    bucket_mb: float = 25.0,
    compression: Compression | None = None,
) -> None:
    """`average_gradients`, finishing what the module's `GradientHooks` sent during backward.

    The first call (or one with other options, or after the module's
    parameters changed) hooks the module and sends every bucket itself; from
    the next backward on, buckets are sent as their gradients arrive. The
    result equals `average_gradients` on the gradients found here.

    Raises:
        UsageError: ``module`` is not a module, or a gradient is sparse.
    """
    training.check_module(module, "update")
    if not is_distributed(check_context(ctx, "update")):
        return
    owner = training.original_module(module)
    params: list[torch.Tensor] = [p for p in owner.parameters() if p.requires_grad]
    hooks = _HOOKS.get(owner)
    fits = (
        hooks is not None
        and hooks.made_for(bucket_mb, compression, ctx.group)
        and len(hooks.params) == len(params)  # a parameter frozen or unfrozen since: new hooks
        and all(a is b for a, b in zip(hooks.params, params, strict=True))
    )
    if hooks is None or not fits:
        if hooks is not None:
            hooks.detach()
            del _HOOKS[owner]
        if not params:
            return
        hooks = _HOOKS[owner] = GradientHooks.attach(
            params, ctx, bucket_mb=bucket_mb, compression=compression
        )
    hooks.finish(module, ctx)


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
