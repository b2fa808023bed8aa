"""Who owns each entry of a checkpoint: replicated state from rank 0, per-rank state rank by rank.

Reported by a user porting a GPT script: saves took replicated entries from whichever rank
DCP's planner picked, so state that differed across ranks came back as a patchwork.
"""

from __future__ import annotations

import re

import pytest
import torch

import stratagem as sg
from stratagem.checkpoint import CheckpointError

pytestmark = pytest.mark.slow


def save_rank_numbers(strategy, ctx, path):
    state = {
        "who": ctx.rank,
        "t": torch.tensor(float(ctx.rank)),
        "u": torch.tensor(float(ctx.rank)),
        "v": torch.full((3,), float(ctx.rank)),
        "w": {"a": ctx.rank, "b": [torch.tensor(ctx.rank)]},
    }
    sg.checkpoint.save(path, state, ctx)
    return sg.checkpoint.load(path, {}, ctx)


def test_every_replicated_value_comes_from_rank_zero(stratagem_world, tmp_path):
    for values in stratagem_world.run(save_rank_numbers, sg.ddp(device="cpu"), tmp_path / "c"):
        assert values["who"] == 0
        assert values["t"].item() == values["u"].item() == 0.0
        assert values["v"].tolist() == [0.0] * 3
        assert values["w"]["a"] == 0 and values["w"]["b"][0].item() == 0


def batchnorm_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def save_diverged_batchnorm(strategy, ctx, path):
    model = strategy.wrap(batchnorm_net(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()
    for p in model.parameters():  # a local-SGD-like momentum that differs per rank
        p.grad = torch.full_like(p, float(ctx.rank + 1))
    optimizer.step()
    norm = sg.unwrap(model)[1]
    with torch.no_grad():  # as after forwards on each rank's own data
        norm.running_mean.fill_(ctx.rank + 1.0)
        norm.running_var.fill_(ctx.rank + 5.0)
        norm.num_batches_tracked.fill_(ctx.rank + 7)
    sg.checkpoint.save(path, {"model": model, "optim": optimizer}, ctx)
    fresh = batchnorm_net()
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    sg.checkpoint.load(path, {"model": fresh, "optim": fresh_optimizer}, ctx)
    buffers = fresh[1]
    momenta = [fresh_optimizer.state[p]["momentum_buffer"] for p in fresh.parameters()]
    return (
        buffers.running_mean.tolist(),
        buffers.running_var.tolist(),
        int(buffers.num_batches_tracked),
        sorted({float(m.flatten()[0]) for m in momenta}),
    )


def test_buffers_and_optimizer_state_come_from_rank_zero_as_a_whole(stratagem_world, tmp_path):
    for mean, var, tracked, momenta in stratagem_world.run(
        save_diverged_batchnorm, sg.ddp(broadcast_buffers=False, device="cpu"), tmp_path / "c"
    ):
        assert (mean, var, tracked) == ([1.0] * 4, [5.0] * 4, 7)
        assert momenta == [1.0], "every parameter's momentum is rank 0's"


class Position:
    """A data position that differs per rank (state_dict/load_state_dict)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = state["index"]


def save_per_rank(strategy, ctx, path):
    batch = torch.full((2,), 10.0 + ctx.rank)
    state = {
        "position": sg.per_rank(Position(100 + ctx.rank)),
        "batch": sg.per_rank(batch),
        "step": 3,
    }
    sg.checkpoint.save(path, state, ctx)
    position = Position(-1)
    values = sg.checkpoint.load(path, {"position": sg.per_rank(position)}, ctx)
    return position.index, values["batch"].tolist(), values["step"]


def test_per_rank_entries_come_back_to_the_rank_that_saved_them(stratagem_world, tmp_path):
    assert stratagem_world.run(save_per_rank, sg.ddp(device="cpu"), tmp_path / "c") == [
        (100, [10.0, 10.0], 3),
        (101, [11.0, 11.0], 3),
    ]
    described = sg.checkpoint.describe(tmp_path / "c")
    assert described.entries["position"] == "per_rank_object"
    assert described.entries["batch"] == "per_rank_value"


def save_two_ranks(strategy, ctx, path):
    sg.checkpoint.save(path, {"position": sg.per_rank(Position(ctx.rank)), "step": 1}, ctx)


def test_per_rank_state_at_another_world_size_is_a_clear_error(stratagem_world, tmp_path):
    stratagem_world.run(save_two_ranks, sg.ddp(device="cpu"), tmp_path / "c")
    ctx = sg.single_device("cpu").setup(sg.Env())
    position = Position(-1)
    with pytest.raises(CheckpointError, match=r"'position' was saved per rank by a world of 2"):
        sg.checkpoint.load(tmp_path / "c", {"position": sg.per_rank(position)}, ctx)
    assert position.index == -1
    values = sg.checkpoint.load(
        tmp_path / "c", {"position": sg.per_rank(position)}, ctx, strict=False
    )
    assert values == {"step": 1} and position.index == -1, "not strict: per-rank left as it is"
    # A replicated entry in state cannot stand for a per-rank one, nor the other way round.
    with pytest.raises(
        CheckpointError, match=r"position \(a per-rank object in the checkpoint, an object here\)"
    ):
        sg.checkpoint.load(tmp_path / "c", {"position": Position(-1)}, ctx)


def save_verified(strategy, ctx, path, same):
    model = strategy.wrap(batchnorm_net(), ctx)
    if not same:
        with torch.no_grad():
            sg.unwrap(model)[1].running_mean.fill_(float(ctx.rank))
    state = {"model": model, "epoch": 2 if same else ctx.rank, "rank": sg.per_rank(ctx.rank)}
    try:
        sg.checkpoint.save(path, state, ctx, verify=True)
    except CheckpointError as error:
        return str(error)
    return None


def test_verify_reports_by_key_the_replicated_entries_that_differ(stratagem_world, tmp_path):
    assert stratagem_world.run(save_verified, sg.ddp(device="cpu"), tmp_path / "a", True) == [
        None,
        None,
    ]
    messages = stratagem_world.run(save_verified, sg.ddp(device="cpu"), tmp_path / "b", False)
    assert messages[0] == messages[1]
    assert "model/1.running_mean (rank 1 differs from rank 0)" in messages[0]
    assert "epoch (rank 1 differs from rank 0)" in messages[0]
    # Only those two: equal buffers and parameters, and per-rank entries, are not reported.
    assert set(re.findall(r"(\S+) \(rank 1 differs", messages[0])) == {
        "model/1.running_mean",
        "epoch",
    }
    assert "sg.per_rank" in messages[0]
    assert not (tmp_path / "b").exists(), "nothing is written when verification fails"


# --- fsdp() starts and saves as ddp() does ------------------------------------------------


def start_and_train(strategy, ctx):
    torch.manual_seed(1337 + ctx.rank)  # per-rank seeds, as research scripts set them
    model = strategy.wrap(batchnorm_net_seeded(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(5 + ctx.rank)
    for _ in range(3):
        batch = torch.randn(4, 3, generator=generator)
        loss = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).square().mean())
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(sg.unwrap(model), options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items() if "running" not in k}


def batchnorm_net_seeded() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_fsdp_starts_every_rank_from_rank_zeros_weights_as_ddp_does(stratagem_world):
    ddp_params = stratagem_world.run(start_and_train, sg.ddp(device="cpu"))
    fsdp_params = stratagem_world.run(start_and_train, sg.fsdp(device="cpu"))
    for name, value in ddp_params[0].items():
        assert torch.allclose(fsdp_params[0][name], value, atol=1e-6), name
        assert torch.equal(fsdp_params[1][name], fsdp_params[0][name]), name


def starting_buffers(strategy, ctx):
    torch.manual_seed(ctx.rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    own = model[0].weight.detach().clone()
    with torch.no_grad():
        model[1].running_mean.fill_(float(ctx.rank))
    plain = sg.unwrap(strategy.wrap(model, ctx))
    return plain[1].running_mean.tolist(), plain[0].weight.full_tensor().detach().clone(), own


def test_fsdp_broadcasts_buffers_too_and_can_be_told_not_to(stratagem_world):
    (mean0, full0, own0), (mean1, full1, own1) = stratagem_world.run(
        starting_buffers, sg.fsdp(device="cpu")
    )
    assert mean0 == mean1 == [0.0] * 4
    assert torch.equal(full0, own0) and torch.equal(full1, own0), "rank 0's weights everywhere"
    unsynced = stratagem_world.run(
        starting_buffers, sg.fsdp(sync_module_states=False, device="cpu")
    )
    (mean0, full, own0), (mean1, _, own1) = unsynced
    assert mean0 == [0.0] * 4 and mean1 == [1.0] * 4
    assert torch.equal(full[:2], own0[:2]) and torch.equal(full[2:], own1[2:]), "stitched"


# --- saving after an evaluation forward, under every strategy -------------------------------


def save_after_evaluation(strategy, ctx, path):
    model = strategy.wrap(batchnorm_net_seeded(), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    batch = torch.randn(4, 3)
    loss = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).square().mean())
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)
    with torch.no_grad():
        evaluated = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).square().mean())
    sg.checkpoint.save(path / "no_grad", {"model": model, "optim": optimizer}, ctx)
    model.eval()
    strategy.step(model, batch, ctx)  # an evaluation forward with grad enabled
    model.train()
    sg.checkpoint.save(path / "eval", {"model": model, "optim": optimizer}, ctx)
    loss = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).square().mean())
    strategy.backward(loss, model, ctx)  # training goes on after the saves
    strategy.update(optimizer, model, ctx)
    return float(evaluated)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "allreduce_grads"])
def test_saving_works_after_an_evaluation_forward(stratagem_world, tmp_path, name):
    strategy = {"ddp": sg.ddp, "fsdp": sg.fsdp, "allreduce_grads": sg.allreduce_grads}[name]()
    losses = stratagem_world.run(save_after_evaluation, strategy, tmp_path)
    assert losses[0] > 0
    assert sg.checkpoint.describe(tmp_path / "no_grad").entries == {
        "model": "module",
        "optim": "optimizer",
    }


@pytest.mark.parametrize("name", ["single_device", "dp", "compiled"])
def test_saving_works_after_an_evaluation_forward_in_one_process(tmp_path, name):
    strategy = {
        "single_device": lambda: sg.single_device("cpu"),
        "dp": sg.dp,
        "compiled": lambda: sg.compiled(sg.single_device("cpu"), backend="eager"),
    }[name]()
    ctx = strategy.setup(sg.Env())
    assert save_after_evaluation(strategy, ctx, tmp_path) > 0


def test_an_optimizer_of_other_parameters_names_the_problem(tmp_path):
    ctx = sg.single_device("cpu").setup(sg.Env())
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with pytest.raises(sg.UsageError) as info:
        sg.checkpoint.save(
            tmp_path / "c", {"model": model, "optim": torch.optim.SGD(other.parameters())}, ctx
        )
    message = str(info.value)
    assert "none of the modules in state (['model']) holds" in message
    assert "but not the module" not in message


# --- tied weights are stored once --------------------------------------------------------


class TiedLM(torch.nn.Module):
    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


def test_a_tied_weight_is_stored_once_and_the_tie_survives_a_load(tmp_path):
    ctx = sg.single_device("cpu").setup(sg.Env())
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.arange(5)).sum().backward()
    optimizer.step()
    sg.checkpoint.save(tmp_path / "c", {"model": model, "optim": optimizer}, ctx)
    stored = sg.checkpoint.describe(tmp_path / "c").tensors
    assert "model/emb.weight" in stored and "model/head.weight" not in stored

    torch.manual_seed(1)
    fresh = TiedLM()
    fresh_optimizer = torch.optim.Adam(fresh.parameters())
    sg.checkpoint.load(tmp_path / "c", {"model": fresh, "optim": fresh_optimizer}, ctx)
    assert fresh.head.weight is fresh.emb.weight, "still one parameter"
    assert torch.equal(fresh.emb.weight, model.emb.weight)

    untied = TiedLM(tied=False)  # the same keys, two tensors: both get the stored value
    sg.checkpoint.load(tmp_path / "c", {"model": untied}, ctx, strict=False)
    assert torch.equal(untied.head.weight, model.emb.weight)
    assert torch.equal(untied.emb.weight, model.emb.weight)


def test_meta_tensors_are_never_taken_for_tied_weights():
    from stratagem.checkpoint.entries import tied_keys

    on_meta = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)).to("meta")
    assert tied_keys(on_meta.state_dict()) == {}
    assert tied_keys(TiedLM().state_dict()) == {"head.weight": "emb.weight"}


def test_an_entry_that_would_collide_with_a_per_rank_one_is_refused(tmp_path):
    ctx = sg.single_device("cpu").setup(sg.Env())
    with pytest.raises(sg.UsageError, match=r"entries \['pos.1'\] would collide"):
        sg.checkpoint.save(tmp_path / "c", {"pos": sg.per_rank(1), "pos.1": 2}, ctx)


def half_on_meta(strategy, ctx):
    device = "meta" if ctx.rank == 1 else "cpu"
    try:
        strategy.wrap(torch.nn.Linear(2, 4, device=device), ctx)
    except sg.UsageError as error:
        return str(error)
    return None


def test_fsdp_refuses_ranks_that_disagree_about_the_meta_device(stratagem_world):
    messages = stratagem_world.run(half_on_meta, sg.fsdp(device="cpu"))
    assert messages[0] == messages[1]
    assert "rank(s) [1] hold the module on the meta device" in messages[0]


def ddp_starting_buffers(strategy, ctx):
    torch.manual_seed(ctx.rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        model[1].running_mean.fill_(float(ctx.rank))
    plain = sg.unwrap(strategy.wrap(model, ctx))
    return plain[1].running_mean.tolist(), plain[0].weight.detach().clone()


def test_ddp_without_buffer_broadcasts_still_starts_from_rank_zeros_buffers(stratagem_world):
    (mean0, w0), (mean1, w1) = stratagem_world.run(
        ddp_starting_buffers, sg.ddp(broadcast_buffers=False, device="cpu")
    )
    assert mean0 == mean1 == [0.0] * 4 and torch.equal(w0, w1)
