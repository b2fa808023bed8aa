"""Setup errors a user meets before any collective runs."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg


def test_nccl_on_a_cpu_device_is_a_clear_error():
    with pytest.raises(sg.UsageError, match=r"backend 'nccl' runs on CUDA devices only.*'cpu'"):
        sg.ddp(device="cpu", backend="nccl").setup(sg.Env())
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: nccl may run")
def test_nccl_without_cuda_is_a_clear_error_for_every_built_in_that_joins():
    for strategy in (
        sg.ddp(backend="nccl", device="cpu"),
        sg.fsdp(backend="nccl", device="cpu"),
        sg.allreduce_grads(backend="nccl", device="cpu"),
    ):
        with pytest.raises(sg.UsageError, match=r"use backend=None \(gloo on the CPU\) or 'gloo'"):
            strategy.setup(sg.Env())
