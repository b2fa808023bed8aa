"""gpt_step: one GPT training step by hand, with stratagem, Lightning Fabric and Accelerate.

The model is the GPT of ``examples/gpt/train.py`` (imported from there, not copied); on a
GPU it is GPT-2 small's shape (12 layers, 12 heads, width 768, 1024 tokens, a 50304-token
vocabulary: 124M parameters with its unshared head), 16 sequences per step, bf16 autocast,
clipping to norm 1.0 and fused AdamW; on the CPU a tiny one in float32. Each side builds
its own model (the same initial weights) and optimizer in its own function, and every side
runs in this process, eager and then compiled (``torch.compile``; ``sg.compiled`` for
stratagem). Timed blocks of steps rotate between the sides, synchronised with the device;
the median block gives ms per step, the ratio to the hand-written loop, tokens/s, and MFU
against the device's dense bf16 peak (`stratagem.throughput.PEAK_FLOPS`; "n/a" for an
unknown device or the CPU). Fabric and Accelerate are optional: a side whose library is
not installed is a row saying so. Used by `benchmarks.gpu_check`; ``python -m
benchmarks.gpt_step`` prints the rows alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import stratagem as sg
from benchmarks.timing import fixed_threads
from stratagem import throughput

ROOT = Path(__file__).resolve().parent.parent
MAX_NORM = 1.0
Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], None]


@dataclasses.dataclass(frozen=True)
class Shape:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab: int
    batch: int


GPU_SHAPE = Shape(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab=50304, batch=16)
CPU_SHAPE = Shape(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab=256, batch=4)


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in TFLOPS, or None where it is not in the table."""
    return peak_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_of(name: str) -> float | None:
    """The dense bf16 peak in TFLOPS of the device called ``name``; None where unknown."""
    peak = throughput.peak_of(name)  # the library's table, which the GPT example also reads
    return None if peak is None else peak / 1e12


@cache
def example() -> ModuleType:
    """``examples/gpt/train.py``, imported by path (``examples`` is not a package)."""
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples/gpt/train.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build_model(shape: Shape) -> torch.nn.Module:
    gpt = example()
    config = gpt.Config(
        n_layer=shape.n_layer,
        n_head=shape.n_head,
        n_embd=shape.n_embd,
        block_size=shape.block_size,
        dropout=0.0,
    )
    torch.manual_seed(0)
    return gpt.GPT(config, shape.vocab)  # type: ignore[no-any-return]


def make_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.type == "cuda")


def flops_per_step(model: torch.nn.Module, shape: Shape) -> float:
    """6N per token for the matmuls of forward and backward, plus attention's (PaLM, nanoGPT)."""
    params = sum(p.numel() for p in model.parameters())
    params -= shape.block_size * shape.n_embd  # position embeddings do no matmul
    per_token = 6 * params + 12 * shape.n_layer * shape.n_embd * shape.block_size
    return float(per_token * shape.batch * shape.block_size)


def bf16(device: torch.device) -> bool:
    return device.type == "cuda"


def hand_side(shape: Shape, device: torch.device, compiled: bool) -> Step:
    """The loop a user writes without a library."""
    model = build_model(shape).to(device)
    optimizer = make_optimizer(model, device)
    forward = torch.compile(model) if compiled else model
    loss_of = example().lm_loss
    dtype = torch.bfloat16 if bf16(device) else None

    def step(batch: Batch) -> None:
        with torch.autocast(device.type, dtype, enabled=dtype is not None):
            loss = loss_of(forward, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def stratagem_side(shape: Shape, device: torch.device, compiled: bool) -> Step:
    """``with_clipping(compiled?(with_precision(single_device(...), ...)))``, as the example."""
    strategy = sg.with_precision(
        sg.single_device(str(device)), "bf16-mixed" if bf16(device) else "32-true"
    )
    if compiled:
        strategy = sg.compiled(strategy)
    strategy = sg.with_clipping(strategy, max_norm=MAX_NORM)
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(build_model(shape), ctx)
    optimizer = make_optimizer(model, device)
    loss_of = example().lm_loss

    def step(batch: Batch) -> None:
        loss = strategy.step(model, batch, ctx, forward=loss_of)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)

    return step


def fabric_side(shape: Shape, device: torch.device, compiled: bool) -> Step:
    """Lightning Fabric: ``setup``, ``backward``, ``clip_gradients``."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric  # the standalone package; ImportError: skipped

    precision = "bf16-mixed" if bf16(device) else "32-true"
    fabric = Fabric(accelerator=device.type, devices=1, precision=precision)
    model = build_model(shape)
    module, optimizer = fabric.setup(
        torch.compile(model) if compiled else model, make_optimizer(model.to(device), device)
    )
    loss_of = example().lm_loss

    def step(batch: Batch) -> None:
        loss = loss_of(module, batch)
        fabric.backward(loss)
        fabric.clip_gradients(module, optimizer, max_norm=MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def accelerate_side(shape: Shape, device: torch.device, compiled: bool) -> Step:
    """HF Accelerate: ``prepare``, ``backward``, ``clip_grad_norm_``."""
    from accelerate import Accelerator  # ImportError: skipped

    accelerator = Accelerator(
        cpu=device.type == "cpu", mixed_precision="bf16" if bf16(device) else "no"
    )
    model = build_model(shape).to(device)
    optimizer = make_optimizer(model, device)
    module, optimizer = accelerator.prepare(torch.compile(model) if compiled else model, optimizer)
    loss_of = example().lm_loss

    def step(batch: Batch) -> None:
        loss = loss_of(module, batch)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(module.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


SIDES: dict[str, Callable[[Shape, torch.device, bool], Step]] = {
    "by hand": hand_side,
    "stratagem": stratagem_side,
    "Lightning Fabric": fabric_side,
    "Accelerate": accelerate_side,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_batch(shape: Shape, device: torch.device) -> Batch:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(shape.vocab, (shape.batch, shape.block_size + 1), generator=generator)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


@dataclasses.dataclass(frozen=True)
class Timing:
    side: str
    mode: str
    seconds: float  # wall time spent on this side: building, compiling, warming up, timing
    ms: float | None = None  # median ms per step; None: skipped
    note: str = ""


def measure(
    device: torch.device, *, compiled: bool, steps: int, rounds: int, warmup: int = 3
) -> list[Timing]:
    """Time every side, blocks of ``steps`` steps rotating between them, ``rounds`` blocks each."""
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    mode = "compiled" if compiled else "eager"
    batch = random_batch(shape, device)
    ready: dict[str, Step] = {}
    spent: dict[str, float] = {}
    skipped: list[Timing] = []
    for name, make in SIDES.items():
        begin = time.perf_counter()
        try:
            step = make(shape, device, compiled)
        except ImportError as error:
            note = f"skipped: {error.name or error} is not installed"
            skipped.append(Timing(name, mode, 0.0, None, note))
            continue
        for _ in range(warmup):  # compiles, autotunes, allocates
            step(batch)
        sync(device)
        ready[name], spent[name] = step, time.perf_counter() - begin
    blocks: dict[str, list[float]] = {name: [] for name in ready}
    names = list(ready)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:  # rotate, so drift hits every side alike
            begin = time.perf_counter()
            for _ in range(steps):
                ready[name](batch)
            sync(device)
            took = time.perf_counter() - begin
            blocks[name].append(took / steps)
            spent[name] += took
    timings = [
        Timing(name, mode, spent[name], statistics.median(blocks[name]) * 1e3) for name in names
    ]
    ready.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return timings + skipped


def rows(device: torch.device, timings: list[Timing]) -> list[tuple[str, str, float]]:
    """``(name, detail, seconds)`` per side and mode: ms/step, ratio to by hand, tokens/s, MFU."""
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    flops = flops_per_step(build_model(shape), shape)
    tokens = shape.batch * shape.block_size
    peak = peak_tflops(device)
    hand = {t.mode: t.ms for t in timings if t.side == "by hand"}
    out = []
    for t in timings:
        if t.ms is None:
            out.append((f"{t.side}, {t.mode}", t.note, t.seconds))
            continue
        base = hand.get(t.mode)
        ratio = f"{t.ms / base:.3f}x by hand" if base else "by hand n/a"
        mfu = "n/a" if peak is None else f"{flops / (t.ms * 1e-3) / (peak * 1e12):.1%}"
        detail = f"{t.ms:.2f} ms/step, {ratio}, {tokens / (t.ms * 1e-3):,.0f} tokens/s, MFU {mfu}"
        out.append((f"{t.side}, {t.mode}", detail, t.seconds))
    return out


def describe(device: torch.device) -> str:
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    params = sum(p.numel() for p in build_model(shape).parameters())
    precision = "bf16 autocast" if bf16(device) else "float32"
    peak = peak_tflops(device)
    return (
        f"GPT {shape.n_layer}x{shape.n_embd} ({params / 1e6:.1f}M parameters), "
        f"{shape.batch}x{shape.block_size} tokens, {precision}, clip {MAX_NORM}, AdamW; "
        f"peak {'n/a' if peak is None else f'{peak:g} TFLOPS bf16'}"
    )


def run(device: torch.device, *, compiled: bool = True, quick: bool = False) -> list[Any]:
    """Every side eager, then (with ``compiled``) every side compiled: `rows` of both."""
    steps, rounds = (2, 3) if quick else ((10, 5) if device.type == "cuda" else (4, 5))
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # the same for every side
    # On the CPU one thread, as every CPU benchmark here: threads that spin on a shared
    # machine turn a step's time into a measure of the neighbours.
    with contextlib.nullcontext() if device.type == "cuda" else fixed_threads():
        timings = measure(device, compiled=False, steps=steps, rounds=rounds)
        if compiled:
            timings += measure(device, compiled=True, steps=steps, rounds=rounds)
    return rows(device, timings)


if __name__ == "__main__":
    where = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    print(describe(where))
    for row in run(where, compiled="--eager" not in sys.argv, quick="--quick" in sys.argv):
        print(" | ".join(str(part) for part in row))
