"""memory: peak tensor memory per rank, each built-in against its hand-written loop, on CPU.

**Method.** The CPU has no allocator statistics like CUDA's, so every
allocation and free of tensor storage is recorded with
``torch.profiler.profile(profile_memory=True)`` (the ``[memory]`` events of
torch's CPU allocator, bytes and time), from before the model is built until
after the last step; the peak is the running sum's maximum. It counts every
tensor torch allocates on the rank (parameters, gradients, optimizer state,
activations, DDP's and FSDP's buffers, the flat buckets of
``allreduce_grads()``), nothing else (no interpreter, no gloo socket
buffers).

**Lost frees.** The CPU allocator records a tensor's size, and reports its
events, only on threads where the profiler is on: not on gloo's worker
threads. A tensor whose last reference dies there (the flat buffer of DDP's
initial broadcast, FSDP's collective buffers) is freed unrecorded, and the
running sum counts it from then on. Whether that happens depends on timing,
so one run's peak on several ranks can exceed the true one by a buffer
(seen: +8 MiB, one model's worth, on either side of a pair, in about one
run in six for ``ddp()`` and one in two for ``fsdp()``). What a run leaves
unreleased shows it: after the run, and a garbage collection inside the
record, every tensor the run made should be freed. Each side is run
``runs`` times, alternating, and the run with the fewest bytes unreleased
(then the lower peak) is compared; the notes give what it left unreleased
and the range of all peaks. A side that leaves bytes unreleased in every
run still holds tensors after the model and optimizer are gone (seen, and
fixed: ``allreduce_grads()``, whose gradient hooks kept the parameters alive).

Pairs: ``single_device()`` and ``dp()`` in this process (without CUDA,
``DataParallel`` calls the module itself, so ``dp()`` and its hand-written
``DataParallel`` loop are single-device loops through a wrapper); ``ddp()``,
``fsdp()`` and ``allreduce_grads()`` on 2 ranks; ``hsdp(replicate=2,
shard=2)`` on 4 ranks against ``fully_shard`` over a 2-D ``(replicate,
shard)`` mesh built by hand with ``init_device_mesh``.

The second part is ``fsdp()``'s state per rank: the bytes of the parameters,
gradients and AdamW state each rank holds (the local shards, counted
exactly) at 1, 2 and 4 ranks, against 1/N of the whole, drawn to
``memory_fsdp.png``.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DataParallel, DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result, compare
from benchmarks.timing import fixed_threads, interleave
from stratagem.meshes import device_mesh

NAME = "memory"
DESCRIPTION = "Peak tensor memory per rank (CPU allocator events): built-ins vs hand-written loops."
TARGET = 1.01
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Config:
    widths: tuple[int, ...] = (512, 2048, 512)
    batch: int = 64  # per rank
    steps: int = 3
    runs: int = 11  # per side, alternating; the cleanest run is compared (see the method)


Recorded = tuple[int, int]
"""One run: (peak bytes, bytes unreleased at the end)."""
Pair = tuple[str, list[Recorded], list[Recorded]]
"""A pair's name, then each of its runs: through stratagem, by hand."""


def recorded_peak(run: Callable[[], None]) -> Recorded:
    """Peak of the tensor storage recorded during ``run()``, and what is unreleased at the end."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        run()
        gc.collect()  # tensors only reference cycles held are freed inside the record
    events = [e for e in recorded.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, live


def runs_of(
    ours: Callable[[], None], theirs: Callable[[], None], runs: int
) -> tuple[list[Recorded], list[Recorded]]:
    """``runs`` runs of each side, alternating (the order flipping every round)."""
    return interleave(
        lambda: recorded_peak(ours), lambda: recorded_peak(theirs), rounds=runs, warmup=0
    )


def cleanest(runs: list[Recorded]) -> Recorded:
    """The run with the fewest bytes unreleased (the fewest lost frees), then the lowest peak."""
    return min(runs, key=lambda run: (run[1], run[0]))


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


def through(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> Callable[[], None]:
    def run() -> None:
        model = strategy.wrap(steps.copies(lambda: steps.mlp(*config.widths), 1)[0], ctx)
        optimizer = adamw(model)
        batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1], 1 + ctx.rank)
        for _ in range(config.steps):
            loss = strategy.step(model, batch, ctx, forward=steps.mse)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)

    return run


def by_hand(
    prepare: Callable[[torch.nn.Module], torch.nn.Module],
    ctx: sg.Context,
    config: Config,
    after_backward: Callable[[torch.nn.Module], None] = lambda model: None,
) -> Callable[[], None]:
    def run() -> None:
        model = prepare(steps.copies(lambda: steps.mlp(*config.widths), 1)[0])
        optimizer = adamw(model)
        batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1], 1 + ctx.rank)
        for _ in range(config.steps):
            steps.mse(model, batch).backward()
            after_backward(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def horovod_by_hand(ctx: sg.Context) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The Horovod loop as one writes it: broadcast once, all-reduce each gradient in place."""

    def prepare(model: torch.nn.Module) -> torch.nn.Module:
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0, group=ctx.group)
        return model

    def average(model: torch.nn.Module) -> None:
        for param in model.parameters():
            assert param.grad is not None
            param.grad.div_(ctx.world_size)
            dist.all_reduce(param.grad, group=ctx.group)

    return prepare, average


def on_ranks(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> list[Pair]:
    """Peak per rank of (stratagem, by hand) for ddp(), fsdp(), allreduce_grads()."""
    group = ctx.group
    prepare, average = horovod_by_hand(ctx)
    pairs: list[tuple[str, Callable[[], None], Callable[[], None]]] = [
        (
            "ddp() vs DistributedDataParallel",
            through(sg.ddp(), ctx, config),
            by_hand(lambda m: DistributedDataParallel(m, process_group=group), ctx, config),
        ),
        (
            "fsdp() vs fully_shard",
            through(sg.fsdp(), ctx.with_extras(mesh=device_mesh(ctx)), config),
            by_hand(lambda m: fully_shard(m), ctx, config),
        ),
        (
            "allreduce_grads() vs Horovod loop by hand (in-place all-reduce per parameter)",
            through(sg.allreduce_grads(), ctx, config),
            by_hand(prepare, ctx, config, average),
        ),
    ]
    out = []
    with fixed_threads():
        for name, ours, theirs in pairs:
            out.append((name, *runs_of(ours, theirs, config.runs)))
    return out


def in_one_process(
    name: str,
    strategy: sg.StrategyLike,
    prepare: Callable[[torch.nn.Module], torch.nn.Module],
    config: Config,
) -> Pair:
    """Peak of (stratagem, by hand) for a strategy that runs in this process."""
    ctx = strategy.setup(sg.Env())
    with fixed_threads():
        ours, theirs = runs_of(
            through(strategy, ctx, config), by_hand(prepare, ctx, config), config.runs
        )
    strategy.teardown(ctx)
    return name, ours, theirs


def single(config: Config) -> Pair:
    return in_one_process(
        "single_device() vs plain loop", sg.single_device("cpu"), lambda m: m, config
    )


def data_parallel(config: Config) -> list[Pair]:
    """``dp()`` against ``DataParallel`` by hand, on a machine without CUDA (else no pair).

    Without CUDA both call the module as it is. With it, ``dp()`` would train on
    the GPUs, whose memory the CPU allocator's events do not see.
    """
    if torch.cuda.is_available():
        return []
    name = "dp() vs DataParallel (no CUDA: DataParallel calls the module itself)"
    return [in_one_process(name, sg.dp(), DataParallel, config)]


HSDP = (2, 2)  # (replicate, shard): 4 ranks, the smallest world where both dimensions are real


def hsdp_ranks(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> Pair:
    """Peak of ``hsdp()`` against ``fully_shard`` by hand over a 2-D mesh it builds itself."""
    from torch.distributed.device_mesh import init_device_mesh

    # Built before either side is measured, as hsdp()'s setup built its mesh.
    mesh = init_device_mesh("cpu", HSDP, mesh_dim_names=("replicate", "shard"))
    with fixed_threads():
        ours, theirs = runs_of(
            through(strategy, ctx, config),
            by_hand(lambda m: fully_shard(m, mesh=mesh), ctx, config),
            config.runs,
        )
    replicate, shard = HSDP
    name = (
        f"hsdp(replicate={replicate}, shard={shard}) vs fully_shard on a "
        f"(replicate, shard) = {HSDP} mesh"
    )
    return name, ours, theirs


def local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.numel() * local.element_size())


def fsdp_state(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> dict[str, int]:
    """Bytes of parameters, gradients and AdamW state this rank holds after one step."""
    model = strategy.wrap(steps.copies(lambda: steps.mlp(*config.widths), 1)[0], ctx)
    optimizer = adamw(model)
    batch = steps.random_batch(config.batch, config.widths[0], config.widths[-1], 1 + ctx.rank)
    loss = strategy.step(model, batch, ctx, forward=steps.mse)
    strategy.backward(loss, model, ctx)
    grads = sum(local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    strategy.update(optimizer, model, ctx)
    params = sum(local_bytes(p) for p in model.parameters())
    state = sum(
        local_bytes(value)
        for entry in optimizer.state.values()
        for value in entry.values()
        if isinstance(value, torch.Tensor)
    )
    return {"params": params, "grads": grads, "optimizer": state}


def whole_state(config: Config) -> int:
    """Parameters + gradients + AdamW's two moments (and its step counters), unsharded."""
    model = steps.mlp(*config.widths)
    numel = sum(p.numel() for p in model.parameters())
    return 4 * numel * 4 + 4 * len(list(model.parameters()))  # float32; step scalars


def draw(rows: list[dict[str, Any]], out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ranks = [row["ranks"] for row in rows]
    figure, axis = plt.subplots(figsize=(6, 4))
    mib = 2**20
    axis.plot(ranks, [row["per_rank"] / mib for row in rows], "o-", label="fsdp(): held per rank")
    axis.plot(ranks, [row["ideal"] / mib for row in rows], "k--", label="1/N of the whole")
    axis.set_xscale("log", base=2)
    axis.set_xticks(ranks, [str(r) for r in ranks])
    axis.set_xlabel("ranks (N)")
    axis.set_ylabel("MiB: params + grads + AdamW state")
    axis.set_title("fsdp() state per rank, MLP 512-2048-512")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out


def run(quick: bool = False) -> Result:
    config = Config(runs=3) if quick else Config()
    cases: list[Case] = []
    measured = [single(config), *data_parallel(config)]
    ranks = sg.launch(on_ranks, sg.ddp_spawn(), devices=2, args=(config,))
    measured += [(f"{name}, rank 0", o, t) for name, o, t in ranks[0]]
    measured += [(f"{name}, rank 1", o, t) for name, o, t in ranks[1]]
    hybrid = sg.spawned(sg.hsdp(replicate=HSDP[0], shard=HSDP[1]))
    hsdp = sg.launch(hsdp_ranks, hybrid, devices=HSDP[0] * HSDP[1], args=(config,))
    measured += [(f"{name}, rank {rank}", o, t) for rank, (name, o, t) in enumerate(hsdp)]
    for name, ours, theirs in measured:
        (ours_peak, ours_left), (their_peak, their_left) = cleanest(ours), cleanest(theirs)
        notes = (
            f"cleanest of {len(ours)} runs each, unreleased {ours_left} vs {their_left} B; "
            f"all peaks {min(p for p, _ in ours)}..{max(p for p, _ in ours)} vs "
            f"{min(p for p, _ in theirs)}..{max(p for p, _ in theirs)} B"
        )
        least = [float(ours_peak)], [float(their_peak)]
        cases.append(compare(name, "B", *least, target=TARGET, notes=notes))
    whole = whole_state(config)
    rows = []
    for count in (1, 2, 4):
        states = sg.launch(fsdp_state, sg.fsdp_spawn(), devices=count, args=(config,))
        per_rank = max(sum(state.values()) for state in states)
        rows.append(
            {"ranks": count, "per_rank": per_rank, "ideal": whole / count, "states": states}
        )
        cases.append(
            compare(
                f"fsdp() params+grads+AdamW per rank (largest rank), {count} rank(s), vs 1/N",
                "B",
                [float(per_rank)],
                [whole / count],
                notes=f"whole {whole} B; per rank {[sum(s.values()) for s in states]}",
            )
        )
    out = RESULTS / "quick" if quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_fsdp.json").write_text(json.dumps(rows, indent=2) + "\n")
    draw(rows, out / "memory_fsdp.png")
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={**config.__dict__, "optimizer": "AdamW", "method": "torch.profiler [memory]"},
        cases=cases,
        quick=quick,
    )
