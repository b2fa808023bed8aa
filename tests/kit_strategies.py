"""Realistic custom strategies a researcher writes by substitution, and bugs planted in them.

Every field is a module-level function or a frozen attrs callable, so the kit can send the
records to its ranks. `CORRECT` holds the honest versions, each with the contract it keeps;
`MUTANTS` the broken ones, each with the law that must catch it.
"""

from __future__ import annotations

from pathlib import Path

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


def last_rank_wrap(module, ctx):
    """Bug: broadcasts from the last rank, not rank 0 (ranks agree, but on the wrong start)."""
    module = training.to_device(module, ctx)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor, src=ctx.world_size - 1, group=ctx.group)
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
    never: bool = False  # bug switch: never averages

    def __call__(self, optimizer, module, ctx):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = ctx.extras["local_steps"]
        state.taken += 1
        if state.taken % self.every or self.never:
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
    base = sg.ddp(device="cpu")
    return attrs.evolve(
        base,
        name=f"local-sgd-{every}" + "".join(f"-{k}" for k in bugs),
        setup=LocalSetup(base.setup),
        wrap=broadcast_wrap,
        update=LocalUpdate(every, **bugs),
        no_sync=training.no_sync,
    )


# --- DDP communication hooks ----------------------------------------------------------------


def local_hook(state, bucket):
    """Bug: returns the local bucket, never all-reduced."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


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
    "local": local_hook,
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
    return attrs.evolve(sg.ddp(device="cpu"), name=f"ddp-{hook}-hook", wrap=HookedWrap(hook))


# --- the Horovod way, done by hand: all-reduce gradients in update ---------------------------


@attrs.frozen
class AllreduceUpdate:
    """Update: average gradients, optionally clip, then step (each switch plants a bug)."""

    clip: float | None = None
    clip_first: bool = False  # clip each rank's local norm before averaging
    divide: bool = True  # False: a sum where the mean belongs
    divide_twice: bool = False  # the mean taken twice
    first_only: bool = False  # only the first parameter's gradient is synchronised
    step_first: bool = False  # step on local gradients, synchronise afterwards
    zero: bool = True  # False: gradients never cleared, they pile up across steps
    in_place: bool = True  # False: all-reduces a copy, so the gradient keeps its local value

    def __call__(self, optimizer, module, ctx):
        if self.step_first:
            optimizer.step()
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        if self.clip is not None and self.clip_first:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.clip)
        for grad in grads[:1] if self.first_only else grads:
            if not self.in_place:
                grad = grad.clone()  # the bug: the sum goes nowhere
            dist.all_reduce(grad, group=ctx.group)
            if self.divide:
                grad /= ctx.world_size
            if self.divide_twice:
                grad /= ctx.world_size
        if self.clip is not None and not self.clip_first:
            torch.nn.utils.clip_grad_norm_(module.parameters(), self.clip)
        if not self.step_first:
            optimizer.step()
        if self.zero:
            optimizer.zero_grad(set_to_none=True)


def by_hand(wrap=broadcast_wrap, **options):
    return attrs.evolve(
        sg.ddp(device="cpu"),
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


# --- a custom shard: DistributedSampler by hand ------------------------------------------------


@attrs.define
class EpochLoader:
    """One rank's loader: advances its sampler's epoch at every pass (unless told to forget)."""

    loader: object
    sampler: object
    advance: bool = True
    epoch: int = 0

    def __iter__(self):
        if self.advance:
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)


@attrs.frozen
class SliceSampler:
    """Contiguous shares of a shuffled order: bugs switch in an overlap or rank 0's share."""

    size: int
    rank: int
    world_size: int
    overlap: bool = False
    everyone_reads_rank_zero: bool = False
    extra_on_rank_zero: bool = False  # rank 0 takes the remainder too: one more batch
    epoch: list = attrs.field(factory=lambda: [0])

    def set_epoch(self, epoch):
        self.epoch[0] = epoch

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.epoch[0]))
        share = self.size // self.world_size
        rank = 0 if self.everyone_reads_rank_zero else self.rank
        start, stop = rank * share, (rank + 1) * share + (1 if self.overlap else 0)
        if self.extra_on_rank_zero:  # the boundary between ranks 0 and 1 moves by 2
            start, stop = start + (2 if rank == 1 else 0), stop + (2 if rank == 0 else 0)
        return iter(order[start:stop].tolist())

    def __len__(self):
        return len(list(iter(self)))


@attrs.frozen
class CustomShard:
    """Shard: a DistributedSampler (or a slicing sampler) and an epoch that advances."""

    sampler: str = "distributed"  # or "slices"
    advance: bool = True
    overlap: bool = False
    everyone_reads_rank_zero: bool = False
    extra_on_rank_zero: bool = False

    def __call__(self, loader, ctx):
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

        if isinstance(loader.dataset, IterableDataset):  # map-style only, and says so
            raise sg.UsageError("custom shard: split streams inside the dataset")
        if self.sampler == "distributed":
            sampler = DistributedSampler(
                loader.dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                seed=0, drop_last=True,
            )  # fmt: skip
        else:
            sampler = SliceSampler(
                len(loader.dataset), ctx.rank, ctx.world_size, self.overlap,
                self.everyone_reads_rank_zero, self.extra_on_rank_zero,
            )  # fmt: skip
        rebuilt = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)
        return EpochLoader(rebuilt, sampler, self.advance)


def custom_shard(**options):
    name = "custom-shard" + "".join(f"-{k}" for k in options)
    return attrs.evolve(sg.ddp(device="cpu"), name=name, shard=CustomShard(**options))


@attrs.define
class StridedStream:
    """Every world_size-th batch of a stream; bugs switch off the epoch or the dropped round."""

    loader: object
    rank: int
    world_size: int
    advance: bool
    drop_round: bool
    epoch: int = 0

    def __iter__(self):
        if self.advance:
            self.loader.dataset.set_epoch(self.epoch)
        self.epoch += 1
        batches = list(self.loader)
        whole = len(batches) - len(batches) % self.world_size if self.drop_round else None
        return iter(batches[:whole][self.rank :: self.world_size])


@attrs.frozen
class StreamShard:
    """Shard: ddp's for map-style datasets, a hand-written stride for streams (bugs: below)."""

    passthrough: bool = False  # every rank reads the whole stream
    advance: bool = True
    drop_round: bool = True

    def __call__(self, loader, ctx):
        from torch.utils.data import IterableDataset

        if not isinstance(loader.dataset, IterableDataset):
            return sg.ddp(device="cpu").shard(loader, ctx)
        if self.passthrough:
            return loader
        return StridedStream(loader, ctx.rank, ctx.world_size, self.advance, self.drop_round)


def stream_shard(**options):
    name = "stream-shard" + "".join(f"-{k}" for k in options)
    return attrs.evolve(sg.ddp(device="cpu"), name=name, shard=StreamShard(**options))


# --- custom save and load: one torch.save file, written by rank 0 ----------------------------


@attrs.frozen
class TorchSave:
    """Save: rank 0 writes {model, optimizer, values} with torch.save (bugs: drop buffers)."""

    buffers: bool = True
    values: bool = True  # False: plain values are not saved
    own_ranks: bool = True  # False: every rank's per-rank values are rank 0's

    def __call__(self, path, state, ctx):
        blob = {"values": {}, "per_rank": {}}
        for name, value in state.items():
            if isinstance(value, torch.nn.Module):
                plain = sg.unwrap(value)
                params = {n: p.detach().clone() for n, p in plain.named_parameters()}
                blob[name] = plain.state_dict() if self.buffers else params
            elif isinstance(value, torch.optim.Optimizer):
                blob[name] = value.state_dict()
            elif isinstance(value, sg.checkpoint.PerRank):
                blob["per_rank"][name] = value.value
            elif self.values:
                blob["values"][name] = value
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, blob["per_rank"], group=ctx.group)
        blob["per_rank"] = gathered if self.own_ranks else [gathered[0]] * ctx.world_size
        if ctx.rank == 0:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            torch.save(blob, path)
        dist.barrier(group=ctx.group)


@attrs.frozen
class TorchLoad:
    """Load: every rank reads the file (bug switch: strict=False, missing keys ignored)."""

    strict: bool = True

    def __call__(self, path, state, ctx):
        blob = torch.load(path, weights_only=True)
        for name, value in state.items():
            if isinstance(value, torch.nn.Module):
                sg.unwrap(value).load_state_dict(blob[name], strict=self.strict)
            elif isinstance(value, torch.optim.Optimizer):
                value.load_state_dict(blob[name])
        return {**blob["values"], **blob["per_rank"][ctx.rank]}


def torch_checkpoints(**bugs):
    save_bugs = {k: v for k, v in bugs.items() if k in ("buffers", "values", "own_ranks")}
    load_bugs = {k: v for k, v in bugs.items() if k == "strict"}
    return attrs.evolve(
        sg.ddp(device="cpu"),
        name="torch-save" + "".join(f"-{k}" for k in bugs),
        save=TorchSave(**save_bugs),
        load=TorchLoad(**load_bugs),
    )


# --- ZeRO-1 by hand: each rank keeps the optimizer state of the parameters it owns -----------


@attrs.frozen
class Zero1Update:
    """Update: average gradients, step only owned parameters, then owners broadcast them."""

    broadcast: bool = True  # bug switch: owners never send their updated parameters
    owner_shift: int = 0  # bug switch: broadcast from the wrong rank

    def __call__(self, optimizer, module, ctx):
        parameters = list(module.parameters())
        for parameter in parameters:
            if parameter.grad is not None:
                dist.all_reduce(parameter.grad, group=ctx.group)
                parameter.grad /= ctx.world_size
        for index, parameter in enumerate(parameters):
            if index % ctx.world_size != ctx.rank:
                parameter.grad = None  # not ours: SGD skips it, and keeps no state for it
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self.broadcast:
            with torch.no_grad():
                for index, parameter in enumerate(parameters):
                    owner = (index + self.owner_shift) % ctx.world_size
                    dist.broadcast(parameter, src=owner, group=ctx.group)


@attrs.frozen
class ShardedOptimizerSave:
    """Save/load: each rank's optimizer state is its own (sg.per_rank), the module replicated."""

    load: bool = False

    def __call__(self, path, state, ctx):
        # The optimizer's parameter names come from the module, so save it by position.
        marked = {
            k: sg.per_rank(v) if isinstance(v, torch.optim.Optimizer) else v
            for k, v in state.items()
        }
        if self.load:
            return sg.checkpoint.load(path, marked, ctx)
        return sg.checkpoint.save(path, marked, ctx)


def zero1(**bugs):
    return attrs.evolve(
        sg.ddp(device="cpu"),
        name="zero1" + "".join(f"-{k}" for k in bugs),
        wrap=broadcast_wrap,
        update=Zero1Update(**bugs),
        no_sync=training.no_sync,
        save=ShardedOptimizerSave(),
        load=ShardedOptimizerSave(load=True),
    )


def zero_redundancy_sgd(parameters):
    """torch's ZeroRedundancyOptimizer over SGD with momentum: the optimizer shards itself.

    In the law's one-process reference (no process group) the same arithmetic is plain SGD.
    """
    import warnings

    if not dist.is_initialized():
        return torch.optim.SGD(parameters, lr=0.1, momentum=0.9)

    with warnings.catch_warnings():  # torch's own import uses the deprecated torch.jit.script
        warnings.simplefilter("ignore", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        list(parameters), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9
    )


SHARDED = Contract(optimizer_state="sharded", buffers="per-rank")
CORRECT["zero1"] = (zero1(), SHARDED, None)
CORRECT["custom-shard"] = (custom_shard(), Contract(), None)
CORRECT["torch-save-checkpoints"] = (torch_checkpoints(), Contract(), None)
