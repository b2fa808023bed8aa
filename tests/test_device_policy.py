"""What ``device="auto"`` means on CPU-only, one-GPU and multi-GPU hosts (issue 33 item 1).

The policy is tested through its seam, ``cuda_devices=``: the count of CUDA
devices a host has, so every host (this CPU one included) checks the answers a
one-GPU or a four-GPU host gives.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

import stratagem as sg
from stratagem.cli.demo import spawn_devices
from stratagem.devices import (
    FALLS_BACK_TO_CPU,
    asked_device,
    falls_back_to_cpu,
    resolve_device,
    warn_fallback,
)

_MPS = getattr(torch.backends, "mps", None)
NO_CUDA = torch.device("mps") if _MPS is not None and _MPS.is_available() else torch.device("cpu")


def expected(cuda: int, ranks: int, rank: int) -> torch.device:
    if cuda >= ranks:
        return torch.device("cuda", rank)  # each local rank its own device
    if cuda > 0:
        return torch.device("cpu")  # CUDA, but too few devices: every rank on the CPU
    return NO_CUDA


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("cuda", [0, 1, 2, 4])
def test_auto_gives_each_local_rank_its_own_gpu_or_puts_every_rank_on_the_cpu(cuda, ranks):
    devices = [resolve_device("auto", rank, ranks, cuda_devices=cuda) for rank in range(ranks)]
    assert devices == [expected(cuda, ranks, rank) for rank in range(ranks)]
    on_cuda = [device for device in devices if device.type == "cuda"]
    assert len(set(on_cuda)) == len(on_cuda), "two ranks on one GPU: NCCL's 'Duplicate GPU'"
    assert len({device.type for device in devices}) == 1, "the ranks of a host agree"


@pytest.mark.parametrize(("cuda", "ranks"), [(1, 2), (1, 4), (2, 4), (3, 4)])
def test_the_fallback_warns_on_local_rank_zero_naming_the_counts_and_the_fixes(cuda, ranks):
    with pytest.warns(sg.DeviceFallbackWarning) as caught:
        resolve_device("auto", 0, ranks, cuda_devices=cuda, warn=True)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message == FALLS_BACK_TO_CPU.format(cuda=cuda, ranks=ranks)
    for fragment in (
        f"{cuda} CUDA device(s) for {ranks} local ranks",
        "CPU (gloo)",
        f"devices={cuda}",
        "device='cuda:0', backend='gloo'",
        "device='cpu'",
    ):
        assert fragment in message
    assert issubclass(sg.DeviceFallbackWarning, UserWarning)


def test_the_other_ranks_and_the_hosts_that_fit_stay_silent():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rank in (1, 2, 3):  # only local rank 0 speaks for the host
            assert resolve_device("auto", rank, 4, cuda_devices=1, warn=True).type == "cpu"
        assert resolve_device("auto", 0, 4, cuda_devices=1).type == "cpu"  # warn=False
        for cuda, ranks in [(1, 1), (2, 2), (4, 2), (0, 2), (0, 4)]:
            resolve_device("auto", 0, ranks, cuda_devices=cuda, warn=True)
        warn_fallback("cpu", 4, cuda_devices=1)  # device='cpu' silences it
        warn_fallback("cuda:0", 4, cuda_devices=1)  # so does a device the user chose


def test_an_explicit_device_is_not_the_policy_s_business():
    assert resolve_device("cpu", 3, 4, cuda_devices=1) == torch.device("cpu")
    assert not falls_back_to_cpu("cpu", 4, cuda_devices=1)
    assert not falls_back_to_cpu(None, 4, cuda_devices=1)  # a setup that does not say
    assert falls_back_to_cpu("auto", 4, cuda_devices=1)


@pytest.mark.parametrize(
    "strategy",
    [
        sg.ddp(),
        sg.ddp_spawn(),
        sg.fsdp_spawn(),
        sg.hsdp(replicate=2, shard=1),
        sg.allreduce_grads_spawn(),
        sg.pipeline(stages=[["0"], ["1"]], microbatches=2),
        sg.single_device(),
        sg.with_clipping(sg.with_precision(sg.ddp_spawn(), "bf16-mixed"), max_norm=1.0),
        sg.accumulate(sg.fsdp_spawn(), 2),
    ],
    ids=lambda strategy: strategy.name,
)
def test_the_spawn_launcher_finds_what_device_a_strategy_asks_for(strategy):
    assert asked_device(strategy.setup) == "auto"
    asks_cpu = attrs_evolve_device(strategy)
    assert asked_device(asks_cpu.setup) == "cpu"


def attrs_evolve_device(strategy: sg.Strategy) -> sg.Strategy:
    """The same stack with its innermost setup asking for the CPU."""
    import attrs

    def evolve(setup: object) -> object:
        if hasattr(setup, "device"):
            return attrs.evolve(setup, device="cpu")  # type: ignore[misc]
        name = "inner" if hasattr(setup, "inner") else "join"
        return attrs.evolve(setup, **{name: evolve(getattr(setup, name))})  # type: ignore[misc]

    return attrs.evolve(strategy, setup=evolve(strategy.setup))


def test_a_spawned_launch_on_a_one_gpu_host_warns_once_in_the_parent():
    # What Spawn() calls before any rank starts, with the one-GPU host's count; the ranks it
    # starts resolve with warn=False (their env's source is 'spawn'), so this is the only one.
    strategy = sg.with_precision(sg.ddp_spawn(), "bf16-mixed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_fallback(asked_device(strategy.setup), 2, cuda_devices=1)
        for rank in range(2):
            resolve_device("auto", rank, 2, cuda_devices=1, warn=False)
    assert [(w.category, str(w.message)) for w in caught] == [
        (sg.DeviceFallbackWarning, FALLS_BACK_TO_CPU.format(cuda=1, ranks=2))
    ]


@pytest.mark.slow
def test_two_spawned_ranks_on_this_host_run_where_the_policy_says():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    falls_back = 0 < count < 2
    with pytest.warns(sg.DeviceFallbackWarning) if falls_back else contextlib.nullcontext():
        results = sg.launch(_where, sg.ddp_spawn(), devices=2)
    assert [device for device, _ in results] == [str(expected(count, 2, r)) for r in range(2)]
    if results[0][0] == "cpu":
        assert [backend for _, backend in results] == ["gloo", "gloo"]


def _where(strategy: sg.Strategy, ctx: sg.Context) -> tuple[str, str]:
    import torch.distributed as dist

    return str(ctx.device), str(dist.get_backend())


def test_the_demo_spawns_as_the_library_places_ranks():
    # The CLI refused --devices 2 on a one-GPU host; it now runs them where the policy says.
    cores = os.cpu_count() or 1
    assert spawn_devices(None, cuda_devices=1) == 1  # the default uses the GPU, and no warning
    assert spawn_devices(None, cuda_devices=4) == 2
    assert spawn_devices(None, cuda_devices=0) == min(2, cores)
    assert spawn_devices(min(2, cores), cuda_devices=1) == min(2, cores)
    assert spawn_devices(4, cuda_devices=4) == 4
    with pytest.raises(sg.UsageError, match=r"--devices 100000: this machine runs at most"):
        spawn_devices(100_000, cuda_devices=1)


def test_devices_a_scheduler_bound_to_each_task_are_used_not_left_for_the_cpu():
    # SLURM's --gpus-per-task=1: each of 4 tasks on a node sees one GPU, its own.
    assert resolve_device("auto", 3, 4, cuda_devices=1, bound_per_task=True) == torch.device(
        "cuda", 0
    )
    assert resolve_device("auto", 3, 4, cuda_devices=1) == torch.device("cpu")
    assert resolve_device("auto", 0, 1, cuda_devices=0, bound_per_task=True) == torch.device("cpu")
