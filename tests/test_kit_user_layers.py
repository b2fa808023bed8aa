"""A user's own combinator is kept in the kit's reference, as stratagem's are (issue 36).

Before, the derived reference kept only layers from ``stratagem.combinators``: a user's
layer over ``ddp()`` was taken for part of the base and replaced, so a correct combinator
that changes training (a weighted loss) failed ``data-parallel-step`` against a reference
without it. Now every layer stays unless its class says ``in_reference = False`` (it
distributes, or only records), and a planted bug in a user's layer is still caught.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

import stratagem as sg
from stratagem.testing import LawViolation, check_all
from stratagem.testing.reference import undistributed

pytestmark = pytest.mark.slow


@attrs.frozen
class WeightedBackward:
    """Backward: scale the loss by ``weight`` (a user's combinator; ``on_rank_0_only``: the bug)."""

    inner: Any
    weight: float
    on_rank_0_only: bool = False

    def __call__(self, loss, module, ctx):
        scaled = not self.on_rank_0_only or ctx.rank == 0
        self.inner(loss * self.weight if scaled else loss, module, ctx)


def weighted(strategy: sg.Strategy, weight: float, **bug: bool) -> sg.Strategy:
    """A user's combinator, written as the docs show: one field substituted, the record evolved."""
    return attrs.evolve(
        strategy,
        name=f"{strategy.name}+weighted{weight}" + "-bug" * bool(bug),
        backward=WeightedBackward(strategy.backward, weight, **bug),
    )


@attrs.frozen
class LoggedWrap:
    """Wrap: the inner wrap, declared outside the reference (as a layer that distributes is)."""

    inner: Any
    in_reference: ClassVar[bool] = False

    def __call__(self, module, ctx):
        return self.inner(module, ctx)


def test_the_reference_keeps_a_user_s_layer_and_leaves_out_one_that_says_so():
    strategy = attrs.evolve(
        weighted(sg.with_clipping(sg.ddp(device="cpu"), max_norm=1.0), 3.0),
        wrap=LoggedWrap(sg.ddp(device="cpu").wrap),
    )
    reference = undistributed(strategy)
    assert reference.backward == WeightedBackward(sg.single_device("cpu").backward, 3.0)
    assert reference.wrap == sg.single_device("cpu").wrap
    assert reference.update.inner == sg.single_device("cpu").update  # stratagem's kept too


def test_a_user_s_combinator_over_ddp_passes_check_all_and_its_planted_bug_is_caught(
    stratagem_world,
):
    report = check_all(weighted(sg.ddp(), 3.0), world=stratagem_world)
    assert {"data-parallel-step", "accumulation", "ranks-in-sync"} <= set(report.passed)
    with pytest.raises(LawViolation) as caught:
        check_all(weighted(sg.ddp(), 3.0, on_rank_0_only=True), world=stratagem_world)
    assert caught.value.law in {"data-parallel-step", "wrap-preserves"}, str(caught.value)
