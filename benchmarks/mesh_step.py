"""mesh_step: FSDP x TP on 2x2 gloo ranks, ``sg.tensor_parallel(sg.fsdp_spawn(), plan)`` vs by hand.

One launch of four gloo ranks. On each rank, transformer stacks with the same
weights: one wrapped by the strategy, the others by hand with
``parallelize_module`` on the ``"tp"`` sub-mesh and ``fully_shard`` on the
``"shard"`` one, as a hand-written FSDP x TP script does. Blocks of steps
alternate (A/B, then an A/A control of two hand-written copies); rank 0's
wall times are reported.

Memory, in two more launches, one per side, each in fresh processes: the
bytes each rank holds of parameters, gradients and AdamW state after a step
(exact, from the local shards), and the rise of the process's peak resident
set (``ru_maxrss``) from just before the model is built to after the steps.
"""

from __future__ import annotations

import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import stratagem as sg
from benchmarks.report import Result, compare
from benchmarks.timing import THREADS, fixed_threads, interleave

NAME = "mesh_step"
DESCRIPTION = "Time per FSDP x TP step on a 2x2 gloo mesh: sg.tensor_parallel(fsdp) vs by hand."
TARGET = 1.02
RANKS = 4
TP = 2


@dataclass(frozen=True)
class Config:
    width: int = 128
    depth: int = 2
    time: int = 32
    batch: int = 8  # per data-parallel rank
    steps_per_block: int = 3
    rounds: int = 30
    memory_steps: int = 3


class Block(torch.nn.Module):
    def __init__(self, width: int, head: int = 16) -> None:
        super().__init__()
        self.head = head
        self.norm = torch.nn.LayerNorm(width)
        self.q, self.k, self.v = (torch.nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = torch.nn.Linear(width, width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time_, _ = x.shape
        h = self.norm(x)
        q, k, v = (
            m(h).view(batch, time_, -1, self.head).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attended.transpose(1, 2).reshape(batch, time_, -1))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def stack(config: Config) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Block(config.width) for _ in range(config.depth)))


def plan(config: Config) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    for index in range(config.depth):
        for name in ("q", "k", "v", "up"):
            styles[f"{index}.{name}"] = ColwiseParallel()
        for name in ("o", "down"):
            styles[f"{index}.{name}"] = RowwiseParallel()
    return styles


def by_hand(module: torch.nn.Module, ctx: sg.Context, config: Config) -> torch.nn.Module:
    """What a hand-written FSDP x TP script does on the same mesh."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(module, ctx.mesh["tp"], plan(config))
    fully_shard(module, mesh=ctx.mesh["shard"])
    return module


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def batch_for(ctx: sg.Context, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    index, _ = ctx.data_parallel  # a tensor-parallel pair takes the same batch
    generator = torch.Generator().manual_seed(1 + index)
    shape = (config.batch, config.time, config.width)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def ours_step(strategy: sg.StrategyLike, ctx: sg.Context, model: torch.nn.Module) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def plain_step(model: torch.nn.Module) -> Any:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        mse(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def timed_block(step: Any, batch: Any, calls: int) -> float:
    dist.barrier()  # every rank starts the block together
    start = time.perf_counter()
    for _ in range(calls):
        step(batch)
    return (time.perf_counter() - start) / calls


def on_rank(strategy: sg.StrategyLike, ctx: sg.Context, config: Config) -> dict[str, list[float]]:
    with fixed_threads(THREADS):
        plain = plain_step(by_hand(stack(config), ctx, config))  # built first, as elsewhere
        ours = ours_step(strategy, ctx, strategy.wrap(stack(config), ctx))
        control = plain_step(by_hand(stack(config), ctx, config))
        batch = batch_for(ctx, config)
        calls = config.steps_per_block
        timings: dict[str, list[float]] = {}
        for label, first in (("stratagem", ours), ("control", control)):
            timings[label], timings[f"plain vs {label}"] = interleave(
                lambda f=first: timed_block(f, batch, calls),
                lambda: timed_block(plain, batch, calls),
                rounds=config.rounds,
            )
    return timings


def _held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    def local(tensor: torch.Tensor) -> torch.Tensor:
        to_local = getattr(tensor, "to_local", None)
        return to_local() if callable(to_local) else tensor

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [
        local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_on_rank(
    strategy: sg.StrategyLike, ctx: sg.Context, config: Config, side: str
) -> dict[str, float]:
    """One side only, in fresh processes: bytes of state held, and the peak RSS it added."""
    with fixed_threads(THREADS):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        if side == "stratagem":
            model = strategy.wrap(stack(config), ctx)
            step = ours_step(strategy, ctx, model)
        else:
            model = by_hand(stack(config), ctx, config)
            step = plain_step(model)
        batch = batch_for(ctx, config)
        for _ in range(config.memory_steps):
            step(batch)
        mse(model, batch).backward()  # gradients held too, as between backward and update
        held = _held_bytes(model, step.optimizer)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"held_bytes": float(held), "peak_rss_rise_bytes": float(after - before) * 1024}


def run(quick: bool = False) -> Result:
    config = Config(rounds=4) if quick else Config()
    strategy = sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), plan(config), size=TP)
    start = time.perf_counter()
    timings = sg.launch(on_rank, strategy, devices=RANKS, args=(config,))[0]
    elapsed = time.perf_counter() - start
    memory = {
        side: sg.launch(memory_on_rank, strategy, devices=RANKS, args=(config, side))
        for side in ("plain", "stratagem")
    }
    name = (
        f"{config.depth} blocks of width {config.width}, {config.batch}x{config.time} tokens per "
        f"data-parallel rank, 2x2 mesh"
    )
    held = {side: [r["held_bytes"] for r in results] for side, results in memory.items()}
    rss = {side: [r["peak_rss_rise_bytes"] for r in results] for side, results in memory.items()}
    cases = [
        compare(
            name,
            "s/step",
            timings["stratagem"],
            timings["plain vs stratagem"],
            target=TARGET,
            notes=f"{1 / statistics.median(timings['stratagem']):.2f} vs "
            f"{1 / statistics.median(timings['plain vs stratagem']):.2f} steps/s",
        ),
        compare(f"{name}: A/A control", "s/step", timings["control"], timings["plain vs control"]),
        compare(
            "state held per rank (parameters, gradients, AdamW)",
            "B",
            held["stratagem"],
            held["plain"],
            notes="ranks 0-3, exact",
        ),
        compare(
            "peak RSS rise per rank (fresh processes, one side each)",
            "B",
            rss["stratagem"],
            rss["plain"],
            notes="ranks 0-3; ru_maxrss",
        ),
    ]
    return Result(
        benchmark=NAME,
        description=DESCRIPTION,
        config={**asdict(config), "ranks": RANKS, "tp": TP, "launch_seconds": elapsed},
        cases=cases,
        quick=quick,
    )
