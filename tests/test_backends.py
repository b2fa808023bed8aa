"""``backend=`` takes what ``init_process_group`` takes, device mappings included."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from stratagem.process_group import JoinProcessGroup, check_backend, default_backend


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        (None, None),
        ("gloo", "gloo"),
        ("NCCL", "nccl"),
        ("cuda:gloo", "cuda:gloo"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        (" cpu:gloo , cuda:nccl ", "cpu:gloo,cuda:nccl"),
    ],
)
def test_torch_backend_strings_are_accepted_and_normalised(given, kept):
    # torchtitan joins with "cpu:gloo,cuda:nccl" for its CPU-side traffic: refused before.
    assert check_backend(given) == kept
    for factory in (sg.ddp, sg.allreduce_grads):
        assert factory(backend=given).setup.backend == kept
    # A mesh's setup joins through JoinProcessGroup.
    assert sg.fsdp(backend=given, device="cpu").setup.join.backend == kept
    assert sg.hsdp(replicate=2, shard=2, backend=given, device="cpu").setup.join.backend == kept


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("foo", r"'backend' must be None, one of 'gloo', 'nccl'.* \(got 'foo', a str\)"),
        ("", r"'backend' must be None.* \(got '', a str\)"),
        (3, r"'backend' must be None.* \(got 3, an int\)"),
        ("cuda:foo", r"'backend': 'cuda:foo' in 'cuda:foo' is not a device:backend pair"),
        ("warp:gloo", r"'backend': 'warp' in 'warp:gloo' is not a device type"),
        ("cuda:gloo,cuda:nccl", r"device 'cuda' is mapped twice in 'cuda:gloo,cuda:nccl'"),
        ("cpu:gloo,", r"'' in 'cpu:gloo,' is not a device:backend pair"),
    ],
)
def test_malformed_backends_are_refused_naming_the_value(given, message):
    with pytest.raises(sg.UsageError, match=message):
        sg.ddp(backend=given, device="cpu")


def test_none_is_torchs_own_default():
    assert default_backend(torch.device("cpu")) == "gloo"
    # NCCL alone carries no CPU tensor: gloo beside it serves checkpoints, results, flags.
    assert default_backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"


def test_nccl_without_a_cuda_device_is_refused_at_setup():
    setup = JoinProcessGroup(device="cpu", backend="nccl")
    with pytest.raises(sg.UsageError, match="nccl"):
        setup(sg.Env())
