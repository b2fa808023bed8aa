"""sg.dry_run: a strategy's memory and collectives per rank, on simulated worlds of up to 1,024 ranks.

Every figure here is derived from the model and the stack (a shard is
``ceil(rows / N)`` rows; FSDP gathers each resharded unit twice and
reduce-scatters it once), so a wrong simulation fails by an exact count.
tests/test_dry_run_worlds.py compares the same figures with real gloo worlds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import dry_run_models as M
import stratagem as sg
from stratagem.planning.report import MEMORY_CATEGORIES


def plan(strategy, world_size: int, micro_batches: int = 1) -> sg.DryRun:
    return sg.dry_run(
        strategy,
        M.blocks,
        M.batch(),
        world_size=world_size,
        forward=M.loss,
        micro_batches=micro_batches,
    )


def shard_bytes(model: torch.nn.Module, ranks: int) -> int:
    """What rank 0 holds of ``model`` sharded row-wise over ``ranks``: torch.chunk's first piece."""
    return sum(
        math.ceil(p.shape[0] / ranks) * p[0].numel() * p.element_size() for p in model.parameters()
    )


def adamw_bytes(held: int, tensors: int) -> int:
    return 2 * held + 4 * tensors  # exp_avg and exp_avg_sq per shard, and a float32 step each


@pytest.mark.parametrize("world_size", [8, 64, 1024])
def test_fsdp_holds_one_shard_and_gathers_each_block_twice(world_size):
    got = plan(M.stacks(world_size)["fsdp"][0], world_size)
    model = M.blocks()
    assert got.parameters == shard_bytes(model, world_size)
    assert got.optimizer_state == adamw_bytes(got.parameters, len(list(model.parameters())))
    # Each block is gathered for forward and again for backward, and its gradients are
    # reduce-scattered once; the root holds no parameter of its own, so it sends nothing.
    counts = {(c.kind, c.group_size): c.count for c in got.collectives}
    assert counts == {
        ("all_gather", world_size): 2 * M.DEPTH,
        ("reduce_scatter", world_size): M.DEPTH,
    }
    [gather] = [c for c in got.collectives if c.kind == "all_gather"]
    shards = shard_bytes(torch.nn.Sequential(*M.blocks()), world_size)
    assert gather.bytes == 2 * shards  # each gather puts in this rank's shard of the block
    assert gather.ring_bytes == (world_size - 1) * gather.bytes


def test_accumulation_reduce_scatters_once_per_optimizer_step_on_64_ranks():
    got = plan(M.stacks(64)["accumulate(fsdp, 2)"][0], 64, micro_batches=2)
    assert got.count("all_gather") == 2 * 2 * M.DEPTH  # gathered in every micro-batch
    assert got.count("reduce_scatter") == M.DEPTH  # but synchronised once
    assert got.peak["gradients"] > 0  # held unsharded between micro-batches, as no_sync does


def test_hsdp_all_reduces_each_block_across_its_replicas():
    got = plan(M.stacks(64)["hsdp"][0], 64)
    counts = {(c.kind, c.group_size): c.count for c in got.collectives}
    assert counts == {
        ("all_gather", 32): 2 * M.DEPTH,
        ("reduce_scatter", 32): M.DEPTH,
        ("all_reduce", 2): M.DEPTH,
    }
    assert got.parameters == shard_bytes(M.blocks(), 32)


def test_tensor_parallel_all_reduces_once_per_row_split_forward_and_column_split_backward():
    got = plan(M.stacks(64)["fsdp x tp"][0], 64)
    rows = sum(type(style).__name__ == "RowwiseParallel" for style in M.tp_plan().values())
    columns = len(M.tp_plan()) - rows
    assert ("all_reduce", 2) in {(c.kind, c.group_size) for c in got.collectives}
    assert got.count("all_reduce") == rows + columns
    assert {c.group_size for c in got.collectives if c.kind != "all_reduce"} == {32}


def test_activation_checkpointing_lowers_the_activations_and_nothing_sent():
    plain = plan(M.stacks(8)["fsdp"][0], 8)
    checkpointed = plan(M.stacks(8)["checkpointed fsdp"][0], 8)
    assert checkpointed.peak["activations"] < plain.peak["activations"]
    assert checkpointed.parameters == plain.parameters
    # Recomputation gathers each block again in backward only where it was resharded.
    assert checkpointed.count("reduce_scatter") == plain.count("reduce_scatter")


def test_the_table_names_every_category_and_collective():
    got = plan(M.stacks(64)["hsdp"][0], 64)
    table = str(got)
    assert table.splitlines()[0] == "dry run: hsdp, rank 0 of 64 (simulated)"
    for row in (*MEMORY_CATEGORIES, "all_gather", "reduce_scatter", "all_reduce"):
        assert f"  {row}" in table, row
    assert "sent per rank, at least (ring)" in table
    assert got.peak_bytes == sum(got.peak.values()) > got.parameters


def test_a_dry_run_leaves_no_process_group_behind_even_when_it_fails():
    with pytest.raises(sg.DryRunError):
        sg.dry_run(
            sg.fsdp(device="cpu"),
            M.blocks,
            M.batch(),
            world_size=4,
            forward=lambda model, batch: model(batch).sum().item(),
        )
    assert not dist.is_initialized()
    assert plan(M.stacks(4)["fsdp"][0], 4).count("reduce_scatter") == M.DEPTH  # and runs again


def test_a_step_that_reads_values_is_refused_with_the_phase_and_the_line_named():
    with pytest.raises(sg.DryRunError, match=r"fsdp's step failed in a simulated world of 4 ranks"
                       r".* at \S*test_dry_run.py:\d+ in <lambda>"):  # fmt: skip
        sg.dry_run(
            sg.fsdp(device="cpu"),
            M.blocks,
            M.batch(),
            world_size=4,
            forward=lambda model, batch: torch.tensor(model(batch).sum().item()),
        )


def test_a_pipeline_is_refused_where_torch_reads_a_value():
    pipeline = sg.pipeline(stages=[["0"], ["1", "2"]], microbatches=2, device="cpu")
    with pytest.raises(sg.DryRunError, match=r"pipelining/schedules.py:\d+ in _warmup_p2p"):
        sg.dry_run(pipeline, M.blocks, (M.batch(), M.batch()), world_size=2,
                   forward=lambda out, target: (out - target).pow(2).mean())  # fmt: skip
    assert not dist.is_initialized()


def ddp_buckets(cap: int, first: int) -> int:
    """DDP's buckets after its first step, counted by hand: backward's order, closed at a cap."""
    sizes = [p.numel() * p.element_size() for p in M.blocks().parameters()][::-1]
    count, held, limit = 0, 0, first
    for size in sizes:
        held += size
        if held >= limit:
            count, held, limit = count + 1, 0, cap
    return count + (held > 0)


@pytest.mark.parametrize("world_size", [8, 64])
def test_replicated_data_parallelism_holds_everything_and_all_reduces_every_gradient(world_size):
    params = list(M.blocks().parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    stacks = {
        "ddp": (sg.ddp(device="cpu"), ddp_buckets(25 << 20, 1 << 20), 0),
        "ddp, 48 KiB": (sg.ddp(device="cpu", bucket_cap_mb=3 / 64), ddp_buckets(48 << 10, 48 << 10), 0),
        # allreduce_grads sends with its last bucket one 0/1 flag per parameter, and one more
        "allreduce_grads": (sg.allreduce_grads(device="cpu"), 1, 4 * (len(params) + 1)),
    }  # fmt: skip
    for name, (strategy, buckets, flags) in stacks.items():
        got = sg.dry_run(strategy, M.blocks, M.batch(), world_size=world_size, forward=M.loss)
        assert got.parameters == whole, name
        assert got.optimizer_state == 2 * whole + 4 * len(params), name  # AdamW: 2 moments, a step
        assert [(c.kind, c.group_size, c.count, c.bytes) for c in got.collectives] == [
            ("all_reduce", world_size, buckets, whole + flags)
        ], name
    assert ddp_buckets(48 << 10, 48 << 10) > 1  # the small cap splits the model
    assert not dist.is_initialized()


def test_a_model_factory_that_allocates_is_refused():
    with pytest.raises(sg.UsageError, match=r"put 0.norm.weight \(cpu\), 0.norm.bias \(cpu\)"):
        sg.dry_run(
            sg.fsdp(device="cpu"),
            lambda: M.blocks().to_empty(device="cpu"),
            M.batch(),
            world_size=4,
            forward=M.loss,
        )


def test_a_dry_run_inside_a_joined_world_is_refused():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(sg.UsageError, match="a process group of 1 rank.* already initialised"):
            plan(sg.fsdp(device="cpu"), 4)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1024])  # 8 and 64 too in benchmarks/dry_run.py
def test_a_162m_parameter_gpt_under_fsdp_hsdp_and_fsdp_x_tp(world_size):
    model = M.gpt_small()
    assert sum(p.numel() for p in model.parameters()) > 160e6
    tensors = len(list(model.parameters()))
    stacks = M.gpt_stacks(world_size)
    for name, strategy in stacks.items():
        got = sg.dry_run(
            strategy, M.gpt_small, M.gpt_batch(), world_size=world_size, forward=M.gpt_loss
        )
        assert got.optimizer_state == adamw_bytes(got.parameters, tensors), name
        sharded = {c.kind: c.group_size for c in got.collectives if c.kind != "all_reduce"}
        if name == "fsdp":
            assert got.parameters == shard_bytes(model, world_size)
            assert got.count("all_gather") == 2 * 12 + 1  # the root stays gathered for backward
            assert got.count("reduce_scatter") == 12 + 1
        if name == "hsdp":  # shard groups of 8 whatever the world: what each holds stays put
            assert got.parameters == shard_bytes(model, 8)
            assert {c.group_size for c in got.collectives if c.kind == "all_reduce"} == (
                {world_size // 8} if world_size > 8 else set()
            )
        if name == "fsdp x tp":
            assert got.count("all_reduce") == 12 * 6  # 2 row splits forward, 4 column backward
            if world_size > 8:
                assert set(sharded.values()) == {world_size // 8}


def test_a_later_dry_run_sees_its_own_tensor_parallel_groups():
    # DTensor caches sharding results with the mesh they ran on; a later simulated world's
    # equal tensor-parallel sub-mesh got the old one back, whose group was gone: its
    # all-reduces were counted over the whole world (64) instead of their group of 2.
    fsdp = sg.fsdp(device="cpu", shard_when=M.BLOCKS)
    hsdp = sg.hsdp(device="cpu", replicate=4, shard=8, shard_when=M.BLOCKS)
    for base in (fsdp, hsdp):
        strategy = sg.tensor_parallel(base, M.tp_plan(), size=2)
        got = sg.dry_run(strategy, M.blocks, M.batch(), world_size=64, forward=M.loss)
        reduces = {c.group_size: c.count for c in got.collectives if c.kind == "all_reduce"}
        assert reduces.get(2) == 6 * M.DEPTH and 64 not in reduces, (base.name, reduces)
