"""save/load in one process: round trips, plain keys, strictness, replacing, keep_last, describe."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.checkpoint import CheckpointError
from stratagem.sharding import shard_loader


@pytest.fixture
def ctx() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def net(seed: int, *, extra: bool = False, width: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(3, width), torch.nn.Linear(width, 2)]
    return torch.nn.Sequential(*layers, *([torch.nn.Linear(2, 2)] if extra else []))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = net(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    # On the CPU: DataParallel moves its module to cuda:0 on a host with CUDA.
    return all(
        torch.equal(x.cpu(), y.cpu()) for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


VALUES = {
    "step": 7,
    "config": {"lr": 0.1, "layers": [3, 4], "shape": (2, 3), "empty": {}, "none": None},
    "note": "résumé",
    "table": torch.arange(6).reshape(2, 3),
}


def test_round_trip_restores_objects_in_place_and_returns_every_plain_value(tmp_path, ctx):
    model, optimizer = trained()
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    optimizer.step()
    schedule.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    loader = shard_loader(
        DataLoader(TensorDataset(torch.arange(20)), batch_size=3, shuffle=True), ctx
    )
    next(iter(loader))
    state = {
        "model": model,
        "optim": optimizer,
        "schedule": schedule,
        "scaler": scaler,
        "loader": loader,
    }
    sg.checkpoint.save(tmp_path / "ckpt", {**state, **VALUES}, ctx)

    fresh = net(1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_state = {
        "model": fresh,
        "optim": fresh_optimizer,
        "schedule": torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=9),
        "scaler": torch.amp.GradScaler("cpu"),
        "loader": shard_loader(DataLoader(TensorDataset(torch.arange(20)), batch_size=3), ctx),
    }
    values = sg.checkpoint.load(tmp_path / "ckpt", fresh_state, ctx)

    assert values.keys() == VALUES.keys()
    assert {k: v for k, v in values.items() if k != "table"} == {
        k: v for k, v in VALUES.items() if k != "table"
    }
    assert torch.equal(values["table"], VALUES["table"])
    assert same_parameters(fresh, model)
    ours, theirs = fresh_optimizer.state_dict(), optimizer.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for index, slots in theirs["state"].items():
        assert all(torch.equal(ours["state"][index][k], v) for k, v in slots.items())
    for name in ("schedule", "scaler", "loader"):
        assert fresh_state[name].state_dict() == state[name].state_dict(), name


@pytest.mark.parametrize("wrapper", ["DataParallel", "compile"])
def test_wrapped_modules_are_saved_and_loaded_with_the_plain_keys(tmp_path, ctx, wrapper):
    def wrap(module):
        if wrapper == "DataParallel":
            return torch.nn.DataParallel(module)
        return torch.compile(
            module, backend="eager"
        )  # the wrapper is what matters; eager imports less

    model, optimizer = trained()
    sg.checkpoint.save(tmp_path / "wrapped", {"model": wrap(model), "optim": optimizer}, ctx)
    assert set(sg.checkpoint.describe(tmp_path / "wrapped").tensors) >= {
        "model/0.weight",
        "model/1.bias",
        "optim/state/0.weight/exp_avg",
    }
    plain = net(1)
    sg.checkpoint.load(
        tmp_path / "wrapped", {"model": plain, "optim": torch.optim.Adam(plain.parameters())}, ctx
    )
    assert same_parameters(plain, model)

    sg.checkpoint.save(tmp_path / "plain", {"model": model}, ctx)
    wrapped = wrap(net(2))
    sg.checkpoint.load(tmp_path / "plain", {"model": wrapped}, ctx)
    assert same_parameters(sg.unwrap(wrapped), model)


def test_strict_lists_missing_and_unexpected_keys_and_entries(tmp_path, ctx):
    model, optimizer = trained()
    sg.checkpoint.save(tmp_path / "c", {"model": model, "optim": optimizer, "step": 1}, ctx)

    bigger = net(1, extra=True)
    with pytest.raises(CheckpointError) as info:
        sg.checkpoint.load(
            tmp_path / "c",
            {
                "model": bigger,
                "schedule": torch.optim.lr_scheduler.LambdaLR(
                    torch.optim.SGD(bigger.parameters(), lr=1), lambda epoch: 1.0
                ),
            },
            ctx,
        )
    message = str(info.value)
    assert "missing from the checkpoint: model/2.weight, model/2.bias, schedule" in message
    assert "in the checkpoint but not in state: optim" in message
    assert "pass strict=False" in message
    assert same_parameters(bigger, net(1, extra=True)), "nothing is loaded when keys differ"

    smaller = torch.nn.Sequential(torch.nn.Linear(3, 4))
    with pytest.raises(
        CheckpointError, match=r"in the checkpoint but not in state: model/1\.bias, model/1\.weight"
    ):
        sg.checkpoint.load(
            tmp_path / "c", {"model": smaller, "optim": torch.optim.Adam(smaller.parameters())}, ctx
        )


def test_shapes_and_kinds_that_differ_are_errors_even_when_not_strict(tmp_path, ctx):
    model, _ = trained()
    sg.checkpoint.save(tmp_path / "c", {"model": model, "step": 1}, ctx)
    wide = net(1, width=5)
    with pytest.raises(
        CheckpointError,
        match=r"differing: model/0\.weight \(shape \(4, 3\) in the checkpoint, \(5, 3\) here\)",
    ):
        sg.checkpoint.load(tmp_path / "c", {"model": wide}, ctx, strict=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1)
    with pytest.raises(
        CheckpointError,
        match=r"differing: step \(a plain value in the checkpoint, an optimizer here\)",
    ):
        sg.checkpoint.load(tmp_path / "c", {"model": model, "step": optimizer}, ctx, strict=False)


def test_not_strict_loads_what_matches_and_logs_the_rest(tmp_path, ctx, caplog):
    model, optimizer = trained()
    sg.checkpoint.save(tmp_path / "c", {"model": model, "optim": optimizer, "step": 5}, ctx)
    bigger = net(1, extra=True)
    extra_before = bigger[2].weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="stratagem.checkpoint"):
        values = sg.checkpoint.load(tmp_path / "c", {"model": bigger}, ctx, strict=False)
    assert values == {"step": 5}
    assert torch.equal(bigger[0].weight, model[0].weight) and torch.equal(
        bigger[1].bias, model[1].bias
    )
    assert torch.equal(bigger[2].weight, extra_before)
    [record] = [r for r in caplog.records if r.name == "stratagem.checkpoint"]
    assert "missing from the checkpoint: model/2.weight, model/2.bias" in record.getMessage()
    assert "in the checkpoint but not in state: optim" in record.getMessage()


def test_saving_changes_nothing_in_the_run(tmp_path, ctx):
    model = net(0)
    optimizer = torch.optim.Adam(model.parameters())  # never stepped: DCP would initialise it
    generators = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    sg.checkpoint.save(tmp_path / "c", {"model": model, "optim": optimizer}, ctx)
    assert random.getstate() == generators[0]
    assert np.array_equal(np.random.get_state()[1], generators[1])
    assert torch.equal(torch.get_rng_state(), generators[2])
    assert not optimizer.state
    assert all(p.grad is None for p in model.parameters())


def test_load_restores_the_generators_of_the_saving_run(tmp_path, ctx):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    sg.checkpoint.save(tmp_path / "c", {}, ctx)
    expected = (random.random(), float(np.random.rand()), torch.rand(1))
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    sg.checkpoint.load(tmp_path / "c", {}, ctx)
    assert (random.random(), float(np.random.rand()), torch.rand(1)) == expected
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    sg.checkpoint.load(tmp_path / "c", {}, ctx, rng=False)
    assert random.random() != expected[0]


def test_saving_again_replaces_the_checkpoint_and_leaves_nothing_beside_it(tmp_path, ctx):
    for step in (1, 2, 3):
        sg.checkpoint.save(tmp_path / "last", {"step": step}, ctx)
    assert sg.checkpoint.load(tmp_path / "last", {}, ctx) == {"step": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["last"]


def test_a_directory_that_is_not_a_checkpoint_is_never_replaced(tmp_path, ctx):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="exists and is not a stratagem checkpoint"):
        sg.checkpoint.save(tmp_path / "results", {"step": 1}, ctx)
    assert (tmp_path / "results" / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["results"]
    (tmp_path / "empty").mkdir()
    sg.checkpoint.save(tmp_path / "empty", {"step": 1}, ctx)  # an empty directory is fine
    assert sg.checkpoint.load(tmp_path / "empty", {}, ctx) == {"step": 1}


def test_a_save_that_fails_keeps_the_previous_checkpoint_and_no_temporary(
    tmp_path, ctx, monkeypatch
):
    sg.checkpoint.save(tmp_path / "c", {"step": 1}, ctx)
    from stratagem.checkpoint import dcp_files

    def broken_write(directory, state_dict, ctx):
        (directory / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(dcp_files, "write", broken_write)
    with pytest.raises(OSError, match="disk full"):
        sg.checkpoint.save(tmp_path / "c", {"step": 2}, ctx)
    monkeypatch.undo()
    assert sg.checkpoint.load(tmp_path / "c", {}, ctx) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_keep_last_keeps_the_newest_checkpoints_and_latest_finds_the_newest(tmp_path, ctx):
    assert sg.checkpoint.latest(tmp_path / "runs") is None
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes").mkdir()  # not a checkpoint: never counted, never removed
    for step in range(1, 5):
        sg.checkpoint.save(tmp_path / "runs" / f"step-{step}", {"step": step}, ctx, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["notes", "step-3", "step-4"]
    assert sg.checkpoint.latest(tmp_path / "runs") == tmp_path / "runs" / "step-4"


def test_describe_lists_keys_shapes_dtypes_and_values_without_a_model(tmp_path, ctx):
    model, optimizer = trained()
    loader = shard_loader(DataLoader(TensorDataset(torch.arange(10)), batch_size=2), ctx)
    sg.checkpoint.save(
        tmp_path / "c", {"model": model.half(), "optim": optimizer, "loader": loader, **VALUES}, ctx
    )
    info = sg.checkpoint.describe(tmp_path / "c")
    assert info.world_size == 1 and info.rng_ranks == (0,)
    assert info.entries == {
        "model": "module",
        "optim": "optimizer",
        "loader": "object",
        **dict.fromkeys(VALUES, "value"),
    }
    assert info.tensors["model/0.weight"] == sg.checkpoint.TensorInfo((4, 3), torch.float16)
    assert str(info.tensors["optim/state/1.bias/exp_avg"]) == "float32[2]"
    assert info.values["step"] == 7 and info.values["config"] == VALUES["config"]
    assert info.values["loader"] == {"epoch": 0, "consumed": 0}
    assert info.values["optim/param_groups/0/lr"] == 0.1
    text = str(info)
    assert "model (module)" in text and "0.weight: float16[4, 3]" in text and "= 7" in text


def test_malformed_arguments_are_usage_errors(tmp_path, ctx):
    model, optimizer = trained()
    cases = [
        (lambda: sg.checkpoint.save(tmp_path / "c", [model], ctx), "'state' must be a mapping"),
        (lambda: sg.checkpoint.save(tmp_path / "c", {"_stratagem_x": 1}, ctx), "reserved"),
        (lambda: sg.checkpoint.save(3, {}, ctx), "'path' must be a str or os.PathLike"),
        (
            lambda: sg.checkpoint.save(tmp_path / "c", {}, ctx, keep_last=0),
            "'keep_last' must be None or a positive int",
        ),
        (
            lambda: sg.checkpoint.save(tmp_path / "c", {"optim": optimizer}, ctx),
            "not the module whose parameters it updates",
        ),
    ]
    for call, message in cases:
        with pytest.raises(sg.UsageError, match=message):
            call()
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        sg.checkpoint.load(tmp_path / "nothing", {}, ctx)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="it is a file"):
        sg.checkpoint.load(tmp_path / "file", {}, ctx)


def test_the_strategy_records_save_and_load_with_the_same_functions(tmp_path, ctx):
    strategy = sg.single_device("cpu")
    assert strategy.save is sg.checkpoint.save and strategy.load is sg.checkpoint.load
    strategy.save(tmp_path / "c", {"step": 1}, ctx)
    assert strategy.load(tmp_path / "c", {}, ctx) == {"step": 1}
