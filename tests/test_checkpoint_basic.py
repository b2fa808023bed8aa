"""save/load of the record: round trips, keys of the plain module, atomic replacement, safe reads."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

import stratagem as sg


@pytest.fixture
def ctx() -> sg.Context:
    return sg.single_device("cpu").setup(sg.Env())


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_round_trip_restores_objects_and_returns_values(tmp_path, ctx):
    strategy = sg.single_device("cpu")
    model, optimizer = trained()
    path = tmp_path / "ckpt.pt"
    strategy.save(path, {"model": model, "optim": optimizer, "step": 7, "config": {"lr": 0.1}}, ctx)

    torch.manual_seed(1)
    fresh = torch.nn.Linear(3, 2)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
    values = strategy.load(path, {"model": fresh, "optim": fresh_optim}, ctx)
    assert values == {"step": 7, "config": {"lr": 0.1}}
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_optim.state_dict()["state"][0]["exp_avg"].equal(
        optimizer.state_dict()["state"][0]["exp_avg"]
    )


def test_wrapped_modules_are_saved_with_plain_keys(tmp_path, ctx):
    strategy = sg.single_device("cpu")
    model = torch.nn.Linear(2, 2)
    strategy.save(tmp_path / "a.pt", {"model": torch.nn.DataParallel(model)}, ctx)
    plain = torch.nn.Linear(2, 2)
    strategy.load(tmp_path / "a.pt", {"model": plain}, ctx)
    assert torch.equal(plain.weight, model.weight)


def test_a_failed_save_keeps_the_previous_checkpoint(tmp_path, ctx):
    strategy = sg.single_device("cpu")
    path = tmp_path / "ckpt.pt"
    strategy.save(path, {"step": 1}, ctx)

    class Exploding:
        def state_dict(self):
            return {"bad": lambda: None}  # not serialisable by torch.save

        def load_state_dict(self, state):
            pass

    with pytest.raises(Exception):  # noqa: B017, PT011  # whatever torch.save raises
        strategy.save(path, {"step": 2, "thing": Exploding()}, ctx)
    assert strategy.load(path, {}, ctx) == {"step": 1}
    assert os.listdir(tmp_path) == ["ckpt.pt"]  # no temporary file left behind


def test_missing_state_lists_both_sides(tmp_path, ctx):
    strategy = sg.single_device("cpu")
    strategy.save(tmp_path / "c.pt", {"model": torch.nn.Linear(1, 1)}, ctx)
    with pytest.raises(sg.UsageError, match=r"no state for \['optim'\]; it holds \['model'\]"):
        strategy.load(
            tmp_path / "c.pt",
            {"optim": torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)},
            ctx,
        )


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_a_pickle_with_code_is_refused_not_run(tmp_path, ctx, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.pt"
    path.write_bytes(
        pickle.dumps({"format": "stratagem-checkpoint/1", "objects": {}, "values": Payload()})
    )
    with pytest.raises(sg.UsageError, match="not a readable checkpoint"):
        sg.single_device("cpu").load(path, {}, ctx)
    assert not (tmp_path / "pwned.txt").exists()


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path, ctx):
    strategy = sg.single_device("cpu")
    path = tmp_path / "t.pt"
    strategy.save(path, {"model": torch.nn.Linear(8, 8)}, ctx)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(sg.UsageError, match="not a readable checkpoint"):
        strategy.load(path, {"model": torch.nn.Linear(8, 8)}, ctx)
