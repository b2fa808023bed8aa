"""Worlds of every size the host allows: train, save at step 8, resume in a fresh world.

For each built-in that spans ranks (``ddp``, ``fsdp``, ``hsdp``, ``allreduce_grads``,
``pipeline``) and each world size, one launch trains 12 steps and saves at step 8, once
with a blocking save and once with a background one (``blocking=False``, waited for after
the last step, so the training steps after it run while it writes); a second launch, a
fresh world, loads each step-8 checkpoint and trains to step 12. Each rank's parameters
must then equal the uninterrupted run's bit for bit.

On CUDA every rank takes ``cuda:LOCAL_RANK`` and the world talks NCCL (world sizes 1 and
the GPU count); on the CPU, 2 ranks talk gloo. Used by `benchmarks.gpu_check`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Any

import torch

import stratagem as sg

KINDS = ("ddp", "fsdp", "hsdp", "allreduce_grads", "pipeline")
MODES = ("blocking", "background")
STEPS, SAVE_AT = 12, 8
FEATURES, WIDTH = 8, 16


def world_sizes(device: str) -> list[int]:
    """The world sizes to run: 1 and every GPU on CUDA (NCCL needs a device per rank), 2 on CPU."""
    if device == "cpu":
        return [2]
    return sorted({1, torch.cuda.device_count()})


def wire(device: str) -> dict[str, Any]:
    """Device and backend of every rank: a real NCCL world on CUDA, gloo on the CPU."""
    if device == "cuda":
        return {"device": "auto", "backend": "nccl", "timeout": 120}  # auto: cuda:LOCAL_RANK
    return {"device": "cpu", "backend": "gloo", "timeout": 120}


def layers(size: int) -> int:
    """Linear+Tanh pairs in the model: at least one per pipeline stage, at least two."""
    return max(2, size)


def stages(size: int) -> tuple[tuple[str, ...], ...]:
    """``size`` contiguous stages over the model's modules (two or more modules each)."""
    names = [str(i) for i in range(2 * layers(size))]
    per = len(names) // size
    cut = [names[i * per : (i + 1) * per] for i in range(size)]
    cut[-1] += names[size * per :]
    return tuple(tuple(stage) for stage in cut)


def microbatches(size: int) -> int:
    return max(2, size)  # 1F1B needs at least as many micro-batches as stages


def strategy_for(kind: str, size: int, device: str) -> sg.Strategy:
    """The built-in ``kind`` for a world of ``size`` ranks on ``device`` (not yet spawned)."""
    options = wire(device)
    if kind == "ddp":
        return sg.ddp(**options)
    if kind == "fsdp":
        return sg.fsdp(**options)
    if kind == "hsdp":
        replicate = 2 if size % 2 == 0 else 1
        return sg.hsdp(replicate=replicate, shard=size // replicate, **options)
    if kind == "allreduce_grads":
        return sg.allreduce_grads(**options)
    if kind == "pipeline":
        return sg.pipeline(
            stages=stages(size),
            schedule="gpipe" if size == 1 else "1f1b",  # 1F1B needs two stages or more
            microbatches=microbatches(size),
            **options,
        )
    raise ValueError(f"unknown kind {kind!r}; one of {KINDS}")


def build(size: int) -> torch.nn.Sequential:
    parts: list[torch.nn.Module] = []
    for i in range(layers(size)):
        parts += [torch.nn.Linear(FEATURES if i == 0 else WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*parts)


def batch(kind: str, step: int, ctx: sg.Context) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch: every rank its own, but a pipeline's ranks all take the same one."""
    if kind == "pipeline":
        seed, rows = step, 2 * microbatches(ctx.world_size)
    else:
        seed, rows = 1000 * ctx.rank + step, 4
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(rows, FEATURES, generator=generator)
    return inputs, torch.randn(rows, WIDTH, generator=generator)


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def digest(model: torch.nn.Module) -> tuple[str, str]:
    """A hash of this rank's parameters (its own shards, its own stage) and their device."""
    sha, devices = hashlib.sha256(), set()
    for key, value in sorted(model.state_dict().items()):
        local = value.to_local() if hasattr(value, "to_local") else value  # an FSDP shard
        devices.add(str(local.device))
        sha.update(key.encode())
        sha.update(local.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16], ",".join(sorted(devices))


def _run(
    strategy: sg.StrategyLike, ctx: sg.Context, kind: str, path: str, phase: str, mode: str
) -> dict[str, str]:
    torch.manual_seed(0)
    model = strategy.wrap(build(ctx.world_size), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer}
    start, pending = 0, None
    if phase == "resume":
        sg.checkpoint.load(path, state, ctx)
        start = SAVE_AT
    for step in range(start, STEPS):
        loss = strategy.step(model, batch(kind, step, ctx), ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        if phase == "whole" and step + 1 == SAVE_AT:
            pending = sg.checkpoint.save(path, state, ctx, blocking=mode == "blocking")
    if pending is not None:
        pending.wait()  # the steps after the save ran while it wrote
    found, devices = digest(model)
    return {"digest": found, "devices": devices, "device": str(ctx.device)}


def train(
    strategy: sg.StrategyLike, ctx: sg.Context, kind: str, directory: str, phase: str
) -> dict[str, dict[str, str] | str]:
    """One rank: each save mode in turn; a mode that fails is its error, and the next runs."""
    results: dict[str, dict[str, str] | str] = {}
    for mode in MODES:
        path = os.path.join(directory, mode, f"step_{SAVE_AT}")
        try:
            results[mode] = _run(strategy, ctx, kind, path, phase, mode)
        except Exception as error:  # reported in the table; the other mode still runs
            results[mode] = f"{type(error).__name__}: {error}".splitlines()[0][:240]
    return results


def check_world(kind: str, size: int, device: str) -> str:
    """Run ``kind`` on ``size`` ranks: both save modes must resume bit for bit.

    Raises:
        AssertionError: a mode failed on some rank, or its resumed parameters differ.
    """
    strategy = sg.spawned(strategy_for(kind, size, device))
    with tempfile.TemporaryDirectory() as directory:
        whole = sg.launch(train, strategy, devices=size, args=(kind, directory, "whole"))
        resumed = sg.launch(train, strategy, devices=size, args=(kind, directory, "resume"))
    failures, digests = [], []
    for mode in MODES:
        ranks = [(r[mode], s[mode]) for r, s in zip(whole, resumed, strict=True)]
        errors = [x for pair in ranks for x in pair if isinstance(x, str)]
        if errors:
            failures.append(f"{mode}: {errors[0]}")
            continue
        pairs = [(w, r) for w, r in ranks if isinstance(w, dict) and isinstance(r, dict)]
        if any(w["digest"] != r["digest"] for w, r in pairs):
            got = [(w["digest"], r["digest"]) for w, r in pairs]
            failures.append(f"{mode}: resumed at {SAVE_AT} != uninterrupted, per rank {got}")
        wrong = [w for w in (w for w, _ in pairs) if w["devices"] != w["device"]]
        if wrong:
            failures.append(
                f"{mode}: parameters on {wrong[0]['devices']}, not {wrong[0]['device']}"
            )
        digests.append(pairs[0][0]["digest"])
    if failures:
        raise AssertionError("; ".join(failures))
    options = wire(device)
    devices = sorted({r["blocking"]["device"] for r in whole if isinstance(r["blocking"], dict)})
    return (
        f"{size} rank{'s' * (size > 1)}, {options['backend']} on {', '.join(devices)}: "
        f"saved at step {SAVE_AT} (blocking, background), a fresh world resumed to "
        f"{STEPS} == uninterrupted, bit for bit ({digests[0]})"
    )
