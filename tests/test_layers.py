"""Layers that hold another field of the record: the record keeps them pointing at its own."""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import attrs
import torch

import stratagem as sg
from stratagem.layers import held, peel, repointed
from stratagem.testing.reference import undistributed


def train(strategy: sg.Strategy, micro_batches: int) -> None:
    ctx = strategy.setup(sg.Env())
    try:
        model = strategy.wrap(torch.nn.Linear(3, 2), ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(micro_batches):
            loss = strategy.step(model, torch.ones(4, 3), ctx).sum()
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
    finally:
        strategy.teardown(ctx)


def test_a_no_sync_substituted_after_accumulate_is_the_one_it_enters() -> None:
    # accumulate's step held the no_sync of the record it was applied to: one substituted
    # later was never entered, and the order of the two decided what trained.
    entered = []

    @contextlib.contextmanager
    def counted(module: torch.nn.Module, ctx: sg.Context) -> Any:
        entered.append(type(module).__name__)
        yield

    strategy = attrs.evolve(sg.accumulate(sg.single_device("cpu"), 2), no_sync=counted)
    assert strategy.step.no_sync is counted
    train(strategy, 4)
    assert entered == ["Linear", "Linear"]  # the first micro-batch of each window of two


def test_traced_over_accumulate_records_the_no_sync_accumulate_enters() -> None:
    sink = sg.ListSink()
    train(sg.traced(sg.accumulate(sg.single_device("cpu"), 2), sink), 4)
    fields = [event.field for event in sink.events]
    assert fields.count("no_sync") == 2, fields
    assert fields.index("no_sync") < fields.index("step")  # entered inside the step it covers


@attrs.frozen
class ReducedStep:
    """A user's layer: the step, then its loss reduced through the record's own ``reduce``."""

    inner: Any
    reduce: Any
    holds: ClassVar[tuple[str, ...]] = ("reduce",)

    def __call__(self, module: Any, batch: Any, ctx: Any, *, forward: Any = None) -> Any:
        loss = self.inner(module, batch, ctx, forward=forward)
        self.reduce(loss.detach().sum(), "mean", ctx)
        return loss


def test_a_users_layer_that_holds_a_field_is_repointed_by_later_combinators() -> None:
    base = sg.single_device("cpu")
    mine = attrs.evolve(base, step=ReducedStep(base.step, base.reduce))
    assert held(mine.step) == ("reduce",)
    stacked = sg.checked(mine)  # checked substitutes reduce
    assert stacked.step.reduce is stacked.reduce
    assert stacked.step.reduce is not base.reduce
    # The record is unchanged when nothing it holds moved: it compares equal to itself.
    assert attrs.evolve(mine) == mine
    assert repointed(mine.step, {"reduce": mine.reduce}) is mine.step


def test_the_kits_reference_holds_its_own_no_sync() -> None:
    strategy = sg.accumulate(sg.ddp(device="cpu"), 2)
    reference = undistributed(strategy)
    layers, _ = peel(reference.step)
    [step] = [layer for layer in layers if held(layer)]
    assert step.no_sync is reference.no_sync is sg.single_device("cpu").no_sync
    assert strategy.step.no_sync is strategy.no_sync  # the ranks' own: ddp's
