"""Law ``collective-counts``: one optimizer step issues the collectives its stack implies, no more.

The stack runs on a simulated world (`stratagem.dry_run`), so the law holds
on meshes no test host has (64 ranks by default, 1,024 in seconds). What it
expects is derived from how the wrapped model is split (`Layout`), per
optimizer step of ``m`` micro-batches:

- each FSDP group that holds parameters is all-gathered before its forward in
  every micro-batch, and again before its backward when it was resharded
  after forward: ``m * (groups + resharded groups)`` all-gathers over the
  shard group;
- its gradients are reduce-scattered once per optimizer step, not in the
  ``no_sync`` micro-batches: ``groups`` reduce-scatters;
- under HSDP, its gradient shard is all-reduced across the replicas once:
  ``groups`` all-reduces over the replica group;
- tensor parallelism all-reduces each row-split layer's output in forward and
  each column-split layer's input gradient in backward: ``m * (rows +
  columns)`` all-reduces over the tensor-parallel group (a column split whose
  input needs no gradient, a model's very first layer, sends nothing in
  backward: start such a model with a layer that is not split).

A group of one rank sends nothing. Any other collective, or another count,
breaks the law: a ``no_sync`` that still synchronises, a plan that reduces a
layer's output twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from stratagem.fields import ForwardFn, StrategyLike
from stratagem.planning.dry_run import dry_run
from stratagem.planning.report import DryRun
from stratagem.testing.laws._core import LawViolation

__all__ = ["check_collective_counts", "expected_collectives"]


def expected_collectives(plan: DryRun) -> dict[tuple[str, int], int]:
    """Return the calls by (kind, group size) that ``plan``'s layout implies for one step."""
    layout, micro_batches = plan.layout, plan.micro_batches
    expected: Counter[tuple[str, int]] = Counter()
    if layout.fsdp_units and layout.shard_size > 1:
        gathers = micro_batches * (layout.fsdp_units + layout.resharded_units)
        expected["all_gather", layout.shard_size] += gathers
        expected["reduce_scatter", layout.shard_size] += layout.fsdp_units
    if layout.fsdp_units and layout.replicas > 1:
        expected["all_reduce", layout.replicas] += layout.fsdp_units
    if layout.tp_size > 1:
        splits = layout.row_splits + layout.column_splits
        expected["all_reduce", layout.tp_size] += micro_batches * splits
    return dict(expected)


def check_collective_counts(
    strategy: StrategyLike,
    model: Callable[[], torch.nn.Module],
    batch: Any,
    *,
    world_size: int = 64,
    forward: ForwardFn | None = None,
    micro_batches: int = 1,
) -> DryRun:
    """Check that a step on ``world_size`` simulated ranks issues what its stack implies.

    Takes the arguments of `stratagem.dry_run` and returns its report.

    Raises:
        LawViolation: a collective the layout does not imply, or another count.
        DryRunError: the stack cannot be simulated (see `stratagem.dry_run`).
    """
    plan = dry_run(
        strategy,
        model,
        batch,
        world_size=world_size,
        forward=forward,
        micro_batches=micro_batches,
    )
    found = {(c.kind, c.group_size): c.count for c in plan.collectives}
    expected = expected_collectives(plan)
    if found != expected:
        wrong = sorted(set(found) | set(expected))
        rows = ", ".join(
            f"{kind} over {size}: {found.get((kind, size), 0)} (expected "
            f"{expected.get((kind, size), 0)})"
            for kind, size in wrong
            if found.get((kind, size), 0) != expected.get((kind, size), 0)
        )
        raise LawViolation(
            "collective-counts",
            strategy,
            f"one optimizer step of {micro_batches} micro-batch(es) on {world_size} simulated "
            f"ranks; {plan.layout}",
            f"calls per step: {rows}",
        )
    return plan
