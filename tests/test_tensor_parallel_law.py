"""The tensor-parallel law on 8 and 16 simulated ranks, checked against real gloo worlds of 2 and 4.

The planted bugs are the kit's mutation suite's: a bias added on every rank
before the row split's reduction (torchtitan PR #4245, `kit_strategies`), a
row split's output reduced twice, and a wrap that splits each rank's own
initialisation (`test_kit_mesh`).
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import stratagem as sg
from helpers import Block, block_plan
from kit_strategies import RowSplitPlan, shard_by_global_rank
from stratagem.errors import UsageError
from stratagem.testing.laws import (
    LawViolation,
    check_shard_partition,
    check_tensor_parallel,
    tensor_parallel_run,
)


def block() -> Block:
    torch.manual_seed(0)
    return Block(width=32, head=2)  # 16 heads: split over 8 or 16 ranks


def tokens() -> torch.Tensor:
    return torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(1))


def mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def rows() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def fsdp_x_tp(plan, size=2):
    return sg.tensor_parallel(sg.fsdp(device="cpu"), plan, size=size)


@pytest.mark.parametrize("size", [8, 16])
def test_megatron_splits_train_as_one_process_on_simulated_meshes(size):
    check_tensor_parallel(block_plan(), module=block(), batch=tokens(), size=size)
    check_tensor_parallel(fsdp_x_tp(block_plan()), module=block(), batch=tokens(), size=size)
    check_tensor_parallel(RowSplitPlan(), module=mlp(), batch=rows(), size=size)


def test_every_simulated_rank_holds_its_own_tensors():
    runs = tensor_parallel_run(block_plan(), module=block(), batch=tokens(), size=8, steps=1)
    assert len(runs) == 8
    start = [run[0][1]["norm.weight"] for run in runs]
    assert all(torch.equal(start[0], other) for other in start[1:])  # rank 0's, copied by wrap
    # the norm is not split: one storage shared by the ranks would be updated 8 times a step
    moved = [run[1][1]["norm.weight"] - run[0][1]["norm.weight"] for run in runs]
    reference = block()
    loss = reference(tokens()).pow(2).mean()
    loss.backward()
    assert torch.allclose(moved[5], -0.1 * reference.norm.weight.grad, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("size", [2, 4])
def test_the_simulation_gives_what_real_gloo_ranks_give(stratagem_world_of, size):
    simulated = tensor_parallel_run(block_plan(), module=block(), batch=tokens(), size=size)
    world = stratagem_world_of(size)
    real = tensor_parallel_run(block_plan(), module=block(), batch=tokens(), world=world)
    check_tensor_parallel(block_plan(), module=block(), batch=tokens(), world=world)
    assert len(real) == len(simulated) == size
    for rank in range(size):
        for step, ((sim_loss, sim), (real_loss, got)) in enumerate(
            zip(simulated[rank], real[rank], strict=True)
        ):
            assert step == 0 or abs(sim_loss - real_loss) <= 1e-6 * abs(real_loss), (rank, step)
            assert sim.keys() == got.keys()
            for name in sim:
                assert torch.allclose(sim[name], got[name], rtol=1e-6, atol=1e-7), (
                    rank,
                    step,
                    name,
                )


def reduce_twice(model, mesh):
    """The planted bug: every row split's output is all-reduced a second time."""

    def reduce_again(module, args, output):
        with torch.no_grad():  # in place on an output autograd tracks: rewrite the values only
            dist.all_reduce(output, group=mesh.get_group())

    parallelize_module(model, mesh, block_plan())
    model.o.register_forward_hook(reduce_again)
    model.down.register_forward_hook(reduce_again)
    return model


@attrs.frozen
class SplitWithoutCopying:
    """The planted bug: split each rank's own initialisation (no copy of rank 0's first)."""

    inner: object

    def __call__(self, module, ctx):
        return self.inner(parallelize_module(module, ctx.mesh["tp"], block_plan()), ctx)


@pytest.mark.parametrize("size", [8, 16])
def test_planted_tensor_parallel_bugs_are_caught(size):
    with pytest.raises(LawViolation, match=r"at step 1, rank 0's loss .* tensor-parallel size"):
        check_tensor_parallel(RowSplitPlan(bias_on_every_rank=True), module=mlp(), batch=rows(),
                              size=size)  # fmt: skip
    with pytest.raises(LawViolation, match=r"at step 1, rank 0's loss"):
        check_tensor_parallel(reduce_twice, module=block(), batch=tokens(), size=size)
    honest = fsdp_x_tp(block_plan())
    own_init = attrs.evolve(honest, wrap=SplitWithoutCopying(honest.wrap.inner))
    with pytest.raises(LawViolation, match=r"after the wrap, rank 1: norm.weight differs"):
        check_tensor_parallel(own_init, module=block(), batch=tokens(), size=size)


@pytest.mark.parametrize("world_size", [64])
def test_tensor_parallel_groups_take_one_batch_on_simulated_worlds(world_size):
    strategy = fsdp_x_tp(block_plan(), size=4)
    samples = world_size * 2 + 7
    check_shard_partition(strategy, world_size=world_size, size=samples, simulated=True)
    dealt = attrs.evolve(strategy, name="deals-globally", shard=shard_by_global_rank)
    with pytest.raises(LawViolation, match=r"(?s)shard-partition.*one data-parallel rank"):
        check_shard_partition(dealt, world_size=world_size, size=samples, simulated=True)
    with pytest.raises(UsageError, match=r"'simulated=True' deals on simulated ranks"):
        check_shard_partition(strategy, world=object(), simulated=True)
    assert not dist.is_initialized()


def test_a_real_world_catches_what_the_simulation_catches(stratagem_world):
    plan = RowSplitPlan(bias_on_every_rank=True)
    with pytest.raises(LawViolation, match=r"at step 1, rank 0's loss"):
        check_tensor_parallel(plan, module=mlp(), batch=rows(), world=stratagem_world)


def test_bad_input_names_the_argument():
    good = {"module": mlp(), "batch": rows()}
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    cases = [
        (lambda: check_tensor_parallel(3, **good), r"'subject' must be .* got 3, an int"),
        (
            lambda: check_tensor_parallel(plan, **good, size=1),
            r"check_tensor_parallel: 'size' must be an int of at",
        ),
        (lambda: check_tensor_parallel(fsdp_x_tp(plan, 4), **good, size=6), r"do not divide"),
        (lambda: check_tensor_parallel(plan, module=None, batch=rows()), r"'module' must be"),
        (lambda: check_tensor_parallel(plan, module=mlp(), batch=[rows()]), r"tensor batch"),
        (lambda: check_tensor_parallel(plan, **good, steps=0), r"'steps' must be a positive"),
        (lambda: check_tensor_parallel(plan, **good, contract=1e-3), r"'contract' must be"),
    ]
    for call, message in cases:
        with pytest.raises(UsageError, match=message):
            call()
    assert not dist.is_initialized()


def test_a_plan_that_fails_on_split_tensors_says_where():
    with pytest.raises(RuntimeError) as caught:  # 4 heads of 4 features: 8 ranks cannot split them
        check_tensor_parallel(
            block_plan(), module=Block(width=16, head=4), batch=torch.ones(2, 3, 16)
        )
    assert (
        "check_tensor_parallel: raised while training on 8 simulated ranks"
        in caught.value.__notes__
    )
    assert not dist.is_initialized()
