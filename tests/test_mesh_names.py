"""Mesh dimensions named as the user likes (issue 36): every field asks the context for the name.

torchtitan calls the data-parallel dimensions "dp_replicate" and "dp_shard";
a stack built with those names must deal batches, split layers, plan and
train as the same stack with stratagem's names.
"""

from __future__ import annotations

import torch

import dry_run_models as M
import stratagem as sg
from helpers import block_plan, make_block
from stratagem.planning.simulated_world import simulated_world
from stratagem.testing.laws import check_shard_partition, check_tensor_parallel

TITAN = {"replicate": "dp_replicate", "shard": "dp_shard", "tp": "model"}


def fsdp_x_tp(world_size: int, **names):
    hybrid = sg.hsdp(device="cpu", replicate=2, shard=world_size // 4, shard_when=M.BLOCKS, **names)
    return sg.tensor_parallel(hybrid, M.tp_plan(), size=2)


def test_the_mesh_has_the_users_names_and_the_context_reads_them():
    strategy = fsdp_x_tp(8, mesh_names=TITAN)
    with simulated_world(8, rank=5):
        ctx = strategy.setup(sg.Env(rank=5, world_size=8, local_world_size=8, master_port=1))
        assert ctx.mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "model")
        assert ctx.mesh_names == sg.MeshNames(**TITAN)
        assert ctx.data_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
        assert ctx.data_parallel == (2, 4)  # rank 5 is model-parallel rank 1 of data rank 2
    default = fsdp_x_tp(8)
    with simulated_world(8, rank=5):
        ctx = default.setup(sg.Env(rank=5, world_size=8, local_world_size=8, master_port=1))
        assert ctx.mesh.mesh_dim_names == ("replicate", "shard", "tp")
        assert ctx.data_parallel == (2, 4)


def test_a_renamed_stack_deals_and_plans_as_the_default_one():
    for names in ({}, {"mesh_names": TITAN}):
        check_shard_partition(fsdp_x_tp(64, **names), world_size=64, size=150, simulated=True)
    plans = [
        sg.dry_run(fsdp_x_tp(64, **names), M.blocks, M.batch(), world_size=64, forward=M.loss)
        for names in ({}, {"mesh_names": TITAN})
    ]
    assert plans[0].layout == plans[1].layout
    assert plans[0].layout.row_splits == M.DEPTH * 2  # the split was found under "model"
    assert plans[0].collectives == plans[1].collectives


def test_a_renamed_tensor_parallel_split_trains_as_one_process():
    strategy = sg.tensor_parallel(sg.fsdp(device="cpu", mesh_names={"tp": "model"}), block_plan())
    check_tensor_parallel(strategy, module=make_block(), batch=torch.randn(4, 6, 16), size=8)
