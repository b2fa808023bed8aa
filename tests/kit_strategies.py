"""Realistic custom strategies a researcher writes by substitution, and bugs planted in them.

Every field is a module-level function or a frozen attrs callable, so the kit can send the
records to its ranks. `CORRECT` holds the honest versions, each with the contract it keeps;
`MUTANTS` the broken ones, each with the law that must catch it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from copy import deepcopy
from pathlib import Path
from typing import ClassVar

import attrs
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import stratagem as sg
from stratagem import training
from stratagem.sharding import shard_loader
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
    buffers: bool = False  # average floating-point buffers (BatchNorm's) with the parameters

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
            for buffer in module.buffers() if self.buffers else ():
                if buffer.is_floating_point():
                    dist.all_reduce(buffer, group=ctx.group)
                    buffer /= ctx.world_size


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
    in_reference: ClassVar[bool] = False  # it distributes: the reference leaves it out

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
            elif isinstance(value, sg.checkpoint.PerRank):
                blob["per_rank"][name] = value.value
            elif hasattr(value, "state_dict"):  # an optimizer, an LR scheduler
                blob[name] = value.state_dict()
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
            elif hasattr(value, "load_state_dict"):
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


# --- saves in the background by hand, and resumes ------------------------------------------


@attrs.define
class InFlight:
    """Per-run state: this rank's save in flight (a thread of ours, or a PendingSave)."""

    save: object = None

    def wait(self):
        if isinstance(self.save, threading.Thread):
            self.save.join()
        elif self.save is not None:
            self.save.wait()

    def done(self):
        if isinstance(self.save, threading.Thread):
            return not self.save.is_alive()
        return self.save is None or self.save.done()


@attrs.frozen
class InFlightSetup:
    """Setup: join, then keep an `InFlight` in ctx.extras (a layer: fresh per run)."""

    inner: object

    def __call__(self, env):
        return self.inner(env).with_extras(in_flight=InFlight())


def _blob(state, copy):
    """What a save writes: state dicts of objects (cloned unless the bug), values, per-rank."""
    blob = {"values": {}, "objects": {}, "per_rank": {}}
    for name, value in state.items():
        if isinstance(value, sg.checkpoint.PerRank):
            blob["per_rank"][name] = value.value
        elif hasattr(value, "state_dict"):
            held = (sg.unwrap(value) if isinstance(value, torch.nn.Module) else value).state_dict()
            blob["objects"][name] = deepcopy(held) if copy else held
        else:
            blob["values"][name] = value
    return blob


@attrs.frozen
class ThreadSave:
    """Save: hand the state to a writer thread and return (bug switch: live tensors handed)."""

    copy: bool = True
    latency: float = 0.2  # a real filesystem's: the loop trains on meanwhile

    def __call__(self, path, state, ctx):
        in_flight = ctx.extras["in_flight"]
        in_flight.wait()  # one save at a time
        blob = _blob(state, self.copy)
        Path(path).mkdir(parents=True, exist_ok=True)

        def write():
            time.sleep(self.latency)
            torch.save(blob["per_rank"], f"{path}/rank-{ctx.rank}.pt")
            if ctx.rank == 0:
                torch.save(
                    {"values": blob["values"], "objects": blob["objects"]}, f"{path}/main.pt"
                )

        in_flight.save = threading.Thread(target=write)
        in_flight.save.start()
        return in_flight


@attrs.frozen
class ThreadLoad:
    """Load: wait for this rank's save, then every rank reads (bug switches below)."""

    wait: bool = True  # False: reads whatever is on disk, the save in flight or not
    keep_settings: bool = False  # True: the optimizer's live hyperparameters survive the load

    def __call__(self, path, state, ctx):
        if self.wait:
            ctx.extras["in_flight"].wait()
        dist.barrier(group=ctx.group)  # every rank's writer has finished (when they wait)
        main = torch.load(f"{path}/main.pt", weights_only=True)
        mine = torch.load(f"{path}/rank-{ctx.rank}.pt", weights_only=True)
        for name, value in state.items():
            target = sg.unwrap(value) if isinstance(value, torch.nn.Module) else value
            live = [dict(g) for g in getattr(target, "param_groups", ())]
            target.load_state_dict(main["objects"][name])
            if self.keep_settings and live:
                for group, settings in zip(target.param_groups, live, strict=True):
                    group.update({k: v for k, v in settings.items() if k != "params"})
        return {**main["values"], **mine}


def thread_checkpoints(**bugs):
    save_bugs = {k: v for k, v in bugs.items() if k == "copy"}
    load_bugs = {k: v for k, v in bugs.items() if k in ("wait", "keep_settings")}
    base = sg.ddp(device="cpu")
    return attrs.evolve(
        base,
        name="thread-save" + "".join(f"-{k}" for k in bugs),
        setup=InFlightSetup(base.setup),
        save=ThreadSave(**save_bugs),
        load=ThreadLoad(**load_bugs),
    )


def background_save(path, state, ctx):
    """Save: stratagem's background save, its handle kept for the load."""
    ctx.extras["in_flight"].save = sg.checkpoint.save(path, state, ctx, blocking=False)
    return ctx.extras["in_flight"].save


def waiting_load(path, state, ctx):
    """Load: wait for this rank's background save first."""
    ctx.extras["in_flight"].wait()
    return sg.checkpoint.load(path, state, ctx)


def background_checkpoints(wait=True):
    base = sg.ddp(device="cpu")
    return attrs.evolve(
        base,
        name="background-save" + ("" if wait else "-load-never-waits"),
        setup=InFlightSetup(base.setup),
        save=background_save,
        load=waiting_load if wait else sg.checkpoint.load,
    )


CORRECT["thread-save-checkpoints"] = (thread_checkpoints(), Contract(), None)
CORRECT["background-save-checkpoints"] = (background_checkpoints(), Contract(), None)


# --- four bugs from other projects' trackers -------------------------------------------------
# torchtitan #1733: pipeline parallelism with gradient accumulation averages where it should sum.


@attrs.frozen
class RescaledEarlierStep:
    """Pipeline step: the schedule's division by its micro-batches reaches earlier steps' grads.

    Honest pipelines set an earlier step's gradients aside while the schedule divides its own
    (stratagem's pipeline does); this bug lets the division reach them too, so two steps before
    an update average their gradients where they should sum them.
    """

    inner: object
    microbatches: int
    in_reference: ClassVar[bool] = (
        False  # the pipeline's own step, patched: part of what distributes
    )

    def __call__(self, module, batch, ctx, *, forward=None):
        earlier = {p: p.grad.detach().clone() for p in module.parameters() if p.grad is not None}
        loss = self.inner(module, batch, ctx, forward=forward)
        for parameter, grad in earlier.items():
            parameter.grad.sub_(grad - grad / self.microbatches)
        return loss


def mse(model, batch):
    """A forward for ``(inputs, targets)`` batches: the mean squared error."""
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def pairs(rows=8):
    """An ``(inputs, targets)`` batch of ``rows`` rows, the same every call."""
    generator = torch.Generator().manual_seed(3)
    return torch.randn(rows, 6, generator=generator), torch.randn(rows, 2, generator=generator)


def five_layers():
    """Linear, Tanh, Linear, Tanh, Linear: two parameter-free modules a stage list can lose."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 2),
    )  # fmt: skip


def averaging_pipeline(stages, microbatches=2):
    base = sg.pipeline(
        stages=stages, schedule="1f1b", microbatches=microbatches, timeout=60, device="cpu"
    )
    return attrs.evolve(
        base,
        name="pipeline-averages-accumulation",
        step=RescaledEarlierStep(base.step, microbatches),
    )


# accelerate #3979: an FSDP2 float32 upcast (master weights for a bf16 checkpoint) that did nothing.


@attrs.frozen
class UpcastWrap:
    """Wrap: upcast the module to float32, then fsdp()'s (bug switch: the upcast does nothing)."""

    inner: object
    works: bool = True

    def __call__(self, module, ctx):
        if self.works:
            module = module.float()
        else:
            for parameter in module.parameters():
                parameter.data.float()  # the bug: a converted copy, thrown away
        return self.inner(module, ctx)


def bf16_fsdp(works=True):
    """fsdp() in "bf16-mixed" (FSDP2's MixedPrecisionPolicy), its wrap upcasting the module first."""
    base = sg.fsdp(device="cpu")
    name = "fsdp2-bf16-upcast" + ("" if works else "-does-nothing")
    upcast = attrs.evolve(base, name=name, wrap=UpcastWrap(base.wrap, works))
    return sg.with_precision(upcast, "bf16-mixed")


# torchtitan PR #4245: a tensor-parallel bias multiplied by the TP degree.


class _ReduceForward(torch.autograd.Function):
    """Megatron's row-parallel reduction: sum the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class RowParallelLinear(torch.nn.Module):
    """A row-wise split Linear by hand: each rank multiplies its slice of the features."""

    def __init__(self, linear, mesh, bias_on_every_rank):
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        self.weight = torch.nn.Parameter(
            distribute_tensor(linear.weight.detach(), mesh, [Shard(1)])
        )
        self.bias = torch.nn.Parameter(distribute_tensor(linear.bias.detach(), mesh, [Replicate()]))
        self.group = mesh.get_group()
        self.bias_on_every_rank = bias_on_every_rank

    def forward(self, x):
        weight, bias = self.weight.to_local(), self.bias.to_local()
        if self.bias_on_every_rank:  # the bug: each partial sum carries the bias, summed tp times
            return _ReduceForward.apply(torch.nn.functional.linear(x, weight, bias), self.group)
        return _ReduceForward.apply(torch.nn.functional.linear(x, weight), self.group) + bias


@attrs.frozen
class RowSplitPlan:
    """Plan: column-wise split of layer "0", row-wise of "2" by hand (an MLP's two Linears)."""

    bias_on_every_rank: bool = False

    def __call__(self, module, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        module = parallelize_module(module, mesh, {"0": ColwiseParallel()})
        module[2] = RowParallelLinear(module[2], mesh, self.bias_on_every_rank)
        return module


def shard_by_global_rank(loader, ctx):
    """Shard: deal batches over the world, as if there were no tensor-parallel groups (the bug)."""
    without_mesh = attrs.evolve(ctx, extras={k: v for k, v in ctx.extras.items() if k != "mesh"})
    return shard_loader(loader, without_mesh)


def hand_tensor_parallel(bias_on_every_rank=False):
    strategy = sg.tensor_parallel(sg.fsdp(device="cpu"), RowSplitPlan(bias_on_every_rank), size=2)
    name = "tp-by-hand" + ("-bias-times-degree" if bias_on_every_rank else "")
    return attrs.evolve(strategy, name=name)


# cosmos PR #162: a "skip sync" helper that never skipped under FSDP2 (which has no no_sync()).


def skip_sync_helper(module, ctx):
    """No-sync: the module's own no_sync() where it has one (FSDP1, DDP); else nothing (the bug)."""
    no_sync = getattr(module, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()


def fsdp_with_skip_sync_helper():
    return attrs.evolve(
        sg.fsdp(device="cpu"), name="fsdp2-skip-sync-helper", no_sync=skip_sync_helper
    )
