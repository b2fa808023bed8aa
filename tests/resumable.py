"""A training run that saves every few steps and resumes from the newest checkpoint.

One function, `train`, serves the restart tests: spawned worlds import it,
and ``python tests/resumable.py ...`` runs it under torchrun. A run can be
told to lose rank 1 at a step (SIGKILL, no clean-up), during a background
save, or to stop at a signal (SIGTERM) with a final checkpoint. The first
attempt of a run leaves ``RUN_DIR/attempted``, so a restarted world (torchrun's,
or the test's) trains on instead of dying again.

Rank 0 writes ``OUT`` (``torch.save``): the final parameters, the step each
attempt resumed from, and wall-clock marks for the kill-to-resume benchmark.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.checkpoint import directory

SAMPLES = 64
BATCH_SIZE = 4  # per rank


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(SAMPLES, 8, generator=generator)
    return TensorDataset(inputs, torch.randint(0, 3, (SAMPLES,), generator=generator))


def make_model(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)
    )


def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, labels = batch
    return torch.nn.functional.cross_entropy(model(inputs), labels)


def _die_in_the_background_save(stage: str) -> None:
    # Rank 1 dies once its files are being written; rank 0 is held before it stages, so the
    # save cannot have committed.
    if stage == "writing":
        os.kill(os.getpid(), signal.SIGKILL)


def _hold(stage: str) -> None:
    if stage == "staging":
        time.sleep(1.0)


def train(
    strategy: sg.StrategyLike,
    ctx: sg.Context,
    run_dir: str,
    out: str,
    steps: int,
    every: int,
    die_at: int = 0,
    die_in_save: bool = False,
    blocking: bool = True,
    hidden: int = 16,
) -> int:
    """Train to ``steps``, saving every ``every`` steps; return the step this attempt resumed from."""
    run = Path(run_dir)
    first_attempt = not (run / "attempted").exists()
    strategy.barrier(ctx)  # every rank has looked before rank 0 marks the attempt
    if ctx.is_main:
        run.mkdir(parents=True, exist_ok=True)
        (run / "attempted").touch()
    model = strategy.wrap(make_model(hidden), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = strategy.shard(
        DataLoader(
            make_dataset(),
            batch_size=BATCH_SIZE,
            shuffle=True,
            generator=torch.Generator().manual_seed(3),
        ),
        ctx,
    )
    state: dict[str, Any] = {"model": model, "optim": optimizer, "loader": loader, "step": 0}
    started = time.time()
    step = sg.resume_or_start(run / "checkpoints", state, strategy, ctx)["step"]
    resumed_from, resumed_at = step, time.time()
    first_step_at = None
    while step < steps:
        for batch in loader:
            loss = strategy.step(model, batch, ctx, forward=loss_fn)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
            step += 1
            first_step_at = first_step_at or time.time()
            if first_attempt and step == die_at and ctx.rank == 1 and not die_in_save:
                (run / "killed_at").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if step % every == 0:
                if first_attempt and die_in_save and step == die_at:
                    directory.stage_hook = _die_in_the_background_save if ctx.rank == 1 else _hold
                state["step"] = step
                strategy.save(
                    run / "checkpoints" / f"step_{step:04d}", state, ctx, blocking=blocking
                )
            if step == steps:
                break
    if ctx.is_main:
        torch.save(
            {
                "parameters": {
                    k: v.detach().clone() for k, v in sg.unwrap(model).state_dict().items()
                },
                "resumed_from": resumed_from,
                "started": started,
                "resumed_at": resumed_at,
                "first_step_at": first_step_at,
            },
            out,
        )
    return resumed_from


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--die-at", type=int, default=0)
    parser.add_argument("--die-in-save", action="store_true")
    parser.add_argument("--background", action="store_true", help="save with blocking=False")
    parser.add_argument("--hidden", type=int, default=16)
    options = parser.parse_args(argv)
    sg.launch(
        train,
        sg.ddp(device="cpu"),
        devices="auto",
        args=(
            options.run_dir,
            options.out,
            options.steps,
            options.every,
            options.die_at,
            options.die_in_save,
            not options.background,
            options.hidden,
        ),
    )


if __name__ == "__main__":
    main(sys.argv[1:])
