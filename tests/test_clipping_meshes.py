"""Clipping sharded gradients whose meshes are equal but not the same object.

Reported by the suite: the GPT example's fsdp run printed another parameters digest
after an fsdp x tp run in the same processes. Some of its gradients then held a
second `DeviceMesh` object equal to the first (same ranks, names, device), and
clipping, which grouped gradients by mesh identity, took its per-mesh path (the
norm of the norms) instead of torch's `clip_grad_norm_`: a norm a few bits off.
Equal meshes are one mesh: grouped by equality, the norm and the clipped
gradients are torch's own, bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import stratagem as sg
from stratagem.testing import World

pytestmark = pytest.mark.slow


def two_meshes_clipped(strategy, ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # Four shapes: torch reuses a DTensor spec made for an equal one, mesh object included, so
    # layers of one shape would all hold the first mesh object; these keep the one given.
    widths = [13, 11, 17, 19, 13]
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    first = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("shard",))
    second = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("shard",))
    assert first == second and first is not second
    for index, layer in enumerate(model):
        fully_shard(layer, mesh=first if index % 2 else second)
    fully_shard(model, mesh=first)
    assert len({id(p.device_mesh) for p in model.parameters()}) == 2
    results = []
    for seed in range(8):  # batches whose two norms round differently from one
        torch.manual_seed(seed * 10 + ctx.rank)
        model.zero_grad()
        model(torch.randn(5, 13) * (seed + 1)).square().sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = sg.clip_grad_norm(model, 0.01)
        ours = [p.grad.full_tensor() for p in model.parameters()]
        for p, grad in zip(model.parameters(), grads, strict=True):
            p.grad.copy_(grad)
        theirs_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01).full_tensor()
        theirs = [p.grad.full_tensor() for p in model.parameters()]
        same = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        results.append((float(norm), float(theirs_norm), same))
    return results


def test_equal_meshes_clip_as_torch_does_bit_for_bit():
    # A world of its own: in the suite's shared one, specs cached by earlier tests could hand
    # every layer one mesh object, and the case would not arise.
    with World(2) as world:
        outcomes = world.run(two_meshes_clipped, sg.fsdp(device="cpu"))
    for rank, results in enumerate(outcomes):
        for seed, (ours, theirs, same_grads) in enumerate(results):
            assert ours == theirs, (rank, seed)
            assert same_grads, (rank, seed)
