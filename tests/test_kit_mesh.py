"""The kit's laws on mesh strategies: FSDP x TP on 2x2 ranks, TP alone on 2, HSDP on 2x2.

Each passes ``check_all`` against ``single_device()`` on the whole batch (a
small transformer block with Megatron's plan for the tensor-parallel ones),
and a planted bug in each of the two places tensor parallelism can go wrong,
the batches a group takes and the weights it splits, is caught.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
import torch
from torch.distributed.tensor.parallel import parallelize_module

import stratagem as sg
from helpers import block_plan, make_block
from kit_strategies import shard_by_global_rank
from stratagem.testing import Contract, LawViolation, check_all

pytestmark = pytest.mark.slow

LAWS = {
    "reduce-arithmetic", "reduce-idempotent", "gather-order", "broadcast-from-every-source",
    "wrap-preserves", "data-parallel-step", "accumulation", "no-sync", "ranks-in-sync",
    "purity", "checkpoint-round-trip", "checkpoint-resume", "checkpoint-strict",
    "shard-partition",
}  # fmt: skip


def batch(rows: int) -> torch.Tensor:
    return torch.randn(rows, 6, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("size", "world", "names"),
    [(2, 4, {"shard": "dp_shard", "tp": "model"}), (2, 2, None)],
    ids=["fsdp x tp, 2x2, named as torchtitan names", "tp, 2"],
)  # stratagem's own names: the combinator stacks below
def test_tensor_parallel_strategies_pass_every_law(size, world, names):
    strategy = sg.tensor_parallel(sg.fsdp(mesh_names=names), block_plan(), size=size)
    report = check_all(strategy, world_size=world, module=make_block(), batch=batch(4 * world))
    assert set(report.passed) == LAWS, report


LOW = Contract(rtol=3e-2, atol=3e-2)  # bf16: the ranks and the reference round alike, mostly
STACKS = {
    "clipped (a global norm over two meshes)": (lambda s: sg.with_clipping(s, max_norm=0.05), None),
    "accumulated": (lambda s: sg.accumulate(s, 2), None),
    "bf16-mixed": (lambda s: sg.with_precision(s, "bf16-mixed"), LOW),
    "checked": (sg.checked, None),
}


@pytest.mark.parametrize("stack", STACKS)
def test_combinators_on_fsdp_x_tp_pass_every_law(stack):
    combine, contract = STACKS[stack]
    strategy = combine(sg.tensor_parallel(sg.fsdp(), block_plan(), size=2))
    report = check_all(
        strategy, world_size=4, module=make_block(), batch=batch(16), contract=contract
    )
    precision = {"step-autocast", "precision-close-to-float32", "float32-master-weights"}
    arithmetic = {"combinator-arithmetic"} if stack != "checked" else set()
    assert set(report.passed) == LAWS | arithmetic | (precision if contract else set()), report


def test_hsdp_passes_every_law_on_2x2():
    report = check_all(sg.hsdp(replicate=2, shard=2), world_size=4)
    assert {"data-parallel-step", "accumulation", "no-sync", "checkpoint-round-trip"} <= set(
        report.passed
    ), report


@attrs.frozen
class SplitWithoutCopying:
    """The planted bug: split each rank's own initialisation (no copy of rank 0's first)."""

    inner: object
    in_reference: ClassVar[bool] = False  # it distributes: the reference leaves it out

    def __call__(self, module, ctx):
        return self.inner(parallelize_module(module, ctx.mesh["tp"], block_plan()), ctx)


def test_planted_tensor_parallel_bugs_are_caught():
    strategy = sg.tensor_parallel(sg.fsdp(), block_plan(), size=2)
    module, data = make_block(), batch(16)
    dealt = attrs.evolve(strategy, name="deals-globally", shard=shard_by_global_rank)
    with pytest.raises(LawViolation, match=r"(?s)shard-partition.*one data-parallel rank"):
        check_all(dealt, world_size=4, module=module, batch=data)
    unsynced = attrs.evolve(strategy, name="splits-own-init", wrap=SplitWithoutCopying(
        attrs.evolve(strategy.wrap.inner, sync_module_states=False)
    ))  # fmt: skip
    with pytest.raises(LawViolation, match=r"wrap-preserves|data-parallel-step"):
        check_all(unsynced, world_size=4, module=module, batch=data)
