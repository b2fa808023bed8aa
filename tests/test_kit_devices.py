"""The kit on any device (issue 33, item 3).

Laws compare results on the CPU whatever device the strategy trains on (each rank
sends its results back on the CPU; every comparison moves both sides there); the data
each rank trains on follows the strategy's device; the `World` and the collective laws
run in NCCL-like worlds, whose default group carries no CPU tensor. The CUDA case
itself (``check_all(ddp(device="cuda:0", backend="gloo"))``, which raised torch's
"Expected all tensors to be on the same device" inside the broadcast law) runs where
there is a GPU.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.distributed as dist

import stratagem as sg
from stratagem.fields import REDUCE_OPS
from stratagem.testing import World, check_all, laws
from stratagem.testing.examples import rank_and_size
from stratagem.testing.laws._core import max_difference, on_host, own_share, same, within

# --- comparisons on the CPU, across dtypes ----------------------------------------------------


def test_comparisons_take_tensors_of_different_dtypes():
    exact = torch.tensor([0.1, 1.0 / 3.0, 2.0], dtype=torch.float64)
    rounded = exact.to(torch.bfloat16)
    assert not same(rounded, exact)  # the dtype differs: not the same values
    assert same(exact.clone(), exact)
    assert 0 < max_difference(rounded, exact) < 2e-3
    assert within(rounded, exact, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0.0)
    assert not within(rounded, exact, rtol=0.0, atol=0.0)
    assert not within(rounded, exact[:2], rtol=1.0, atol=1.0)  # shapes differ


def test_first_difference_compares_states_of_different_dtypes():
    theirs = {"model.w": torch.tensor([0.1, -1.0 / 3.0, 0.7])}
    ours = {"model.w": theirs["model.w"].to(torch.float16)}
    assert laws.first_difference(ours, theirs, rtol=1e-3, atol=0.0) is None
    found = laws.first_difference(ours, theirs, rtol=0.0, atol=0.0)
    assert found is not None and found.key == "model.w" and found.absolute > 0


def test_results_come_back_detached_and_on_the_cpu():
    weight = torch.nn.Parameter(torch.ones(2))
    hosted = on_host({"out": [weight * 2, "label"], "n": 3})
    assert hosted["out"][0].device.type == "cpu" and not hosted["out"][0].requires_grad
    assert hosted["out"][1] == "label" and hosted["n"] == 3


def test_the_share_a_rank_trains_on_follows_the_strategys_device():
    ctx = sg.single_device("cpu").setup(sg.Env())
    elsewhere = attrs.evolve(ctx, device=torch.device("meta"))  # a device other than the CPU
    batch = (torch.arange(8.0).reshape(4, 2), torch.arange(4))
    inputs, targets = own_share(batch, elsewhere)
    assert inputs.device.type == "meta" and targets.device.type == "meta"
    assert inputs.shape == (4, 2)
    assert own_share(batch, ctx)[0].device.type == "cpu"


# --- the World and the collective laws in an NCCL-like world ------------------------------------


def _default_group_refuses_cpu_tensors(strategy, ctx):
    try:
        dist.all_reduce(torch.ones(1), group=ctx.group)
    except RuntimeError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def world_of_two():
    with World(2) as world:
        yield world


@pytest.mark.slow
def test_the_world_and_the_collective_laws_run_in_an_nccl_like_world(nccl_like, world_of_two):
    assert world_of_two.run(rank_and_size, nccl_like) == [(0, 2), (1, 2)]
    # The world is NCCL-like indeed: its default group cannot carry a CPU tensor.
    refusals = world_of_two.run(_default_group_refuses_cpu_tensors, nccl_like)
    assert all(refusal and "cpu" in refusal.lower() for refusal in refusals), refusals
    values = [torch.tensor([1.5 * r - 2.0, 4.0 + r, -float(r)]) for r in range(2)]
    for op in REDUCE_OPS:
        laws.check_reduce(nccl_like, values, op, world=world_of_two)
    laws.check_reduce(nccl_like, [v.long() for v in values], "max", world=world_of_two)
    for op in ("mean", "max", "min"):
        laws.check_reduce_idempotent(nccl_like, values, op, world=world_of_two)
    laws.check_gather(nccl_like, values, world=world_of_two)
    laws.check_broadcast(nccl_like, values, world=world_of_two)  # with a barrier at the end
    laws.check_shard_partition(nccl_like, world=world_of_two)


# --- the CUDA case itself -------------------------------------------------------------------------

CUDA_STRATEGIES = {
    "ddp": lambda: sg.ddp(device="cuda:0", backend="gloo"),
    "fsdp": lambda: sg.fsdp(device="cuda:0", backend="gloo"),
    "allreduce_grads": lambda: sg.allreduce_grads(device="cuda:0", backend="gloo"),
    "ddp+bf16-mixed": lambda: sg.with_precision(
        sg.ddp(device="cuda:0", backend="gloo"), "bf16-mixed"
    ),
}


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; none here")
@pytest.mark.parametrize("name", sorted(CUDA_STRATEGIES))
def test_check_all_passes_on_a_cuda_strategy_of_two_ranks(world_of_two, tmp_path, name):
    # Two ranks on cuda:0 with gloo: a one-GPU host can run it (NCCL would refuse the duplicate).
    report = check_all(CUDA_STRATEGIES[name](), world=world_of_two, directory=tmp_path)
    assert {"broadcast-from-every-source", "data-parallel-step"} <= set(report.passed)
