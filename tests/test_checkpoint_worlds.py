"""Checkpoints across worlds: a portability matrix, and resumes that equal uninterrupted runs bit for bit.

Launches are grouped to keep the 2-rank worlds few. Per strategy, phase A
(in one world) saves the matrix checkpoint and runs the uninterrupted and the
saving training; phase B (in fresh processes) loads every matrix checkpoint
and resumes from the saved ones.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import random

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.sharding import shard_loader

pytestmark = pytest.mark.slow

# Adding a strategy to the matrix is one line here (name -> factory of a spawning strategy).
MATRIX = {
    "single_device": lambda: sg.single_device("cpu"),
    "ddp": sg.ddp_spawn,
    "fsdp": sg.fsdp_spawn,
}
DEVICES = {"single_device": 1, "ddp": 2, "fsdp": 2}
RESUMED = ("single_device", "ddp")  # strategies whose resumes must equal uninterrupted runs

STEPS = 13
SAVES = (7, 10)  # mid-epoch on 1 and 2 ranks; 10 also ends an epoch on both
DATA = 40
BATCH = 4


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    )


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(11)
    data = TensorDataset(
        torch.randn(DATA, 6, generator=generator), torch.randn(DATA, 2, generator=generator)
    )
    return DataLoader(
        data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3)
    )


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Full (unsharded) parameters and optimizer state, keyed by name, on every rank."""
    options = StateDictOptions(full_state_dict=True)
    plain = sg.unwrap(model)
    params = get_model_state_dict(plain, options=options)
    optim = get_optimizer_state_dict(plain, optimizer, options=options)
    flat: dict[str, object] = {f"param/{k}": v.detach().clone() for k, v in params.items()}
    for name, state in optim["state"].items():
        for key, value in state.items():
            flat[f"optim/{name}/{key}"] = (
                value.detach().clone() if isinstance(value, torch.Tensor) else value
            )
    flat["optim/param_groups"] = [dict(g) for g in optim["param_groups"]]
    return flat


def assert_identical(ours: dict[str, object], theirs: dict[str, object], what: str) -> None:
    assert ours.keys() == theirs.keys(), what
    for key, value in ours.items():
        other = theirs[key]
        if isinstance(value, torch.Tensor):
            assert isinstance(other, torch.Tensor) and value.dtype == other.dtype, f"{what}: {key}"
            assert torch.equal(value, other), f"{what}: {key} differs"
        else:
            assert value == other, f"{what}: {key}"


# --- the portability matrix -------------------------------------------------------------------


def matrix_save(strategy, ctx, name: str, path: str) -> dict[str, object]:
    seed = sorted(MATRIX).index(name) + 1  # each strategy saves different numbers
    model = strategy.wrap(make_model(seed), ctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * seed)
    for _ in range(2):
        loss = strategy.step(model, torch.randn(8, 6), ctx).pow(2).mean()
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    strategy.save(path, {"model": model, "optim": optimizer, "saved_by": name}, ctx)
    return snapshot(model, optimizer)


def matrix_load(strategy, ctx, paths: dict[str, str]) -> dict[str, object]:
    loaded = {}
    for saver, path in paths.items():
        model = strategy.wrap(make_model(99), ctx)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.5)
        values = strategy.load(path, {"model": model, "optim": optimizer}, ctx)
        assert values == {"saved_by": saver}
        loaded[saver] = snapshot(model, optimizer)
    return loaded


# --- resume equivalence -----------------------------------------------------------------------


def seed_everything(rank: int) -> None:
    # Ranks differ on purpose: restoring rank 1's generators into rank 0 would show.
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)


def forward(module: torch.nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    jitter = random.random() + float(np.random.rand())  # Python's and NumPy's generators
    noise = 0.01 * jitter * torch.randn_like(targets)  # torch's, as dropout is
    return torch.nn.functional.mse_loss(module(inputs) + noise, targets)


def batches(loader):
    while True:
        yield from loader


def training(strategy, ctx, model_seed: int):
    model = strategy.wrap(make_model(model_seed), ctx)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = shard_loader(make_loader(), ctx)  # what ddp's shard field does; usable on one rank too
    state = {"model": model, "optim": optimizer, "schedule": schedule, "loader": loader}
    return model, optimizer, state


def train_steps(
    strategy, ctx, model, optimizer, state, stream, first: int, last: int, save_to=None
):
    for step in range(first, last):
        loss = strategy.step(model, next(stream), ctx, forward=forward)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        state["schedule"].step()
        if save_to is not None and step + 1 in SAVES:
            strategy.save(save_to[step + 1], {**state, "step": step + 1}, ctx)


def resume_phase_a(strategy, ctx, paths: dict[int, str]) -> dict[str, object]:
    """The uninterrupted run, and the same run saving on the way (which must not change it)."""
    seed_everything(ctx.rank)
    model, optimizer, state = training(strategy, ctx, 7)
    train_steps(strategy, ctx, model, optimizer, state, batches(state["loader"]), 0, STEPS)
    uninterrupted = snapshot(model, optimizer)
    seed_everything(ctx.rank)
    model, optimizer, state = training(strategy, ctx, 7)
    train_steps(strategy, ctx, model, optimizer, state, batches(state["loader"]), 0, STEPS, paths)
    return {"uninterrupted": uninterrupted, "saving": snapshot(model, optimizer)}


def resume_phase_b(strategy, ctx, paths: dict[int, str]) -> dict[int, dict[str, object]]:
    """Resume from each saved step in this (fresh) process and finish the run."""
    resumed = {}
    for step, path in paths.items():
        seed_everything(ctx.rank + 50)  # a different start: the checkpoint must restore it all
        model, optimizer, state = training(strategy, ctx, 123)
        values = strategy.load(path, state, ctx)
        assert values == {"step": step}
        stream = batches(state["loader"])
        train_steps(strategy, ctx, model, optimizer, state, stream, step, STEPS)
        resumed[step] = snapshot(model, optimizer)
    return resumed


# --- the worlds -------------------------------------------------------------------------------


def phase_a(strategy, ctx, name, matrix_path, resume_paths):
    out = {"matrix": matrix_save(strategy, ctx, name, matrix_path)}
    if resume_paths:
        out["resume"] = resume_phase_a(strategy, ctx, resume_paths)
    return out


def phase_b(strategy, ctx, matrix_paths, resume_paths):
    out = {"matrix": matrix_load(strategy, ctx, matrix_paths)}
    if resume_paths:
        out["resume"] = resume_phase_b(strategy, ctx, resume_paths)
    return out


def launch_single(fn, args):
    return sg.launch(fn, sg.single_device("cpu"), args=args)


def available(name: str) -> bool:
    try:
        MATRIX[name]()
    except AttributeError:  # a strategy not built yet
        return False
    return True


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    root = tmp_path_factory.mktemp("worlds")
    names = [n for n in MATRIX if available(n)]
    matrix_paths = {n: str(root / f"matrix-{n}") for n in names}
    resume_paths = {n: {k: str(root / f"resume-{n}-{k}") for k in SAVES} for n in RESUMED}
    a, b = {}, {}
    for name in names:
        args = (name, matrix_paths[name], resume_paths.get(name))
        if DEVICES[name] == 1:  # phase A in this process; only the loading must be fresh
            a[name] = launch_single(phase_a, args)
        else:
            a[name] = sg.launch(phase_a, MATRIX[name](), devices=DEVICES[name], args=args)
    for name in names:
        args = (matrix_paths, resume_paths.get(name))
        if DEVICES[name] == 1:
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
                b[name] = pool.submit(launch_single, phase_b, args).result(timeout=300)
        else:
            b[name] = sg.launch(phase_b, MATRIX[name](), devices=DEVICES[name], args=args)
    return names, a, b


def test_every_strategy_loads_every_strategys_checkpoint_exactly(worlds):
    names, saved, loaded = worlds
    assert {"single_device", "ddp"} <= set(names)
    for loader in names:
        for rank, result in enumerate(loaded[loader]):
            for saver in names:
                expected = saved[saver][0]["matrix"]
                assert_identical(
                    result["matrix"][saver],
                    expected,
                    f"saved by {saver}, loaded by {loader} rank {rank}",
                )


def test_fsdp_is_in_the_matrix(worlds):
    names, _, _ = worlds
    if "fsdp" not in names:
        pytest.skip("stratagem has no fsdp_spawn yet")
    assert "fsdp" in names


@pytest.mark.parametrize("name", RESUMED)
def test_saving_does_not_change_the_run(worlds, name):
    _, saved, _ = worlds
    for rank, result in enumerate(saved[name]):
        assert_identical(
            result["resume"]["saving"], result["resume"]["uninterrupted"], f"rank {rank}"
        )


@pytest.mark.parametrize("name", RESUMED)
def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(worlds, name):
    _, saved, loaded = worlds
    for rank, (before, after) in enumerate(zip(saved[name], loaded[name], strict=True)):
        for step in SAVES:
            assert_identical(
                after["resume"][step],
                before["resume"]["uninterrupted"],
                f"resumed at {step}, rank {rank}",
            )
