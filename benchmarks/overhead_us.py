"""overhead_us: what each built-in and combinator stack adds to a step, in microseconds.

In this process, on the tiny model (``Linear(16, 16)``, batch 8, SGD), whose
step is so cheap that a strategy's own work shows most. Each case interleaves
blocks of steps through a strategy with blocks of the hand-written loop that
does the same work:

- ``single_device``: the plain loop (`steps.plain_step`);
- ``ddp``, ``fsdp``, ``allreduce_grads`` on a world of one: their ``setup``
  of ``sg.Env()`` joins a one-rank gloo group in this process (an in-memory
  store, no port), and the hand-written loop trains a copy wrapped by hand
  over that group: ``DistributedDataParallel``, ``fully_shard`` on the
  strategy's mesh. One rank has nothing to all-reduce, and
  ``allreduce_grads`` sends nothing, as a loop that checks the world size
  would not: its hand-written loop is the plain one;
- ``dp``: ``DataParallel`` by hand (without CUDA it calls the module as it is);
- combinators: ``bf16-mixed`` (autocast by hand), clipping
  (``clip_grad_norm_`` by hand), accumulation over 4 micro-batches (the loss
  divided, the optimizer stepped every 4th), ``checked`` (with a reduce of the
  loss every step, a ``clone`` by hand on one rank), ``traced`` (each call
  timed and recorded by hand, to the same sink), and clipping over
  accumulation over ``ddp`` (by hand under ``DistributedDataParallel.no_sync``).

Both loops of a case drive the same module and optimizer: the strategy's wrap
of one model, which is the module itself or the torch wrapper the hand-written
loop would build (checked), so the only difference timed is the code each loop
runs. (Two copies of a model allocated apart differ by a percent or two in
step time, as much as the overhead measured.)

The cases run in twenty fresh processes, 10 rounds each: where a process's
objects fall in memory moves a ratio by a percent or two for that process's
whole life, so one process's rounds, however many, do not average it away,
and many processes of few rounds pin a ratio down better than a few of many
(five processes of 40 rounds left intervals of ±1 %). Each case is the median
added time per step (stratagem - plain, per round, over every process) and
the median ratio, with a 95 % bootstrap interval of each median; the notes
give each process's own median ratio, their median and its interval with
each process one draw (the honest one: rounds of one process are not
independent); an A/A case
(the plain loop against a second copy of it) shows what noise alone gives.
CPU time, one torch thread. Targets: at most +2 µs per step on
``single_device()``, a ratio of at most 1.01 for every built-in (issue 21)
and for each combinator alone (issue 33; ``traced`` is a debugging tool that
records each call, and the three-layer stack has no target).

A deep model (65 ``Linear(16, 16)`` layers, 130 parameter tensors, issue 36)
shows whether anything in a step costs per tensor: ``single_device`` and
clipping over ``bf16-mixed`` against the same by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DataParallel, DistributedDataParallel

import stratagem as sg
from benchmarks import steps
from benchmarks.report import Case, Result, compare
from benchmarks.single_step import autocast_step
from benchmarks.timing import bootstrap_median, fixed_threads, interleave, per_call

NAME = "overhead_us"
DESCRIPTION = (
    "Per-step overhead (µs) of every built-in and of combinator stacks vs the hand-written "
    "loop, Linear(16, 16), batch 8, in-process (distributed built-ins on a world of one)."
)
ADDED_TARGET = 2e-6  # issue 21: at most +2 µs per step on single_device()
RATIO_TARGET = 1.01  # issue 21: every built-in, on the tiny model
EVERY = 4  # micro-batches per optimizer step in the accumulation cases
MAX_NORM = 1.0
BATCH, FEATURES = 8, 16
CALLS = 48  # steps per block (a multiple of EVERY): about 12 ms of work
ROUNDS, PROCESSES = 200, 20  # rounds of every case in all, over this many fresh processes
DEPTH = 65  # layers of the deep model: 130 parameter tensors, as in issue 36's measurement

Wrap = Callable[[torch.nn.Module, sg.Context], torch.nn.Module]
WriteStep = Callable[[torch.nn.Module, torch.optim.Optimizer, torch.device], steps.Step]
WriteOurs = Callable[
    [sg.StrategyLike, sg.Context, torch.nn.Module, torch.optim.Optimizer], steps.Step
]


def discard(event: object) -> None:
    """The sink of both traced loops: recording is what is timed, not storing."""


def to_device(module: torch.nn.Module, ctx: sg.Context) -> torch.nn.Module:
    return module.to(ctx.device)


def ddp_by_hand(module: torch.nn.Module, ctx: sg.Context) -> torch.nn.Module:
    return DistributedDataParallel(module.to(ctx.device), process_group=ctx.group)


def fsdp_by_hand(module: torch.nn.Module, ctx: sg.Context) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    fully_shard(module, mesh=ctx.mesh)
    return module


def dp_by_hand(module: torch.nn.Module, ctx: sg.Context) -> torch.nn.Module:
    return DataParallel(module.to(ctx.device))


def moved(batch: steps.Batch, device: torch.device) -> steps.Batch:
    inputs, targets = batch
    return inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)


def clipped_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> steps.Step:
    """The plain step with ``clip_grad_norm_`` between backward and the optimizer step."""

    def train_step(batch: steps.Batch) -> None:
        steps.mse(model, moved(batch, device)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def accumulated_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    *,
    clip: bool = False,
) -> steps.Step:
    """One micro-batch: the loss divided by `EVERY`, the optimizer stepped on every `EVERY`-th.

    A DDP model skips its all-reduce under ``no_sync`` but for the last micro-batch.
    """
    count = itertools.count(1)
    pause = model.no_sync if isinstance(model, DistributedDataParallel) else None

    def train_step(batch: steps.Batch) -> None:
        last = next(count) % EVERY == 0
        with contextlib.nullcontext() if pause is None or last else pause():
            (steps.mse(model, moved(batch, device)) / EVERY).backward()
        if last:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return train_step


def logged_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> steps.Step:
    """The plain step, then the loss kept for logging: a reduce over a world of one is a copy."""

    def train_step(batch: steps.Batch) -> None:
        loss = steps.mse(model, moved(batch, device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.detach().clone()

    return train_step


def logged_ours(
    strategy: sg.StrategyLike,
    ctx: sg.Context,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
) -> steps.Step:
    """The strategy's step, then ``strategy.reduce(loss, "mean", ctx)`` for logging."""

    def train_step(batch: steps.Batch) -> None:
        loss = strategy.step(model, batch, ctx, forward=steps.mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        strategy.reduce(loss.detach(), "mean", ctx)

    return train_step


def traced_by_hand(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: torch.device
) -> steps.Step:
    """The plain step, each part timed and sent to `discard` as ``traced`` records it."""

    def record(field: str, tensors: Sequence[torch.Tensor], started: float, start: float) -> None:
        shapes = tuple(tuple(t.shape) for t in tensors)
        dtypes = tuple(str(t.dtype) for t in tensors)
        discard((field, 0, shapes, dtypes, started, time.perf_counter() - start))

    def train_step(batch: steps.Batch) -> None:
        started, start = time.time(), time.perf_counter()
        loss = steps.mse(model, moved(batch, device))
        record("step", batch, started, start)
        started, start = time.time(), time.perf_counter()
        loss.backward()
        record("backward", (loss,), started, start)
        started, start = time.time(), time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        record("update", (), started, start)

    return train_step


@dataclass(frozen=True)
class Contender:
    """A strategy, and the hand-written loop that does its work."""

    name: str
    strategy: Callable[[], sg.Strategy]
    by_hand: Wrap = to_device
    write_step: WriteStep = steps.plain_step
    write_ours: WriteOurs = steps.stratagem_step
    target: float | None = None
    notes: str = ""
    build: Callable[[], torch.nn.Module] = lambda: torch.nn.Linear(FEATURES, FEATURES)


def deep() -> torch.nn.Module:
    """`DEPTH` ``Linear(16, 16)`` layers with ReLU between: 2 x `DEPTH` parameter tensors."""
    return steps.mlp(*[FEATURES] * (DEPTH + 1))


def _cpu() -> sg.Strategy:
    return sg.single_device("cpu")


BUILT_INS = (
    Contender("single_device", _cpu, target=RATIO_TARGET),
    Contender("ddp, 1 rank", lambda: sg.ddp(device="cpu"), ddp_by_hand, target=RATIO_TARGET),
    Contender("fsdp, 1 rank", lambda: sg.fsdp(device="cpu"), fsdp_by_hand, target=RATIO_TARGET),
    Contender("dp", sg.dp, dp_by_hand, target=RATIO_TARGET),
    Contender(
        "allreduce_grads, 1 rank",
        lambda: sg.allreduce_grads(device="cpu"),
        target=RATIO_TARGET,
        notes="one rank sends nothing: the plain loop by hand",
    ),
)
COMBINATORS = (
    Contender(
        "with_precision(single_device, bf16-mixed)",
        lambda: sg.with_precision(_cpu(), "bf16-mixed"),
        write_step=autocast_step,
        target=RATIO_TARGET,
    ),
    Contender(
        f"with_clipping(single_device, max_norm={MAX_NORM})",
        lambda: sg.with_clipping(_cpu(), max_norm=MAX_NORM),
        write_step=clipped_step,
        target=RATIO_TARGET,
    ),
    Contender(
        f"accumulate(single_device, {EVERY})",
        lambda: sg.accumulate(_cpu(), EVERY),
        write_step=accumulated_step,
        target=RATIO_TARGET,
    ),
    Contender(
        "checked(single_device), reduce of the loss each step",
        lambda: sg.checked(_cpu()),
        write_step=logged_step,
        write_ours=logged_ours,
        target=RATIO_TARGET,
    ),
    Contender(
        "traced(single_device)",
        lambda: sg.traced(_cpu(), discard),
        write_step=traced_by_hand,
        notes="a debugging tool",
    ),
    Contender(
        f"with_clipping(accumulate(ddp, {EVERY})), 1 rank",
        lambda: sg.with_clipping(sg.accumulate(sg.ddp(device="cpu"), EVERY), max_norm=MAX_NORM),
        ddp_by_hand,
        write_step=lambda model, optimizer, device: accumulated_step(
            model, optimizer, device, clip=True
        ),
    ),
)
DEEP_MODEL = (
    Contender(
        f"single_device, deep ({2 * DEPTH} parameter tensors)",
        _cpu,
        target=RATIO_TARGET,
        build=deep,
    ),
    Contender(
        f"with_clipping(with_precision(single_device, bf16-mixed)), deep ({2 * DEPTH} tensors)",
        lambda: sg.with_clipping(sg.with_precision(_cpu(), "bf16-mixed"), max_norm=MAX_NORM),
        write_step=lambda model, optimizer, device: autocast_step(
            model, optimizer, device, clip=MAX_NORM
        ),
        target=RATIO_TARGET,
        build=deep,
    ),
)
CONTENDERS = BUILT_INS + COMBINATORS + DEEP_MODEL


def _intervals(added: list[float], ratio: list[float]) -> str:
    low, high = bootstrap_median(added)
    ratio_low, ratio_high = bootstrap_median(ratio)
    return (
        f"added 95% CI {low * 1e6:+.2f} .. {high * 1e6:+.2f} µs; "
        f"ratio 95% CI {ratio_low:.4f} .. {ratio_high:.4f}"
    )


def summarise(
    name: str,
    ours: list[float],
    plain: list[float],
    *,
    target: float | None = None,
    notes: str = "",
    added_target: float | None = None,
) -> Case:
    """`compare`, with the bootstrap intervals (and the µs target, if any) in the notes."""
    pairs = list(zip(ours, plain, strict=True))
    added, ratio = [a - b for a, b in pairs], [a / b for a, b in pairs]
    parts = [part for part in (notes, _intervals(added, ratio)) if part]
    case = compare(name, "s/step", ours, plain, target=target)
    if added_target is not None:
        met = "✓" if case.added.median <= added_target else "✗ missed"
        parts.append(f"target ≤ +{added_target * 1e6:g} µs {met}")
    return dataclasses.replace(case, notes="; ".join(parts))


def prepared(contender: Contender, strategy: sg.Strategy, ctx: sg.Context) -> torch.nn.Module:
    """The module both loops train: the strategy's wrap of one ``build()``, checked to be what
    the hand-written loop would wrap by hand (the module itself, or the same torch wrapper).
    """
    torch.manual_seed(0)
    model = strategy.wrap(contender.build(), ctx)
    by_hand = contender.by_hand(contender.build(), ctx)
    if type(model) is not type(by_hand):
        wrapped, written = type(model).__name__, type(by_hand).__name__
        raise AssertionError(f"{contender.name}: wrap gave a {wrapped}, by hand a {written}")
    return model


Series = tuple[str, list[float], list[float]]  # a case's name, then ours and plain per round


def measure(contender: Contender, rounds: int, *, control: bool = False) -> list[Series]:
    """Time ``contender`` against its hand-written loop (and, with ``control``, plain vs plain).

    Both loops drive the same module and optimizer: models allocated apart differ in step
    time by a percent or two (where their tensors fall in memory), as much as the overhead
    measured here, so only the code each loop runs differs.
    """
    # The last case's modules freed: a DDP module kept alive by its reference cycles until
    # a collection would make every later step look for it (a program without ddp does not).
    gc.collect()
    strategy = contender.strategy()
    ctx = strategy.setup(sg.Env())
    try:
        model = prepared(contender, strategy, ctx)
        optimizer = steps.sgd(model)
        ours = contender.write_ours(strategy, ctx, model, optimizer)
        plain = contender.write_step(model, optimizer, ctx.device)
        batch = steps.random_batch(BATCH, FEATURES, FEATURES)

        def block(step: steps.Step) -> Callable[[], float]:
            return per_call(lambda: step(batch), CALLS)

        ours_times, plain_times = interleave(block(ours), block(plain), rounds=rounds)
        series = [(contender.name, ours_times, plain_times)]
        if control:
            again = contender.write_step(model, optimizer, ctx.device)
            again_times, plain_times = interleave(block(again), block(plain), rounds=rounds)
            series.append((control_name(contender), again_times, plain_times))
        return series
    finally:
        strategy.teardown(ctx)


def control_name(contender: Contender) -> str:
    return f"{contender.name}: A/A control, plain vs plain"


def in_this_process(rounds: int) -> list[Series]:
    """Every case's series, measured in this process."""
    with fixed_threads():
        return [
            series
            for index, contender in enumerate(CONTENDERS)
            for series in measure(contender, rounds, control=index == 0)
        ]


def in_fresh_processes(rounds: int, processes: int) -> list[list[Series]]:
    """`in_this_process` in ``processes`` fresh Python processes, one after another.

    Where a process's objects fall in memory moves a case's ratio by a percent or
    two for its whole life (the same code measured 1.003 to 1.033 in eight
    processes), more than the rounds of one process can average away: the cases are
    measured in several, each with its own layout.
    """
    measured = f"{NAME}.in_this_process({rounds})"
    code = f"import json; from benchmarks import {NAME}; print(json.dumps({measured}))"
    root = Path(__file__).resolve().parent.parent
    path = os.pathsep.join([str(root / "lib"), str(root), os.environ.get("PYTHONPATH", "")])
    runs = []
    for _ in range(processes):
        done = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONPATH": path},
            timeout=1800,
        )
        runs.append([tuple(series) for series in json.loads(done.stdout.splitlines()[-1])])
    return runs


def cases(runs: list[list[Series]]) -> list[Case]:
    """Each case over every process's rounds, with each process's median ratio in its notes."""
    targets = {c.name: c for c in CONTENDERS}
    result = []
    for index, (name, _, _) in enumerate(runs[0]):
        ours = [t for run in runs for t in run[index][1]]
        plain = [t for run in runs for t in run[index][2]]
        medians = [
            statistics.median(a / b for a, b in zip(*run[index][1:], strict=True)) for run in runs
        ]
        contender = targets.get(name)
        notes = contender.notes if contender is not None else ""
        if len(runs) > 1:
            each = ", ".join(f"{m:.3f}" for m in medians)
            low, high = bootstrap_median(medians)
            across = (
                f"their median {statistics.median(medians):.4f} (95% CI {low:.4f} .. {high:.4f})"
            )
            notes = "; ".join(
                part for part in (notes, f"median ratio of each process: {each}; {across}") if part
            )
        result.append(
            summarise(
                name,
                ours,
                plain,
                target=contender.target if contender is not None else None,
                notes=notes,
                added_target=ADDED_TARGET if name == "single_device" else None,
            )
        )
    return result


def run(quick: bool = False) -> Result:
    rounds = 10 if quick else ROUNDS // PROCESSES
    runs = [in_this_process(rounds)] if quick else in_fresh_processes(rounds, PROCESSES)
    measured = cases(runs)
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={
            "rounds": rounds * len(runs),
            "processes": len(runs),
            "steps_per_block": CALLS,
            "model": f"Linear({FEATURES}, {FEATURES}); deep: {DEPTH} of them, ReLU between",
            "batch": BATCH,
            "optimizer": "SGD(lr=1e-4)",
            "loss": "mse",
            "world": "in-process; distributed built-ins on a one-rank gloo group",
            "models": "one per case, driven by both loops",
            "accumulate_every": EVERY,
            "max_norm": MAX_NORM,
            "clock": "process CPU time",
        },
        cases=measured,
        quick=quick,
    )
