"""The collective-count law on simulated meshes of 64 and more ranks, and the two bugs it catches."""

from __future__ import annotations

import contextlib

import attrs
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import parallelize_module

import dry_run_models as M
import stratagem as sg
from stratagem.planning.layout import Layout
from stratagem.testing.laws import LawViolation, check_collective_counts, expected_collectives


@pytest.mark.parametrize("world_size", [64, 256])
@pytest.mark.parametrize("stack", ["fsdp", "accumulate(fsdp, 2)", "fsdp x tp", "hsdp"])
def test_every_stack_issues_what_its_layout_implies(stack, world_size):
    strategy, micro_batches = M.stacks(world_size)[stack]
    plan = check_collective_counts(
        strategy,
        M.blocks,
        M.batch(),
        world_size=world_size,
        forward=M.loss,
        micro_batches=micro_batches,
    )
    assert plan.layout.fsdp_units == M.DEPTH  # the law had groups to count


def test_a_no_sync_that_still_reduce_scatters_breaks_the_law():
    fsdp = sg.fsdp(device="cpu", shard_when=M.BLOCKS)

    def no_sync_that_syncs(module, ctx):  # planted: forgets set_requires_gradient_sync(False)
        return contextlib.nullcontext()

    leaky = sg.accumulate(attrs.evolve(fsdp, no_sync=no_sync_that_syncs), 2)
    with pytest.raises(LawViolation, match=r"reduce_scatter over 64: 6 \(expected 3\)"):
        check_collective_counts(leaky, M.blocks, M.batch(), forward=M.loss, micro_batches=2)
    assert not dist.is_initialized()


def test_a_plan_that_all_reduces_twice_breaks_the_law():
    def reduce_twice(model, mesh):  # planted: every row split's output is reduced again
        def reduce_again(module, args, output):
            # no_grad: an in-place collective on an output autograd tracks warns (an error
            # under the suite's filter); the planted bug only rewrites the values
            with torch.no_grad():
                dist.all_reduce(output, group=mesh.get_group())

        parallelize_module(model, mesh, M.tp_plan())
        for name, module in model.named_modules():
            if name.endswith((".o", ".down")):
                module.register_forward_hook(reduce_again)
        return model

    twice = sg.tensor_parallel(sg.fsdp(device="cpu", shard_when=M.BLOCKS), reduce_twice, size=2)
    with pytest.raises(LawViolation, match=r"all_reduce over 2: 24 \(expected 18\)"):
        check_collective_counts(twice, M.blocks, M.batch(), forward=M.loss)


def test_the_expected_counts_come_from_the_layout_not_from_what_was_seen():
    plan = sg.dry_run(M.stacks(64)["hsdp"][0], M.blocks, M.batch(), world_size=64, forward=M.loss)
    expected = expected_collectives(attrs.evolve(plan, micro_batches=3))
    assert expected == {
        ("all_gather", 32): 3 * 2 * M.DEPTH,
        ("reduce_scatter", 32): M.DEPTH,
        ("all_reduce", 2): M.DEPTH,
    }
    empty = attrs.evolve(plan, layout=Layout())
    assert expected_collectives(empty) == {}
