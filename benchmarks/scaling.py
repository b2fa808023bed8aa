"""scaling: step time, samples/s and bytes sent per step at 1, 2 and 4 gloo ranks.

**This machine's cores bound it.** Every rank is a process with one torch
thread, and gloo adds its own threads; with 2 cores, 4 ranks share them, so
4 ranks cannot be faster than 2 and the figures show the machine's limit as
much as the strategies'. What carries over to other machines is the pairing:
stratagem and hand-written side by side at each size.

**Time.** One launch (``ddp_spawn``, gloo on 127.0.0.1) per world size; on
each rank four copies of one MLP with the same weights: ``sg.ddp()``,
``DistributedDataParallel`` by hand, ``sg.fsdp()`` sharding every Linear, and
``fully_shard`` by hand on every Linear and the root. Blocks of steps (SGD,
MSE) rotate round by round, each after a barrier; rank 0's wall time per step
is reported. The batch per rank is fixed (weak scaling), so samples/s is
``ranks x batch / step time``.

**Communication volume.** ``traced()`` records calls of the strategy's fields
(their argument shapes, their time): DDP's gradient all-reduce runs inside
``backward``, from torch's reducer, so traced() sees a ``backward`` call and
no collective, and no bytes. Two counts that do see it, taken after the timed
rounds:

- bytes sent: the growth of ``wchar`` in ``/proc/self/io`` over a few steps,
  every byte the rank's threads wrote to a file or socket (gloo's sends are
  ``writev`` on its TCP sockets; nothing else writes during a step);
- bytes handed to the all-reduce: a DDP communication hook, on one more
  hand-written copy, that adds up the bucket sizes and calls torch's default
  all-reduce hook.

Both are set against the minimum of a ring all-reduce, ``2 (N - 1) / N`` x
the gradient bytes sent by each rank per step. FSDP's bytes are set against
its ring minimum, ``3 (N - 1) / N`` x (all-gather in forward and again in
backward, reduce-scatter); gloo's own collectives are measured the same way
for the notes, because gloo's reduce-scatter sends what its all-reduce does.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import stratagem as sg
from benchmarks import steps
from benchmarks.fsdp_step import shard_by_hand
from benchmarks.report import Case, Result, compare
from benchmarks.timing import THREADS, bootstrap_median, fixed_threads, rotate
from stratagem.combinators.tracing import COLLECTIVE_FIELDS
from stratagem.meshes import device_mesh

NAME = "scaling"
DESCRIPTION = (
    "Step time, samples/s and bytes sent per step at 1, 2, 4 gloo ranks: ddp() and fsdp() vs "
    "by hand (bound by this machine's 2 cores: 4 ranks share them)."
)
WORLDS = (1, 2, 4)
VOLUME_TARGET = 1.01  # bytes sent by ddp() per step, at most this x the ring all-reduce minimum
CONTENDERS = ("ddp()", "DistributedDataParallel", "fsdp()", "fully_shard")


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (512, 1024, 1024, 512)
    batch: int = 32  # per rank: weak scaling
    steps_per_block: int = 3
    rounds: int = 30
    volume_steps: int = 3  # steps over which bytes are counted


def ring_allreduce_bytes(gradient_bytes: float, ranks: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``gradient_bytes``: ``2 (N - 1) / N`` x.

    A reduce-scatter then an all-gather, each ``N - 1`` steps of a ``1 / N`` chunk:
    the least any all-reduce sends per rank when every rank sends the same.

    >>> ring_allreduce_bytes(1000, 1), ring_allreduce_bytes(1000, 2), ring_allreduce_bytes(1000, 4)
    (0.0, 1000.0, 1500.0)
    """
    return 2 * (ranks - 1) / ranks * gradient_bytes


def fsdp_ring_bytes(gradient_bytes: float, ranks: int, gathers: int = 2) -> float:
    """Bytes each rank sends per FSDP step with ring collectives: ``(gathers + 1) (N - 1) / N`` x.

    Each all-gather of the parameters sends ``(N - 1) / N`` of them, and so does
    a ring reduce-scatter of the gradients; resharding after forward gathers
    twice (forward and backward).

    >>> fsdp_ring_bytes(1000, 2), fsdp_ring_bytes(1000, 4, gathers=1)
    (1500.0, 1500.0)
    """
    return (gathers + 1) * (ranks - 1) / ranks * gradient_bytes


def bytes_written() -> int:
    """Bytes this process has written to files and sockets so far (``wchar``, all threads)."""
    with open("/proc/self/io", encoding="ascii") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no wchar line")


def sent_per_step(step: steps.Step, batch: steps.Batch, count: int, group: Any) -> float:
    dist.barrier(group)  # the barrier's few bytes stay outside the count
    before = bytes_written()
    for _ in range(count):
        step(batch)
    return (bytes_written() - before) / count


def gloo_collectives(ctx: sg.Context, numel: int) -> dict[str, float]:
    """Bytes each collective FSDP2 and DDP call sends on this group, as x the input's bytes.

    ``numel`` float32 in (the whole tensor; all-gather's input is this rank's 1/N of it).
    """
    group, ranks = ctx.group, ctx.world_size
    whole, part = torch.ones(numel), torch.ones(numel // ranks)
    calls: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(whole, group=group),
        "all_gather_single": lambda: dist.all_gather_single(whole, part, group=group),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(part, whole, group=group),
    }
    sent = {}
    for name, call in calls.items():
        call()
        dist.barrier(group)
        before = bytes_written()
        call()
        sent[name] = (bytes_written() - before) / (numel * whole.element_size())
    return sent


@dataclass
class BucketBytes:
    """DDP comm hook state: bytes and buckets handed to the all-reduce so far."""

    group: Any
    bytes: int = 0
    buckets: int = 0


# Not annotated: DDP checks a hook's annotations as objects, and here they would be strings.
def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    state.buckets += 1
    return default_hooks.allreduce_hook(state.group, bucket)


def handed_to_allreduce(ctx: sg.Context, config: Config, batch: steps.Batch) -> tuple[float, float]:
    """Bytes and buckets per step that DDP's reducer hands to all-reduce (a counting hook)."""
    model = steps.copies(lambda: steps.mlp(*config.widths), 1)[0]
    wrapped = DistributedDataParallel(model, process_group=ctx.group)
    counter = BucketBytes(ctx.group)
    step = steps.plain_step(wrapped, steps.sgd(wrapped), ctx.device)
    step(batch)  # DDP rebuilds its buckets after the first step
    wrapped.register_comm_hook(counter, counting_allreduce)
    for _ in range(config.volume_steps):
        step(batch)
    return counter.bytes / config.volume_steps, counter.buckets / config.volume_steps


def seen_by_traced(ctx: sg.Context, config: Config, batch: steps.Batch) -> dict[str, Any]:
    """What ``traced(ddp())`` records of one step: field calls, collective calls and their bytes."""
    sink = sg.ListSink()
    strategy = sg.traced(sg.ddp(), sink)
    model = strategy.wrap(steps.copies(lambda: steps.mlp(*config.widths), 1)[0], ctx)
    step = steps.stratagem_step(strategy, ctx, model, steps.sgd(model))
    step(batch)
    del sink.events[:]
    step(batch)
    collectives = [event for event in sink.events if event.field in COLLECTIVE_FIELDS]
    return {
        "fields": dict(collections.Counter(event.field for event in sink.events)),
        "collectives": len(collectives),
        "bytes": sum(
            math.prod(shape) * getattr(torch, dtype.removeprefix("torch.")).itemsize
            for event in collectives
            for shape, dtype in zip(event.shapes, event.dtypes, strict=True)
        ),
    }


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> dict[str, Any]:
    """Body of each rank: time the four contenders round by round, then count bytes sent."""
    assert ctx.group is not None
    group = ctx.group
    fsdp = sg.fsdp(shard_when=sg.every_module_of(torch.nn.Linear), device="cpu")
    fsdp_ctx = ctx.with_extras(mesh=device_mesh(ctx))

    def build() -> torch.nn.Module:
        return steps.mlp(*config.widths)

    batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1], 1 + ctx.rank)
    with fixed_threads(THREADS):
        # Hand-written copies first, as steps.contenders builds them: allocation order
        # shifts step time by a percent or two.
        ddp_plain, ddp_model, fsdp_plain, fsdp_model = steps.copies(build, 4)
        ddp_plain = DistributedDataParallel(ddp_plain, process_group=group)
        ddp_model = strategy.wrap(ddp_model, ctx)
        fsdp_plain = shard_by_hand(fsdp_plain, fsdp_ctx.extras["mesh"])
        fsdp_model = fsdp.wrap(fsdp_model, fsdp_ctx)
        contenders = [
            steps.stratagem_step(strategy, ctx, ddp_model, steps.sgd(ddp_model)),
            steps.plain_step(ddp_plain, steps.sgd(ddp_plain), ctx.device),
            steps.stratagem_step(fsdp, fsdp_ctx, fsdp_model, steps.sgd(fsdp_model)),
            steps.plain_step(fsdp_plain, steps.sgd(fsdp_plain), ctx.device),
        ]

        def timed(step: steps.Step) -> Callable[[], float]:
            def block() -> float:
                dist.barrier(group)  # every rank starts the block together
                start = time.perf_counter()
                for _ in range(config.steps_per_block):
                    step(batch)
                return (time.perf_counter() - start) / config.steps_per_block

            return block

        times = rotate([timed(step) for step in contenders], rounds=config.rounds)
        sent = [sent_per_step(step, batch, config.volume_steps, group) for step in contenders]
        del contenders, ddp_plain, ddp_model, fsdp_plain, fsdp_model
        handed, buckets = handed_to_allreduce(ctx, config, batch)
        traced = seen_by_traced(ctx, config, batch)
        gloo = gloo_collectives(ctx, 2**20 * ctx.world_size) if ctx.world_size > 1 else {}
    gradient_bytes = sum(p.numel() * p.element_size() for p in build().parameters())
    return {
        "times": dict(zip(CONTENDERS, times, strict=True)),
        "sent": dict(zip(CONTENDERS, sent, strict=True)),
        "handed": handed,
        "buckets": buckets,
        "traced": traced,
        "gloo": gloo,
        "gradient_bytes": gradient_bytes,
    }


def interval(ours: Sequence[float], theirs: Sequence[float]) -> str:
    low, high = bootstrap_median([a / b for a, b in zip(ours, theirs, strict=True)])
    return f"median ratio 95% bootstrap interval {low:.3f} .. {high:.3f}"


def time_cases(worlds: dict[int, dict[str, Any]], config: Config) -> list[Case]:
    """Per world size and strategy: stratagem vs by hand, samples/s and speed-up over 1 rank."""
    model = f"MLP {'-'.join(map(str, config.widths))}, batch {config.batch}/rank"

    def rate(ranks: int, name: str) -> float:
        times: list[float] = worlds[ranks]["times"][name]
        return ranks * config.batch / statistics.median(times)

    cases = []
    for ours, theirs in (("ddp()", "DistributedDataParallel"), ("fsdp()", "fully_shard")):
        for ranks, result in worlds.items():
            speedup = rate(ranks, ours) / rate(1, ours) if 1 in worlds else math.nan
            notes = (
                f"{rate(ranks, ours):.0f} vs {rate(ranks, theirs):.0f} samples/s; {ours}: "
                f"{speedup:.2f} x its 1-rank samples/s; "
                + interval(result["times"][ours], result["times"][theirs])
            )
            cases.append(
                compare(
                    f"{ours} vs {theirs}, {ranks} rank(s): {model}, wall time",
                    "s/step",
                    result["times"][ours],
                    result["times"][theirs],
                    notes=notes,
                )
            )
    return cases


def volume_cases(worlds: dict[int, list[dict[str, Any]]]) -> list[Case]:
    """Per world size > 1: rank 0's bytes sent per step against the ring minimum."""
    cases = []
    for ranks, results in worlds.items():
        if ranks == 1:
            continue
        first = results[0]
        grads = first["gradient_bytes"]
        ring = ring_allreduce_bytes(grads, ranks)
        traced = first["traced"]
        gloo = ", ".join(f"{name} {share:.3f}" for name, share in first["gloo"].items())
        every = [round(r["sent"]["ddp()"]) for r in results]
        cases.append(
            compare(
                f"ddp(), {ranks} ranks: bytes sent per step per rank vs ring all-reduce "
                f"2(N-1)/N x {grads} gradient B",
                "B",
                [first["sent"]["ddp()"]],
                [ring],
                target=VOLUME_TARGET,
                notes=f"every rank: {every}; DistributedDataParallel by hand: "
                f"{first['sent']['DistributedDataParallel']:.0f} B; handed to all-reduce "
                f"(comm hook): {first['handed']:.0f} B in {first['buckets']:g} buckets "
                f"(= {first['handed'] / grads:.4f} x gradient B); traced(ddp()) saw "
                f"{traced['fields']} per step, {traced['collectives']} collective calls, "
                f"{traced['bytes']} B",
            )
        )
        cases.append(
            compare(
                f"fsdp() (every Linear), {ranks} ranks: bytes sent per step per rank vs ring "
                "all-gather x 2 + reduce-scatter, 3(N-1)/N x gradient B",
                "B",
                [first["sent"]["fsdp()"]],
                [fsdp_ring_bytes(grads, ranks)],
                notes=f"fully_shard by hand: {first['sent']['fully_shard']:.0f} B; "
                f"= {first['sent']['fsdp()'] / ring:.3f} x the ring all-reduce minimum; gloo "
                f"sends, x the tensor: {gloo} (a ring reduce-scatter's: {(ranks - 1) / ranks:.3f})",
            )
        )
    return cases


def run(quick: bool = False) -> Result:
    config = Config(rounds=3, steps_per_block=2) if quick else Config()
    worlds: dict[int, list[dict[str, Any]]] = {}
    seconds: dict[int, float] = {}
    for ranks in WORLDS:
        start = time.perf_counter()
        worlds[ranks] = sg.launch(on_rank, sg.ddp_spawn(), devices=ranks, args=(config,))
        seconds[ranks] = time.perf_counter() - start
    rank_zero = {ranks: results[0] for ranks, results in worlds.items()}
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            **asdict(config),
            "worlds": WORLDS,
            "backend": "gloo",
            "launch_seconds": seconds,
            "gradient_bytes": rank_zero[1]["gradient_bytes"],
            "bytes_sent": {r: result["sent"] for r, result in rank_zero.items()},
            "bound": "2 cores: 4 ranks share them",
        },
        cases=time_cases(rank_zero, config) + volume_cases(worlds),
        quick=quick,
    )
