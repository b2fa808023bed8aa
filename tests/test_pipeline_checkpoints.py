"""Checkpoints of a pipeline split over real gloo ranks: keys as the unsplit module's, any strategy.

Each rank holds some stages. A save writes each stage once, from the first
data-parallel replica of its pipeline, with optimizer state flattened per
parameter name (so no rank's param_groups stands in for another's); a load
reads on each rank the keys it holds. So a pipeline's checkpoint loads into
the unsplit module under ``single_device()`` and ``ddp()``, theirs into a
pipeline, and a pipeline resumed from its own ends bit for bit where an
uninterrupted one does.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

import stratagem as sg
from test_pipeline import BATCH, FOUR, TWO, dataset, make_mlp, mse

SHAPES = ((6,), (2,))


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and AdamW slot (step count included), by the unsplit names."""
    model = sg.unwrap(model)
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for parameter, slots in optimizer.state.items():
        for slot, value in slots.items():
            state[f"optimizer/{names[id(parameter)]}/{slot}"] = value.clone()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state[f"optimizer/{names[id(parameter)]}/lr"] = torch.tensor(group["lr"])
    return state


def steps(strategy, ctx, model, optimizer, first: int, last: int) -> None:
    """Train on batches ``first`` to ``last - 1`` of the dataset (the same on every run)."""
    _, replicas = ctx.data_parallel
    loader = DataLoader(dataset(*SHAPES), batch_size=BATCH // replicas)
    for index, batch in enumerate(strategy.shard(loader, ctx)):
        if first <= index < last:
            loss = strategy.step(model, batch, ctx, forward=mse)
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)


def build(strategy, ctx, seed: int):
    model = strategy.wrap(make_mlp(seed=seed), ctx)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_and_save(strategy, ctx, path: str, verify: bool = False) -> dict[str, torch.Tensor]:
    model, optimizer = build(strategy, ctx, seed=0)
    steps(strategy, ctx, model, optimizer, 0, 2)
    sg.checkpoint.save(
        path, {"model": model, "optimizer": optimizer, "step": 2}, ctx, verify=verify
    )
    return full_state(model, optimizer)


def load_and_report(strategy, ctx, path: str) -> dict[str, torch.Tensor]:
    model, optimizer = build(strategy, ctx, seed=ctx.rank + 11)  # not the saved weights
    values = sg.checkpoint.load(path, {"model": model, "optimizer": optimizer}, ctx)
    assert values["step"] == 2
    return full_state(model, optimizer)


def merged(results: list[dict[str, torch.Tensor]], ranks: range) -> dict[str, torch.Tensor]:
    """The union of the ranks' states, checking that no two of them hold one key."""
    union: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for key, value in results[rank].items():
            if "/lr" not in key:
                assert key not in union, f"{key} is held by two stages"
            union[key] = value
    return union


def assert_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def pipeline(schedule: str = "1f1b", size: int | None = None) -> sg.Strategy:
    stages = TWO if schedule in ("gpipe", "1f1b") else FOUR
    return sg.spawned(
        sg.pipeline(
            stages=stages, schedule=schedule, microbatches=2, size=size, timeout=60, device="cpu"
        )
    )


def single_device_load(path: str) -> dict[str, torch.Tensor]:
    strategy = sg.single_device("cpu")
    return load_and_report(strategy, strategy.setup(sg.Env()), path)


@pytest.mark.slow
def test_a_pipeline_on_two_ranks_saves_what_single_device_and_ddp_load_by_key(tmp_path):
    path = str(tmp_path / "ckpt")  # two stages a rank; 1f1b's one a rank resumes below
    saved = sg.launch(train_and_save, pipeline("interleaved-1f1b"), devices=2, args=(path,))
    expected = merged(saved, range(2))
    assert_equal(single_device_load(path), expected)
    for result in sg.launch(load_and_report, sg.ddp_spawn(device="cpu"), devices=2, args=(path,)):
        assert_equal(result, expected)


def single_device_train_and_save(path: str) -> dict[str, torch.Tensor]:
    strategy = sg.single_device("cpu")
    return train_and_save(strategy, strategy.setup(sg.Env()), path)


@pytest.mark.slow
def test_a_single_device_checkpoint_loads_into_a_pipeline_each_rank_its_stages(tmp_path):
    path = str(tmp_path / "ckpt")
    expected = single_device_train_and_save(path)
    loaded = sg.launch(load_and_report, pipeline("interleaved-1f1b"), devices=2, args=(path,))
    assert_equal(merged(loaded, range(2)), expected)


def train_save_continue(strategy, ctx, path: str | None) -> dict[str, torch.Tensor]:
    """Train 3 steps; with ``path``, save after 2 (a run to resume from); without, train on."""
    model, optimizer = build(strategy, ctx, seed=0)
    steps(strategy, ctx, model, optimizer, 0, 2)
    if path is not None:
        sg.checkpoint.save(path, {"model": model, "optimizer": optimizer, "step": 2}, ctx)
    steps(strategy, ctx, model, optimizer, 2, 3)
    return full_state(model, optimizer)


def resume(strategy, ctx, path: str) -> dict[str, torch.Tensor]:
    model, optimizer = build(strategy, ctx, seed=ctx.rank + 11)
    values = sg.checkpoint.load(path, {"model": model, "optimizer": optimizer}, ctx)
    steps(strategy, ctx, model, optimizer, values["step"], 3)
    return full_state(model, optimizer)


@pytest.mark.slow
def test_a_pipeline_resumed_from_its_checkpoint_ends_bit_for_bit_where_an_uninterrupted_one_does(
    tmp_path,
):
    path = str(tmp_path / "ckpt")
    strategy = pipeline("1f1b")
    uninterrupted = sg.launch(train_save_continue, strategy, devices=2, args=(path,))
    resumed = sg.launch(resume, strategy, devices=2, args=(path,))
    for rank in range(2):
        assert_equal(resumed[rank], uninterrupted[rank])


def writers(path: str) -> dict[str, set[int]]:
    """The ranks whose files hold each entry's tensors, from the checkpoint's DCP metadata."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(path).read_metadata()
    found: dict[str, set[int]] = {}
    for index, info in metadata.storage_data.items():
        name = metadata.planner_data[index.fqn][0]
        rank = int(info.relative_path.split("_")[2])  # __<rank>_<n>.distcp
        found.setdefault(name, set()).add(rank)
    return found


@pytest.mark.slow
def test_dp_x_pp_on_four_ranks_writes_each_stage_once_and_loads_under_single_device(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = sg.launch(train_and_save, pipeline("1f1b", size=2), devices=4, args=(path, True))
    # Both pipelines hold the same weights; the first (ranks 0 and 1) writes them.
    assert_equal(merged(saved, range(2, 4)), merged(saved, range(2)))
    assert writers(path)["model"] == {0, 1}
    assert writers(path)["optimizer"] == {0, 1}
    assert_equal(single_device_load(path), merged(saved, range(2)))


def save_with_a_differing_replica(strategy, ctx, path: str) -> None:
    model, optimizer = build(strategy, ctx, seed=0)
    if ctx.rank == 3:  # the second pipeline's copy of the last stage
        with torch.no_grad():
            model.get_submodule("6").bias.add_(1.0)
    sg.checkpoint.save(path, {"model": model, "optimizer": optimizer}, ctx, verify=True)


@pytest.mark.slow
def test_verify_refuses_a_stage_whose_replicas_differ_naming_the_key_and_rank(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(sg.RankError) as caught:
        sg.launch(save_with_a_differing_replica, pipeline("1f1b", size=2), devices=4, args=(path,))
    assert "model/6.bias (rank 3 differs from rank 1)" in str(caught.value)
    assert not path.exists()


def load_model_only(strategy, ctx, path: str, strict: bool) -> dict[str, torch.Tensor]:
    model, _ = build(strategy, ctx, seed=ctx.rank + 11)
    sg.checkpoint.load(path, {"model": model}, ctx, strict=strict)
    return dict(model.state_dict())


def save_plain(path: str, module: torch.nn.Module) -> None:
    strategy = sg.single_device("cpu")
    sg.checkpoint.save(path, {"model": module}, strategy.setup(sg.Env()))


@pytest.mark.slow
def test_a_key_no_stage_holds_or_a_stage_lacks_is_named_on_load(tmp_path):
    extra = make_mlp()
    extra.add_module("7", torch.nn.Linear(2, 2))  # a key no rank of the pipeline holds
    save_plain(str(tmp_path / "extra"), extra)
    with pytest.raises(sg.RankError) as caught:
        sg.launch(load_model_only, pipeline(), devices=2, args=(str(tmp_path / "extra"), True))
    assert "in the checkpoint but not in state: model/7.bias, model/7.weight" in str(caught.value)
    lacking = torch.nn.Sequential(*list(make_mlp())[:6])  # the last stage's layer is missing
    save_plain(str(tmp_path / "lacking"), lacking)
    with pytest.raises(sg.RankError) as caught:
        sg.launch(load_model_only, pipeline(), devices=2, args=(str(tmp_path / "lacking"), True))
    assert "missing from the checkpoint: model/6.weight, model/6.bias" in str(caught.value)
    # strict=False loads what matches (keys held by other stages are not unexpected).
    loaded = sg.launch(
        load_model_only, pipeline(), devices=2, args=(str(tmp_path / "extra"), False)
    )
    everything = {**loaded[0], **loaded[1]}
    assert sorted(everything) == sorted(make_mlp().state_dict())
    for key, value in everything.items():
        assert torch.equal(value, extra.state_dict()[key]), key


def tied_model(tie: bool = True) -> torch.nn.Sequential:
    """Layers "2" and "3", both on the second rank's stage, share their weight."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    if tie:
        model[3].weight = model[2].weight
    return model


def save_tied(strategy, ctx, path: str) -> dict[str, torch.Tensor]:
    model = strategy.wrap(tied_model(), ctx)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # not the weights a fresh model has
    sg.checkpoint.save(path, {"model": model}, ctx)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_tie_inside_the_second_ranks_stage_is_stored_once_and_restored_both_ways(tmp_path):
    path = str(tmp_path / "ckpt")
    strategy = sg.spawned(
        sg.pipeline(
            stages=[["0", "1"], ["2", "3", "4"]], schedule="gpipe", microbatches=2, device="cpu"
        )
    )
    first, second = sg.launch(save_tied, strategy, devices=2, args=(path,))
    info = sg.checkpoint.describe(path)
    assert "model/3.weight" not in info.tensors and "model/2.weight" in info.tensors
    alone = sg.single_device("cpu")
    ctx = alone.setup(sg.Env())
    for tie in (True, False):
        model = tied_model(tie)
        sg.checkpoint.load(path, {"model": model}, ctx)
        for key, value in {**first, **second}.items():
            assert torch.equal(model.state_dict()[key], value), (tie, key)
        assert (model[3].weight is model[2].weight) == tie
