"""The CUDA and NCCL paths in one prepared run: laws, precisions, checkpoints, one timing.

Run: ``python -m benchmarks.gpu_check`` (or ``nox -s gpu``) on a machine with CUDA. Without
a CUDA device it refuses in one line (exit 2). ``--device cpu`` runs the same cases on the
CPU, which is how the script itself is tested where there is no GPU. Every case prints one
row; the run exits 1 if any case failed and stops starting new cases after ``--budget``
seconds (default 420, inside the 8 minutes a GPU command may take).

Multi-rank cases run 2 ranks. With two or more GPUs each rank takes its own and talks NCCL;
with one GPU both ranks share it and talk gloo over CUDA tensors (NCCL refuses two ranks on
one device); the table says which.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import attrs
import torch

import stratagem as sg
from stratagem.testing import check_all

Case = Callable[[str], str]  # device type -> detail for the table; raises on failure


def _ranks_setup(device: str) -> dict[str, Any]:
    """How 2 ranks share this machine: their device and backend."""
    if device == "cuda" and torch.cuda.device_count() >= 2:
        return {"device": "auto", "backend": "nccl"}
    if device == "cuda":
        return {"device": "cuda:0", "backend": "gloo"}
    return {"device": "cpu", "backend": "gloo"}


def _wire(device: str) -> str:
    setup = _ranks_setup(device)
    return f"2 ranks, {setup['backend']} on {setup['device']}"


def _laws(strategy: sg.Strategy, world_size: int = 2) -> str:
    report = check_all(strategy, world_size=world_size)
    return f"{len(report.passed)} laws passed, {len(report.skipped)} skipped"


def single(device: str) -> str:
    return _laws(sg.single_device(device), world_size=1)


def ddp(device: str) -> str:
    return f"{_laws(sg.ddp(**_ranks_setup(device)))}; {_wire(device)}"


def fsdp(device: str) -> str:
    return f"{_laws(sg.fsdp(**_ranks_setup(device)))}; {_wire(device)}"


def allreduce(device: str) -> str:
    return f"{_laws(sg.allreduce_grads(**_ranks_setup(device)))}; {_wire(device)}"


def dp(device: str) -> str:
    ids = list(range(torch.cuda.device_count())) if device == "cuda" else None
    return _laws(sg.dp(device_ids=ids), world_size=1)


def precision(name: str) -> Case:
    def case(device: str) -> str:
        if name == "16-mixed" and device != "cuda":
            return "skipped: a GradScaler needs CUDA"
        return _laws(sg.with_precision(sg.single_device(device), name), world_size=1)

    case.__name__ = f"precision_{name}"
    return case


def loss_scale_skip(device: str) -> str:
    """16-mixed skips the step whose gradients overflow, and the scale drops."""
    if device != "cuda":
        return "skipped: a GradScaler needs CUDA"
    strategy = sg.with_precision(sg.single_device(device), "16-mixed")
    ctx = strategy.setup(sg.Env())
    try:
        model = strategy.wrap(torch.nn.Linear(4, 1), ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = [p.detach().clone() for p in model.parameters()]
        huge = torch.full((8, 4), 6e4, device=ctx.device)  # fp16 overflows in the backward
        loss = strategy.step(model, huge, ctx, forward=lambda m, b: (m(b) ** 2).sum())
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        after = list(model.parameters())
        if not all(torch.equal(a, b) for a, b in zip(before, after, strict=True)):
            raise AssertionError("an overflowing step changed the parameters")
        return "overflowing step skipped, parameters unchanged"
    finally:
        strategy.teardown(ctx)


def compiled(device: str) -> str:
    return _laws(sg.compiled(sg.single_device(device)), world_size=1)


def round_trip(device: str) -> str:
    """A checkpoint saved on the device loads on the CPU and back, equal by key."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ckpt")
        on_device = sg.single_device(device)
        ctx = on_device.setup(sg.Env())
        model = on_device.wrap(torch.nn.Linear(4, 2), ctx)
        optimizer = torch.optim.AdamW(model.parameters())
        on_device.backward(model(torch.ones(3, 4, device=ctx.device)).sum(), model, ctx)
        on_device.update(optimizer, model, ctx)
        on_device.save(path, {"model": model, "optimizer": optimizer}, ctx)
        expected = {k: v.cpu() for k, v in model.state_dict().items()}
        on_cpu = sg.single_device("cpu")
        cpu_ctx = on_cpu.setup(sg.Env())
        cpu_model = torch.nn.Linear(4, 2)
        cpu_optimizer = torch.optim.AdamW(cpu_model.parameters())
        on_cpu.load(path, {"model": cpu_model, "optimizer": cpu_optimizer}, cpu_ctx)
        for key, value in cpu_model.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=0, atol=0)
        back = on_device.wrap(torch.nn.Linear(4, 2), ctx)
        back_path = os.path.join(directory, "back")
        back_optimizer = torch.optim.AdamW(back.parameters())
        on_cpu.save(back_path, {"model": cpu_model, "optimizer": cpu_optimizer}, cpu_ctx)
        on_device.load(back_path, {"model": back, "optimizer": back_optimizer}, ctx)
        steps = [s["step"] for s in back_optimizer.state_dict()["state"].values()]
        if [float(step) for step in steps] != [1.0] * len(expected):
            raise AssertionError(f"optimizer steps after the round trip: {steps}")
        for key, value in back.state_dict().items():
            torch.testing.assert_close(value.cpu(), expected[key], rtol=0, atol=0)
        return f"{device} -> cpu -> {device}: {len(expected)} keys equal"


def step_ratio(device: str) -> str:
    """single_device's step against the same loop by hand, synchronised, median of blocks."""
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    batch = torch.randn(64, 256)
    strategy = sg.single_device(str(dev))
    ctx = strategy.setup(sg.Env())
    wrapped = strategy.wrap(model, ctx)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=1e-3)
    on_device = batch.to(dev)

    def by_hand() -> None:
        loss = wrapped(on_device).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def by_strategy() -> None:
        loss = strategy.step(wrapped, batch, ctx, forward=lambda m, b: m(b).square().mean())
        strategy.backward(loss, wrapped, ctx)
        strategy.update(optimizer, wrapped, ctx)

    def block(fn: Callable[[], None], steps: int = 50) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        sync()
        return (time.perf_counter() - start) / steps

    for fn in (by_hand, by_strategy):
        block(fn, 10)  # warm-up
    hand, ours = [], []
    for _ in range(7):  # interleaved blocks, so drift hits both alike
        hand.append(block(by_hand))
        ours.append(block(by_strategy))
    hand.sort()
    ours.sort()
    strategy.teardown(ctx)
    return (
        f"hand {hand[3] * 1e6:.0f} us, single_device {ours[3] * 1e6:.0f} us, "
        f"ratio {ours[3] / hand[3]:.3f} (median of 7 blocks; the batch moves to the device "
        "each step under the strategy)"
    )


CASES: tuple[Case, ...] = (
    single,
    ddp,
    fsdp,
    dp,
    allreduce,
    precision("32-true"),
    precision("bf16-mixed"),
    precision("16-mixed"),
    loss_scale_skip,
    compiled,
    round_trip,
    step_ratio,
)


@attrs.frozen
class Row:
    case: str
    ok: bool
    seconds: float
    detail: str


def run(device: str, budget: float, only: set[str] | None = None) -> list[Row]:
    """Run every case (or those named in ``only``) until ``budget`` seconds have passed."""
    rows: list[Row] = []
    started = time.monotonic()
    for case in CASES:
        if only is not None and case.__name__ not in only:
            continue
        if time.monotonic() - started > budget:
            rows.append(Row(case.__name__, False, 0.0, "not started: out of time"))
            continue
        begin = time.monotonic()
        try:
            detail, ok = case(device), True
        except Exception as error:  # a failing case is a row, and the run goes on
            detail, ok = f"{type(error).__name__}: {error}".splitlines()[0][:300], False
            traceback.print_exc(file=sys.stderr)
        rows.append(Row(case.__name__, ok, time.monotonic() - begin, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {case.__name__}: {detail}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row], device: str) -> str:
    head = f"gpu_check on {device}: torch {torch.__version__}, CUDA {torch.version.cuda}"
    if device == "cuda":
        head += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    lines = [head, "", "| case | result | seconds | detail |", "| --- | --- | --- | --- |"]
    for row in rows:
        result = "ok" if row.ok else "FAIL"
        lines.append(f"| {row.case} | {result} | {row.seconds:.1f} | {row.detail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds to start cases in")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device here (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}; torch.cuda.is_available() is False); nothing was run.",
            file=sys.stderr,
        )
        return 2
    rows = run(args.device, args.budget, set(args.only) if args.only else None)
    print(table(rows, args.device))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
