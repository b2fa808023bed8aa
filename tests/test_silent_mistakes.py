"""Mistakes that used to pass in silence (issue 40): each is now an error at the first call.

- an optimizer built over other parameters than the module's (checked once per pair);
- ``step`` / ``update`` under ``ddp()`` on the module from before ``wrap`` (no sync: ranks drift);
- ``reduce``, ``shard`` and ``save`` given a context from another world (one torn down).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.collectives import STALE_CONTEXT
from stratagem.training import OPTIMIZER_NOT_FOR_MODULE, UNWRAPPED_UNDER_DDP


def loss_of(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def train_step(strategy: sg.Strategy, model, optimizer, ctx) -> None:
    loss = strategy.step(model, torch.ones(4, 3), ctx, forward=loss_of)
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)


# ------------------------------------------------------------ the optimizer of another module


@pytest.fixture
def single() -> Iterator[tuple[sg.Strategy, sg.Context]]:
    strategy = sg.single_device("cpu")
    ctx = strategy.setup(sg.Env())
    yield strategy, ctx
    strategy.teardown(ctx)


def test_update_refuses_an_optimizer_over_another_modules_parameters(single) -> None:
    strategy, ctx = single
    model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
    other = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    loss = strategy.step(model, torch.ones(4, 3), ctx, forward=loss_of)
    strategy.backward(loss, model, ctx)
    with pytest.raises(sg.UsageError) as caught:
        strategy.update(optimizer, model, ctx)
    assert str(caught.value) == OPTIMIZER_NOT_FOR_MODULE.format(
        function="update", module="Linear", count=2
    )
    assert torch.equal(model.weight, before)


@pytest.mark.parametrize(
    "combine",
    [
        lambda s: sg.with_clipping(s, max_norm=1.0),
        lambda s: sg.with_clipping(s, max_value=0.5),
        lambda s: sg.with_precision(s, "16-mixed"),
        lambda s: sg.accumulate(s, 2),
    ],
    ids=["clip-norm", "clip-value", "16-mixed", "accumulate"],
)
def test_combinators_refuse_an_optimizer_over_another_module_too(combine) -> None:
    # Siblings: with_clipping's fast path stepped the optimizer without the check.
    strategy = combine(sg.single_device("cpu"))
    ctx = strategy.setup(sg.Env())
    try:
        model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
        optimizer = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.1)
        before = model.weight.detach().clone()
        for _ in range(2):  # accumulate(2) steps on the second update
            strategy.backward(
                strategy.step(model, torch.ones(4, 3), ctx, forward=loss_of), model, ctx
            )
            with pytest.raises(sg.UsageError, match="holds none of the parameters"):
                strategy.update(optimizer, model, ctx)
        assert torch.equal(model.weight, before)
    finally:
        strategy.teardown(ctx)


def test_update_accepts_a_frozen_part_param_groups_and_extra_parameters(single) -> None:
    strategy, ctx = single
    model = strategy.wrap(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)), ctx)
    model[0].requires_grad_(False)  # fine-tuning the head only
    head_only = torch.optim.SGD(model[1].parameters(), lr=0.1)
    train_step(strategy, model, head_only, ctx)
    scale = torch.nn.Parameter(torch.ones(()))  # a learnable loss parameter beside the module
    groups = [{"params": [model[1].weight]}, {"params": [model[1].bias, scale], "lr": 0.01}]
    train_step(strategy, model, torch.optim.AdamW(groups, lr=0.1), ctx)


def test_the_verdict_is_cached_per_pair_and_a_new_pair_is_checked(single) -> None:
    strategy, ctx = single
    model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
    good = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(strategy, model, good, ctx)
    other = strategy.wrap(torch.nn.Linear(3, 2), ctx)
    with pytest.raises(sg.UsageError, match="holds none of the parameters of the Linear"):
        train_step(strategy, other, good, ctx)  # the same optimizer, another module
    train_step(strategy, model, good, ctx)


class CountingWalks(torch.nn.Sequential):
    """A Sequential that counts the walks over its parameters."""

    def parameters(self, recurse: bool = True):
        self.walks = getattr(self, "walks", 0) + 1
        return super().parameters(recurse)


def test_the_check_walks_the_parameters_once_per_pair(single) -> None:
    # What a step pays once the pair is known is a lookup, whatever the module's size: the
    # parameters are walked by the first check only. (Its cost in time is benchmarks/overhead_us',
    # not a timed unit test's: a loaded machine ran this 1.25 µs a call.)
    strategy, ctx = single
    model = strategy.wrap(CountingWalks(*[torch.nn.Linear(4, 4) for _ in range(50)]), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from stratagem.training import check_optimizer_holds

    model.walks = 0
    for _ in range(100):
        check_optimizer_holds(optimizer, model, "update")
    assert model.walks == 1


def test_fsdp_update_refuses_an_optimizer_of_another_sharded_module() -> None:
    strategy = sg.fsdp(device="cpu")
    ctx = strategy.setup(sg.Env())
    try:
        model = strategy.wrap(torch.nn.Sequential(torch.nn.Linear(3, 2)), ctx)
        other = strategy.wrap(torch.nn.Sequential(torch.nn.Linear(3, 2)), ctx)
        optimizer = torch.optim.SGD(other.parameters(), lr=0.1)  # DTensors, of the other one
        with pytest.raises(sg.UsageError, match="holds none of the parameters of the FSDPSeq"):
            train_step(strategy, model, optimizer, ctx)
        train_step(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), ctx)
    finally:
        strategy.teardown(ctx)


# ------------------------------------------------------------ the unwrapped module under ddp()


@pytest.fixture
def ddp_world() -> Iterator[tuple[sg.Strategy, sg.Context]]:
    strategy = sg.ddp(device="cpu")
    ctx = strategy.setup(sg.Env())  # a world of one in this process: a real gloo group
    yield strategy, ctx
    strategy.teardown(ctx)


@pytest.mark.parametrize(
    "combine",
    [
        lambda strategy: strategy,
        lambda strategy: sg.with_clipping(strategy, max_norm=1.0),
        lambda strategy: sg.accumulate(strategy, 1),
        lambda strategy: sg.with_precision(strategy, "bf16-mixed"),
    ],
    ids=["ddp", "clipped", "accumulated", "bf16-mixed"],
)
def test_ddp_refuses_the_module_from_before_wrap_in_step_and_update(combine) -> None:
    # Clipping over the plain update used to clip and step itself without update's checks of
    # the module: the module from before wrap was stepped, its gradients never averaged.
    strategy = combine(sg.ddp(device="cpu"))
    ctx = strategy.setup(sg.Env())  # a world of one in this process: a real gloo group
    try:
        model = torch.nn.Linear(3, 2)
        wrapped = strategy.wrap(model, ctx)
        with pytest.raises(sg.UsageError) as caught:
            strategy.step(model, torch.ones(4, 3), ctx, forward=loss_of)
        assert str(caught.value) == UNWRAPPED_UNDER_DDP.format(function="step", module="Linear")
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        loss = strategy.step(wrapped, torch.ones(4, 3), ctx, forward=loss_of)
        strategy.backward(loss, wrapped, ctx)
        with pytest.raises(sg.UsageError, match=r"^update: 'module' is the Linear from before"):
            strategy.update(optimizer, model, ctx)
        strategy.update(optimizer, wrapped, ctx)
        with torch.no_grad():  # evaluation through the inner module synchronises nothing
            strategy.step(model, torch.ones(4, 3), ctx, forward=loss_of)
    finally:
        strategy.teardown(ctx)


def test_a_pair_trusted_before_ddp_wrapped_its_module_is_checked_again(ddp_world) -> None:
    # update trusts an (optimizer, module) pair once it passed every check; ddp's wrap putting
    # that module inside its wrapper must end the trust, or the next update steps it unsynced.
    strategy, ctx = ddp_world
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plain = sg.single_device("cpu")
    plain.update(optimizer, model, plain.setup(sg.Env()))  # the pair is now known and trusted
    strategy.wrap(model, ctx)
    with pytest.raises(sg.UsageError, match=r"^update: 'module' is the Linear from before"):
        strategy.update(optimizer, model, ctx)


def test_no_optimizer_and_no_module_are_refused_after_the_trusted_pair_died() -> None:
    # An empty or dead trust slot must not match None: update(None, None, ctx) stepped None.
    plain = sg.single_device("cpu")
    ctx = plain.setup(sg.Env())
    model = torch.nn.Linear(3, 2)
    plain.update(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)  # trusted, then dead
    del model
    gc.collect()
    for strategy in (plain, sg.accumulate(plain, 2)):
        with pytest.raises(sg.UsageError, match=r"^update: 'optimizer' must be"):
            strategy.update(None, None, strategy.setup(sg.Env()))


class NotAModule:
    """Weakly referable, as a module is: a pair of it could be trusted."""


def test_allreduce_update_refuses_a_non_module_on_every_call() -> None:
    # allreduce_grads' update skips its checks for the trusted pair; a pair whose "module" is
    # none must never become it, or the second call steps it unchecked.
    strategy = sg.allreduce_grads(device="cpu")
    ctx = strategy.setup(sg.Env())  # a world of one in this process: a real gloo group
    try:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        stranger = NotAModule()
        for _ in range(2):
            with pytest.raises(sg.UsageError, match=r"^update: 'module' must be a torch.nn"):
                strategy.update(optimizer, stranger, ctx)
    finally:
        strategy.teardown(ctx)


@pytest.mark.parametrize(
    "combine",
    [
        lambda s: s,
        lambda s: sg.with_clipping(s, max_norm=1.0),
        lambda s: sg.with_precision(s, "16-true"),
    ],
    ids=["fsdp", "clipped", "16-true"],
)
def test_an_optimizer_built_before_fsdp_wrap_gets_fsdps_message_under_layers(combine) -> None:
    strategy = combine(sg.fsdp(device="cpu"))
    ctx = strategy.setup(sg.Env())  # a world of one in this process: a real gloo group
    try:
        model = torch.nn.Linear(3, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # before wrap
        wrapped = strategy.wrap(model, ctx)
        loss = strategy.step(wrapped, torch.ones(4, 3), ctx, forward=loss_of)
        strategy.backward(loss, wrapped, ctx)
        with pytest.raises(sg.UsageError, match=r"^update: the optimizer holds a parameter that"):
            strategy.update(optimizer, wrapped, ctx)
    finally:
        strategy.teardown(ctx)


def test_ddp_step_accepts_the_wrapped_module_under_combinators(ddp_world) -> None:
    _, ctx = ddp_world
    strategy = sg.with_precision(sg.with_clipping(sg.ddp(device="cpu"), max_norm=1.0), "bf16-mixed")
    model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
    train_step(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1), ctx)


# ------------------------------------------------------------ a context from another world


def test_reduce_shard_and_save_refuse_a_context_of_a_world_torn_down(tmp_path: Path) -> None:
    strategy = sg.ddp(device="cpu")
    old = strategy.setup(sg.Env())
    strategy.teardown(old)
    new = strategy.setup(sg.Env())
    try:
        message = STALE_CONTEXT.format(function="reduce")
        with pytest.raises(sg.UsageError) as caught:
            strategy.reduce(torch.ones(2), "sum", old)
        assert str(caught.value) == message
        loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
        with pytest.raises(sg.UsageError, match=r"^shard: 'ctx' belongs to a world"):
            strategy.shard(loader, old)
        with pytest.raises(sg.UsageError, match=r"^save: 'ctx' belongs to a world"):
            strategy.save(tmp_path / "c", {"x": torch.ones(2)}, old)
        with pytest.raises(sg.UsageError, match=r"^load: 'ctx' belongs to a world"):
            strategy.load(tmp_path / "c", {"x": torch.ones(2)}, old)
        assert list(tmp_path.iterdir()) == []
        assert torch.equal(strategy.reduce(torch.ones(2), "sum", new), torch.ones(2))
        assert len(list(strategy.shard(loader, new))) == 4
    finally:
        strategy.teardown(new)
    with pytest.raises(sg.UsageError, match=r"^reduce: 'ctx' belongs to a world"):
        strategy.reduce(torch.ones(2), "sum", new)  # torn down, no world at all now


def test_a_context_of_one_without_a_group_still_works_in_a_world(ddp_world) -> None:
    # The kit's single_device() reference runs on each rank of a world: no group, no check.
    single = sg.single_device("cpu")
    ctx = single.setup(sg.Env())
    assert torch.equal(single.reduce(torch.ones(2), "sum", ctx), torch.ones(2))


def stale_reduce(strategy: sg.Strategy, ctx: sg.Context, port: int) -> str:
    import attrs

    strategy.teardown(ctx)
    # The launcher's store served the first world; rank 0 hosts the second one's.
    new = strategy.setup(attrs.evolve(ctx.env, master_port=port, agent_store=False))
    try:
        strategy.reduce(torch.ones(1), "sum", ctx)
    except sg.UsageError as error:
        return str(error)
    finally:
        strategy.teardown(new)
    return "accepted"


@pytest.mark.slow
def test_two_ranks_refuse_a_context_of_their_earlier_world() -> None:
    from helpers import free_port

    strategy = sg.ddp_spawn(device="cpu", join_timeout=20)
    results = sg.launch(stale_reduce, strategy, devices=2, args=(free_port(),))
    assert results == [STALE_CONTEXT.format(function="reduce")] * 2


def test_pipeline_update_refuses_an_optimizer_over_another_module() -> None:
    # A sibling of fsdp's case (issue 40): pipeline()'s update stepped any optimizer.
    strategy = sg.pipeline(stages=[["0", "1"]], microbatches=2, device="cpu")
    ctx = strategy.setup(sg.Env())
    try:
        model = strategy.wrap(
            torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), ctx
        )
        other = torch.optim.SGD(torch.nn.Linear(3, 4).parameters(), lr=0.1)
        batch = (torch.randn(4, 3), torch.randn(4, 2))

        def forward(module, micro_batch):
            inputs, targets = micro_batch
            return torch.nn.functional.mse_loss(module(inputs), targets)

        strategy.backward(strategy.step(model, batch, ctx, forward=forward), model, ctx)
        with pytest.raises(sg.UsageError, match="holds none of the parameters"):
            strategy.update(other, model, ctx)
        strategy.update(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)
    finally:
        strategy.teardown(ctx)
