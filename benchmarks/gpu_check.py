"""The one prepared GPU run: laws, precisions, checkpoints, worlds, the suite, a GPT step.

Run: ``python -m benchmarks.gpu_check`` (or ``nox -s gpu``) on a machine with CUDA. Without
a CUDA device it refuses in one line (exit 2). ``--device cpu`` runs the same cases on the
CPU (gloo, 2 ranks where ranks matter, a tiny GPT), which is how the script itself is tested
where there is no GPU; ``--quick`` runs the cases that fit in a test (no laws of the
distributed built-ins, no compiled GPT). Every case prints one row (the GPT step one per
side and mode) of one table; the run exits 1 if any case failed, and stops starting new
cases after ``--budget`` seconds (default 420: inside the 8 minutes a GPU command may take).

The cases, in order:

- the laws (`stratagem.testing.check_all`) of ``single_device``, ``ddp``, ``fsdp``,
  ``dp``, ``allreduce_grads``, each precision (with a ``16-mixed`` loss-scale skip) and
  ``compiled``, and ``context_parallel`` on an attention block (expected to pass under NCCL;
  gloo over CUDA tensors may lack the all-gather it needs, which the row then names); 2 ranks
  for the distributed ones: with two or more GPUs each rank takes its own and talks NCCL,
  with one GPU both share it and talk gloo over CUDA tensors;
- async tensor parallelism (`tensor_parallel(..., async_tp=True)` under `compiled`) against
  plain TP on 2 GPUs: the same losses within 1e-3 (not run on fewer GPUs);
- a CUDA -> CPU -> CUDA checkpoint, and ``single_device``'s step against a hand loop;
- worlds of every size the host allows (`benchmarks.gpu_worlds`: NCCL on ``cuda:LOCAL_RANK``,
  sizes 1 and the GPU count; on the CPU 2 gloo ranks) for ``ddp``, ``fsdp``, ``hsdp``,
  ``allreduce_grads`` and ``pipeline``: blocking and background saves at step 8, and a
  fresh world's resume to step 12 equal to the uninterrupted run, bit for bit;
- a GPT step (`benchmarks.gpt_step`) by hand, with stratagem, Lightning Fabric and
  Accelerate (when installed), eager and compiled: ms/step, ratio, tokens/s, MFU;
- the test suite (``pytest -x -q``, ``-n auto`` with pytest-xdist), bounded by what is left
  of the budget; on the CPU only with ``--suite``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

import stratagem as sg
from benchmarks import gpt_step, gpu_worlds

ROOT = Path(__file__).resolve().parent.parent
# device type -> detail for the table, or (name, detail, seconds) rows; raises on failure
Case = Callable[[str], "str | Sequence[tuple[str, str, float]]"]


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


def _laws(strategy: sg.Strategy, world_size: int = 2, **given: Any) -> str:
    # Here, not at the top: spawned ranks import this module, and need no testing kit.
    from stratagem.testing import check_all

    report = check_all(strategy, world_size=world_size, **given)
    return f"{len(report.passed)} laws passed, {len(report.skipped)} skipped"


def _tp_losses(strategy: sg.Strategy, ctx: sg.Context) -> list[float]:
    """Five steps of the mesh benchmark's blocks under ``strategy``, the losses."""
    from benchmarks import mesh_step

    config = mesh_step.Config()
    model = strategy.wrap(mesh_step.stack(config), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(5):
        shape = (config.batch, config.time, config.width)
        batch = (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
        batch = (batch[0].to(ctx.device), batch[1].to(ctx.device))
        loss = strategy.step(model, batch, ctx, forward=mesh_step.mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        losses.append(float(loss))
    return losses


def async_tp(device: str) -> str:
    """Compiled FSDP x TP on 2 GPUs, async (micro-pipelined) against plain: the same losses.

    Expected on 2 or more GPUs with NCCL: losses within 1e-3 of each other (inductor
    reorders the sums). Needs 2 CUDA devices; on fewer the row says so and passes.
    """
    if device != "cuda" or torch.cuda.device_count() < 2:
        return "not run: needs 2 CUDA devices (NCCL, symmetric memory)"
    from benchmarks import mesh_step

    plan = mesh_step.plan(mesh_step.Config())
    runs = {}
    for overlapped in (False, True):
        base = sg.fsdp_spawn(device="auto", backend="nccl")
        strategy = sg.compiled(sg.tensor_parallel(base, plan, size=2, async_tp=overlapped))
        runs[overlapped] = sg.launch(_tp_losses, strategy, devices=2)[0]
    worst = max(
        abs(a - b) / max(abs(b), 1e-6) for a, b in zip(runs[True], runs[False], strict=True)
    )
    if worst > 1e-3:
        raise AssertionError(f"async TP losses {runs[True]} differ from plain {runs[False]}")
    return f"5 compiled steps, losses within {worst:.1e} of plain TP; 2 ranks, nccl"


def context_parallel(device: str) -> str:
    """Each sequence split over 2 ranks, attention over the gathered keys and values."""
    from benchmarks.mesh_step import Block

    torch.manual_seed(0)
    batch = torch.randn(8, 8, 32, generator=torch.Generator().manual_seed(0))
    strategy = sg.context_parallel(sg.fsdp(**_ranks_setup(device)))
    return f"{_laws(strategy, module=Block(32, head=4), batch=batch)}; {_wire(device)}"


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


def float8(device: str) -> str:
    """with_float8: native float8 matmuls on a GPU of capability 8.9+, emulated elsewhere.

    The native run must train as torchao's emulation of it does (the same float8 rounding,
    other accumulation order), and pass the kit's laws with the margins derived from float8.
    """
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return "skipped: torchao is not installed (pip install 'stratagem[float8]')"
    native = device == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    if device == "cuda" and not native:
        return "skipped: float8 matmuls need compute capability 8.9 or more"
    losses = {}
    for emulate in (True, False) if native else (True,):
        strategy = sg.with_float8(sg.single_device(device), emulate=emulate)
        ctx = strategy.setup(sg.Env())
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
        )
        model = strategy.wrap(model, ctx)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1)
        for _ in range(5):
            batch = torch.randn(64, 256, generator=generator)
            loss = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).pow(2).mean())
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
        losses[emulate] = float(loss)
    if native and abs(losses[False] - losses[True]) > 0.05 * abs(losses[True]):
        raise AssertionError(f"native float8 loss {losses[False]} vs emulated {losses[True]}")
    from stratagem.testing import check_all

    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16))
    batch = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    strategy = sg.with_float8(sg.single_device(device))
    report = check_all(strategy, world_size=1, module=module, batch=batch)
    laws = f"{len(report.passed)} laws passed, {len(report.skipped)} skipped"
    mode = "native vs emulated" if native else "emulated"
    shown = ", ".join(f"{v:.4f}" for v in losses.values())
    return f"{laws}; {mode}: loss after 5 steps {shown}"


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


def world(kind: str, size: int) -> Case:
    def case(device: str) -> str:
        return gpu_worlds.check_world(kind, size, device)

    case.__name__ = f"world_{kind}_{size}"
    return case


def gpt(quick: bool) -> Case:
    def gpt_step_case(device: str) -> list[tuple[str, str, float]]:
        where = torch.device("cuda:0" if device == "cuda" else "cpu")
        found = gpt_step.run(where, compiled=not quick, quick=quick)
        note = "compiled: skipped under --quick" if quick else ""
        head = [("model", gpt_step.describe(where) + (f"; {note}" if note else ""), 0.0)]
        return head + found

    gpt_step_case.__name__ = "gpt_step"
    return gpt_step_case


def _progress(output: str) -> tuple[int, int]:
    """Tests passed and failed so far, from ``pytest -q``'s progress lines (a cut run's)."""
    marks = "".join(
        line.split(" ")[0] for line in output.splitlines() if re.fullmatch(r"[.sxXFE]+( .*)?", line)
    )
    return marks.count(".") + marks.count("X"), marks.count("F") + marks.count("E")


def suite(deadline: float, wanted: bool | None) -> Case:
    """The test suite, less this script's own tests (they run this script)."""

    def case(device: str) -> str:
        if wanted is False or (wanted is None and device != "cuda"):
            return "skipped: on the CPU only with --suite (nox -s tests runs it there)"
        left = deadline - time.monotonic()
        if left < 30:  # bounded by the budget, as a cut run is: a row that says so
            return f"not started: {left:.0f} s of the budget left (--only suite runs it alone)"
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        if importlib.util.find_spec("xdist") is not None:
            command += ["-n", "auto"]
        command += ["--ignore", "tests/test_gpu_check.py", "tests"]
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # its own process group: a cut stops its workers too
        )  # fmt: skip
        try:
            output, _ = process.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            passed, failed = _progress(output)
            if failed:
                raise AssertionError(f"{failed} failed before the cut at {left:.0f} s") from None
            return f"cut by the budget at {left:.0f} s: {passed} passed, none failed so far"
        print(output[-3000:], file=sys.stderr)
        summary = output.strip().splitlines()[-1] if output.strip() else "no output"
        if process.returncode != 0:
            raise AssertionError(f"pytest exited {process.returncode}: {summary}")
        return f"{' '.join(command[3:])}: {summary}"

    case.__name__ = "suite"
    return case


BASE: tuple[Case, ...] = (
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
    float8,
    context_parallel,
    async_tp,
    round_trip,
    step_ratio,
)
QUICK = {"loss_scale_skip", "round_trip"}  # and the worlds, and gpt_step eager


def cases(
    device: str,
    *,
    quick: bool = False,
    deadline: float = float("inf"),
    suite_wanted: bool | None = None,
) -> list[Case]:
    """Every case for ``device``, in the order they run (``quick``: the few that fit a test)."""
    base = [case for case in BASE if not quick or case.__name__ in QUICK]
    worlds = [
        world(kind, size) for size in gpu_worlds.world_sizes(device) for kind in gpu_worlds.KINDS
    ]
    return [*base, *worlds, gpt(quick), suite(deadline, suite_wanted)]


@attrs.frozen
class Row:
    case: str
    ok: bool
    seconds: float
    detail: str


def run(
    device: str,
    budget: float,
    only: set[str] | None = None,
    *,
    quick: bool = False,
    suite_wanted: bool | None = None,
) -> list[Row]:
    """Run every case (or those named in ``only``) until ``budget`` seconds have passed."""
    rows: list[Row] = []
    started = time.monotonic()
    for case in cases(device, quick=quick, deadline=started + budget, suite_wanted=suite_wanted):
        if only is not None and case.__name__ not in only:
            continue
        if time.monotonic() - started > budget:
            rows.append(Row(case.__name__, False, 0.0, "not started: out of time"))
            continue
        begin, before = time.monotonic(), len(rows)
        try:
            found, ok = case(device), True
        except Exception as error:  # a failing case is a row, and the run goes on
            found, ok = f"{type(error).__name__}: {error}".splitlines()[0][:300], False
            traceback.print_exc(file=sys.stderr)
        if isinstance(found, str):
            rows.append(Row(case.__name__, ok, time.monotonic() - begin, found))
        else:  # one row per part (the GPT step's sides)
            rows += [Row(f"{case.__name__}: {name}", ok, s, detail) for name, detail, s in found]
        for row in rows[before:]:
            mark = "ok  " if row.ok else "FAIL"
            print(f"{mark} {row.case}: {row.detail}", file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row], device: str) -> str:
    head = f"gpu_check on {device}: torch {torch.__version__}, CUDA {torch.version.cuda}"
    if device == "cuda":
        head += f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        head += f", {os.cpu_count()} CPU cores"
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
    parser.add_argument("--quick", action="store_true", help="only the cases that fit a test")
    parser.add_argument(
        "--suite",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the test suite (default: on CUDA only)",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu_check: no CUDA device here (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}; torch.cuda.is_available() is False); nothing was run.",
            file=sys.stderr,
        )
        return 2
    only = set(args.only) if args.only else None
    rows = run(args.device, args.budget, only, quick=args.quick, suite_wanted=args.suite)
    print(table(rows, args.device))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
