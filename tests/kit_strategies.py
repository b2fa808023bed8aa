"""Realistic custom strategies a researcher writes by substitution, and bugs planted in them.

Every field is a module-level function or a frozen attrs callable, so the kit can send the
records to its ranks. `CORRECT` holds the honest versions, each with the contract it keeps;
`MUTANTS` the broken ones, each with the law that must catch it.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import stratagem as sg
from stratagem import training
from stratagem.strategies.ddp import WrapDDP
from stratagem.testing import Contract

# --- local SGD: each rank steps alone, parameters are averaged every k updates ------------


@attrs.define
class LocalSteps:
    """Per-run state: updates taken since the last average."""

    taken: int = 0


@attrs.frozen
class LocalSetup:
    """Setup: join, then keep a `LocalSteps` counter in ctx.extras (a layer: fresh per run)."""

    inner: object

    def __call__(self, env):
        return self.inner(env).with_extras(local_steps=LocalSteps())


def broadcast_wrap(module, ctx):
    """Wrap: move, and give every rank rank 0's parameters and buffers."""
    module = training.to_device(module, ctx)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=0, group=ctx.group)
    return module


def params_only_wrap(module, ctx):
    """Bug: broadcasts parameters, forgets buffers."""
    module = training.to_device(module, ctx)
    with torch.no_grad():
        for tensor in module.parameters():
            dist.broadcast(tensor, src=0, group=ctx.group)
    return module


def no_broadcast_wrap(module, ctx):
    """Bug: every rank keeps its own initialisation."""
    return training.to_device(module, ctx)


@attrs.frozen
class LocalUpdate:
    """Update: a local step; every ``every`` updates, average the parameters over the ranks."""

    every: int
    divide: bool = True  # bug switch: a sum where the mean belongs
    all_ranks: bool = True  # bug switch: only rank 0 takes the average

    def __call__(self, optimizer, module, ctx):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = ctx.extras["local_steps"]
        state.taken += 1
        if state.taken % self.every:
            return
        with torch.no_grad():
            for parameter in module.parameters():
                total = parameter.detach().clone()
                dist.all_reduce(total, group=ctx.group)
                if self.divide:
                    total /= ctx.world_size
                if self.all_ranks or ctx.rank == 0:
                    parameter.copy_(total)


def local_sgd(every=4, **bugs):
    base = sg.ddp()
    return attrs.evolve(
        base,
        name=f"local-sgd-{every}" + "".join(f"-{k}" for k in bugs),
        setup=LocalSetup(base.setup),
        wrap=broadcast_wrap,
        update=LocalUpdate(every, **bugs),
        no_sync=training.no_sync,
    )


# --- DDP communication hooks ----------------------------------------------------------------


def sum_hook(state, bucket):
    """Bug: all-reduces without dividing by the world size (a sum for a mean)."""
    tensor = bucket.buffer()
    work = dist.all_reduce(tensor, group=state, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def twice_divided_hook(state, bucket):
    """Bug: divides by the world size before and after the all-reduce."""
    tensor = bucket.buffer().div_(dist.get_world_size(state))
    work = dist.all_reduce(tensor, group=state, async_op=True)
    size = dist.get_world_size(state)
    return work.get_future().then(lambda fut: fut.value()[0].div_(size))


HOOKS = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "allreduce": default_hooks.allreduce_hook,
    "sum": sum_hook,
    "twice": twice_divided_hook,
}


@attrs.frozen
class HookedWrap:
    """Wrap: ddp()'s, then register a communication hook by name."""

    hook: str
    inner: WrapDDP = attrs.field(factory=WrapDDP)

    def __call__(self, module, ctx):
        wrapped = self.inner(module, ctx)
        assert isinstance(wrapped, DistributedDataParallel)
        wrapped.register_comm_hook(ctx.group, HOOKS[self.hook])
        return wrapped


def hooked(hook):
    return attrs.evolve(sg.ddp(), name=f"ddp-{hook}-hook", wrap=HookedWrap(hook))


# --- the Horovod way, done by hand: all-reduce gradients in update ---------------------------


@attrs.frozen
class AllreduceUpdate:
    """Update: average gradients, optionally clip, then step."""

    clip: float | None = None
    clip_first: bool = False  # bug switch: clip each rank's local norm before averaging

    def __call__(self, optimizer, module, ctx):
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if self.clip is not None and self.clip_first:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.clip)
        for grad in grads:
            dist.all_reduce(grad, group=ctx.group)
            grad /= ctx.world_size
        if self.clip is not None and not self.clip_first:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def by_hand(wrap=broadcast_wrap, **options):
    return attrs.evolve(
        sg.ddp(),
        name="allreduce-by-hand" + "".join(f"-{k}" for k in options),
        wrap=wrap,
        update=AllreduceUpdate(**options),
        no_sync=training.no_sync,
    )


def unnormalised_backward(loss, module, ctx):
    """Bug in a hand-made accumulation: the loss of each micro-batch is not divided by k."""
    training.backward(loss * 2, module, ctx)


CLIPPED = sg.with_clipping(sg.single_device("cpu"), max_norm=0.05)

# name: (strategy, contract, reference: None to let the kit derive it)
CORRECT = {
    "local-sgd": (local_sgd(4), Contract(sync_every=4, buffers="per-rank"), None),
    "fp16-hook": (hooked("fp16"), Contract(rtol=2e-3, atol=2e-3), None),
    "allreduce-by-hand": (by_hand(), Contract(buffers="per-rank"), None),
    # A custom update that clips: only the user knows it clips, so the user names the reference.
    "allreduce-by-hand-clipped": (by_hand(clip=0.05), Contract(buffers="per-rank"), CLIPPED),
}
