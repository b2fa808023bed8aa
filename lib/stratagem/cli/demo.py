"""``stratagem demo``: train a classifier with a built-in strategy, optionally against one process.

Every choice on the command line is checked here, before a process starts,
so that a mistake is one line of error instead of a traceback from a rank.
The training itself is `stratagem.cli.classifier.train`, plain user code.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.cli import data as datasets
from stratagem.cli import plot
from stratagem.cli.classifier import Config, Result, train
from stratagem.cli.escaping import printable
from stratagem.cli.progress import table
from stratagem.combinators.accumulation import accumulate
from stratagem.combinators.precision import with_precision
from stratagem.devices import cuda_device_count
from stratagem.env import Env, detect_env
from stratagem.errors import UsageError
from stratagem.launching import launch
from stratagem.precisions import PRECISIONS
from stratagem.strategies.allreduce import allreduce_grads_spawn
from stratagem.strategies.ddp import ddp_spawn
from stratagem.strategies.dp import dp
from stratagem.strategies.fsdp import fsdp_spawn
from stratagem.strategies.single import single_device
from stratagem.strategy import Strategy

__all__ = ["STRATEGIES", "configure", "run", "spawn_devices"]

STRATEGIES = ("single", "ddp", "fsdp", "dp", "allreduce")
SPAWNING: dict[str, Callable[[], Strategy]] = {
    "ddp": ddp_spawn,
    "fsdp": fsdp_spawn,
    "allreduce": allreduce_grads_spawn,
}


def positive_int(text: str) -> int:
    """Parse a positive integer argument (argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options to its subcommand parser."""
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp",
        help="single_device(), ddp_spawn(), fsdp_spawn(), dp() or "
        "allreduce_grads_spawn() (default: ddp)",
    )
    parser.add_argument(
        "--devices",
        type=positive_int,
        default=None,
        metavar="N",
        help="ranks to spawn (ddp, fsdp, allreduce; default 2), or GPUs for dp",
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="apply with_precision (default: none, float32)",
    )
    parser.add_argument("--epochs", type=positive_int, default=10, metavar="N", help="default: 10")
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=32,
        metavar="N",
        help="samples per rank and step (default: 32)",
    )
    parser.add_argument(
        "--accumulate",
        type=positive_int,
        default=1,
        metavar="K",
        help="apply accumulate(K): one optimizer step per K micro-batches",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="save a checkpoint into DIR at the end of every epoch",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in --checkpoint DIR"
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also train single_device() on the same global batches and "
        "print the largest parameter difference",
    )
    parser.add_argument(
        "--data",
        choices=datasets.DATASETS,
        default="digits",
        help="digits (scikit-learn's, shipped in its wheel) or synthetic",
    )
    parser.add_argument(
        "--plot",
        metavar="PATH.png",
        default=None,
        help="write the loss curves of the run (and of --compare's) to a PNG (needs matplotlib)",
    )


def spawn_devices(requested: int | None, *, cuda_devices: int | None = None) -> int:
    """Return the ranks to spawn for ``--devices``, as the library's ``device="auto"`` places them.

    A rank per CUDA device where there are enough (2 by default, or fewer GPUs);
    beyond them every rank runs on the CPU (the launch warns:
    `stratagem.DeviceFallbackWarning`), so at most one rank per CPU core.

    Raises:
        UsageError: more ranks than this machine can run.
    """
    gpus = cuda_device_count() if cuda_devices is None else cuda_devices
    cores = os.cpu_count() or 1
    if requested is None:
        return min(2, gpus) if gpus else min(2, cores)
    limit = max(gpus, cores)
    if requested > limit:
        why = "one per CUDA device" if gpus >= cores else "one per CPU core"
        raise UsageError(
            f"--devices {requested}: this machine runs at most {limit} ranks ({why}); "
            f"pass --devices {limit} or fewer."
        )
    return requested


def _strategy(options: argparse.Namespace, env: Env) -> tuple[Strategy, int]:
    """Return the strategy the options name and the number of processes to launch on this host."""
    name, devices = options.strategy, options.devices
    if env.is_distributed:  # torchrun or SLURM started the processes: run in place in each
        if name not in SPAWNING:
            raise UsageError(
                f"--strategy {name} runs one process, but {env.source} started "
                f"{env.world_size}; use --strategy ddp, fsdp or allreduce."
            )
        if devices not in (None, env.local_world_size):
            raise UsageError(
                f"--devices {devices}: {env.source} started {env.local_world_size} process(es) "
                f"on this node; leave --devices out or pass --devices {env.local_world_size}."
            )
        return SPAWNING[name](), env.local_world_size
    if name in SPAWNING:
        return SPAWNING[name](), spawn_devices(devices)
    if name == "single":
        if devices not in (None, 1):
            raise UsageError(
                f"--devices {devices}: single_device() trains in one process on one device; "
                "pass --devices 1, or --strategy ddp to spawn ranks."
            )
        return single_device(), 1
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is not None and devices > max(gpus, 1):
        has = f"it has {gpus} CUDA device(s)" if gpus else "without CUDA it runs on the CPU"
        raise UsageError(
            f"--devices {devices}: dp() drives this machine's GPUs from one process, and {has}; "
            f"pass --devices {max(gpus, 1)} or fewer."
        )
    ids = list(range(devices)) if gpus and devices is not None else None
    return dp(device_ids=ids), 1


def _combined(strategy: Strategy, options: argparse.Namespace) -> Strategy:
    if options.precision is not None:
        strategy = with_precision(strategy, options.precision)
    if options.accumulate > 1:
        strategy = accumulate(strategy, options.accumulate)
    return strategy


def _check_precision(precision: str | None) -> None:
    """Refuse a precision this machine cannot run, as the ranks' own setup would."""
    if precision is not None:
        with_precision(single_device(), precision).setup(Env())  # type: ignore[arg-type]


def _describe_checkpoint(path: Path) -> Any:
    from stratagem import checkpoint

    describe = getattr(checkpoint, "describe", None)
    if describe is None:
        raise UsageError(
            "--resume: this version of stratagem cannot inspect checkpoints yet; "
            "leave --resume out."
        )
    return describe(path)


def _check_writable(path: Path) -> None:
    """Refuse a checkpoint directory a save could not write into, before any epoch is trained.

    A save creates the missing parents of ``path`` and writes beside it
    (``path.tmp-*``) before renaming into place, and removes the previous
    checkpoint's files from inside ``path``: both places must take a new entry.
    """
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(
            f"--checkpoint {path}: {str(parent)!r} is not a directory, so no checkpoint can be "
            "saved under it; choose a DIR inside a directory."
        )
    for place in (parent, *([path] if path.is_dir() else [])):
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".stratagem-probe-", dir=place))
        except OSError as error:
            raise UsageError(
                f"--checkpoint {path}: cannot write in {str(place)!r} ({error.strerror}), where "
                "every save writes; choose a writable directory, or make this one writable."
            ) from None


def _check_checkpoint(options: argparse.Namespace) -> str | None:
    """Refuse a checkpoint directory the run could not use; return a note to show, if any."""
    from stratagem.checkpoint import CheckpointError

    if options.checkpoint is None:
        if options.resume:
            raise UsageError("--resume needs --checkpoint DIR, the directory to resume from.")
        return None
    path = Path(options.checkpoint)
    if not options.resume and (not path.exists() or (path.is_dir() and not any(path.iterdir()))):
        _check_writable(path)
        return None
    try:
        saved = _describe_checkpoint(path)
    except FileNotFoundError:
        raise UsageError(
            f"--resume: there is no checkpoint in {str(path)!r}; run once with "
            f"--checkpoint {path} (without --resume) first."
        ) from None
    except CheckpointError as error:
        raise UsageError(
            f"--checkpoint {path}: {printable(error)} Choose another directory, or remove it."
        ) from None
    precision = options.precision or "32-true"
    for flag, asked in (("data", options.data), ("precision", precision)):
        used = saved.values.get(flag)
        if options.resume and used != asked:
            used = printable(used)  # from the file: shown, never obeyed
            raise UsageError(
                f"--resume: the checkpoint in {str(path)!r} was trained with --{flag} {used}, "
                f"not {asked}; pass --{flag} {used}."
            )
    trained = saved.values.get("epoch")
    if not (options.resume and isinstance(trained, int) and trained >= options.epochs):
        _check_writable(path)  # some epoch will be trained, and saved at its end
    if options.resume:
        return None
    return f"note: starting afresh; the checkpoint in {path} will be replaced (--resume continues)"


def _check_steps(options: argparse.Namespace, data: datasets.Data, world: int) -> None:
    """Refuse a batch size or accumulation under which an epoch makes no optimizer step.

    Each rank takes whole batches of its share (``len // world`` samples), and the
    optimizer steps once per ``--accumulate`` of them (see `stratagem.cli.classifier.train`).
    """
    samples = len(data.train_inputs)
    share = samples // world
    batches = share // options.batch_size
    if batches >= options.accumulate:
        return
    dealt = f"the {samples} training samples of --data {data.name} on {world} rank(s)"
    if batches == 0:
        fix = f"pass --batch-size {share} or less" if share else "use fewer ranks"
        raise UsageError(
            f"--batch-size {options.batch_size}: {dealt} give each rank {share}, not one whole "
            f"batch, so no optimizer step would run; {fix}."
        )
    raise UsageError(
        f"--accumulate {options.accumulate}: {dealt} make {batches} batches of "
        f"{options.batch_size} per rank and epoch, fewer than one accumulation window, so no "
        f"optimizer step would run; pass --accumulate {batches} or less, or a smaller "
        "--batch-size."
    )


def _row(strategy: Strategy, world: int, precision: str, result: Result) -> dict[str, str]:
    return {
        "strategy": strategy.name,
        "world size": str(world),
        "precision": precision,
        "final loss": f"{result.loss:.4f}",
        "test accuracy": f"{result.accuracy:.1%}",
        "samples/s": f"{result.samples_per_s:,.0f}" if result.samples_per_s else "-",
    }


def _largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


def run(options: argparse.Namespace) -> int:
    """Run ``stratagem demo`` with parsed ``options``; return the exit code.

    Raises:
        UsageError: an option this machine or this checkpoint cannot honour.
        RankError: training failed on a rank.
    """
    env = detect_env(os.environ)
    if options.compare and env.is_distributed:
        raise UsageError(
            f"--compare trains single_device() in this process, which {env.source} started as "
            "one rank of many; run --compare outside torchrun/SLURM."
        )
    strategy, devices = _strategy(options, env)
    strategy = _combined(strategy, options)
    world = env.world_size if env.is_distributed else devices if options.strategy in SPAWNING else 1
    precision = options.precision or "32-true"
    _check_precision(options.precision)
    note = _check_checkpoint(options)
    plot_path = None if options.plot is None else plot.check(options.plot)
    data = datasets.load(options.data)
    _check_steps(options, data, world)
    config = Config(
        epochs=options.epochs,
        batch_size=options.batch_size,
        accumulate=options.accumulate,
        checkpoint=options.checkpoint,
        resume=options.resume,
        labels={"precision": precision},
    )
    main = env.rank == 0
    if main:
        print(
            f"stratagem demo: {strategy.name} on {world} rank(s), {data.name} "
            f"({len(data.train_inputs)} train / {len(data.test_inputs)} test samples), "
            f"{options.epochs} epochs, batch {options.batch_size} per rank",
            flush=True,
        )
        if note:
            print(note, flush=True)
    result = launch(train, strategy, devices=devices, args=(data, config))[0]
    rows = [_row(strategy, world, precision, result)]
    curves = {f"{strategy.name} ({world} rank{'s' if world > 1 else ''})": result.curve}
    difference = None
    if options.compare:
        print("comparing: single_device() on the same global batches ...", flush=True)
        reference = _combined(single_device(), options)
        alone = attrs.evolve(
            config, batch_size=config.batch_size * world, checkpoint=None, resume=False, shown=False
        )
        expected = launch(train, reference, args=(data, alone))[0]
        rows.append(_row(reference, 1, precision, expected))
        curves[f"{reference.name} (same global batches)"] = expected.curve
        assert result.parameters is not None  # rank 0's result holds them
        assert expected.parameters is not None
        difference = _largest_difference(result.parameters, expected.parameters)
    if main:
        print()
        print(table(rows))
        if difference is not None:
            why = "" if precision in ("32-true", "64-true") else f" ({precision} rounds more)"
            print(f"largest parameter difference vs single_device(): {difference:.3g}{why}")
        if plot_path is not None:
            title = f"stratagem demo: {data.name}, batch {options.batch_size} per rank, {precision}"
            plot.write(plot_path, curves, title)
            print(f"loss curves: {plot_path}")
    return 0
