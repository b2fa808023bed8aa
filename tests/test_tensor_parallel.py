"""tensor_parallel on real gloo ranks: FSDP x TP on a 2x2 mesh and TP alone equal one process.

A small transformer block (attention + MLP) with Megatron's plan trains for
several steps on batches that ``shard`` deals; every parameter and AdamW slot,
gathered whole, must equal ``single_device()`` training on the whole batch.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from helpers import (
    assert_equal_to_reference,
    block_plan,
    make_block,
    mse,
    trained_alone,
    whole_state,
)
from stratagem.combinators.tensor_parallel import TensorParallelWrap
from stratagem.meshes import mesh_dims

STEPS = 3
BATCH = 8  # global batch; 4 per data-parallel rank on the 2x2 mesh


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(STEPS * BATCH, 6, 16, generator=generator),
        torch.randn(STEPS * BATCH, 6, 16, generator=generator),
    )
    return DataLoader(data, batch_size=BATCH)


def train(strategy, ctx) -> dict[str, object]:
    """Train the block; return its whole state, what each rank saw, and the mesh."""
    return trained(strategy, ctx)[0]


def trained(strategy, ctx) -> tuple[dict[str, object], dict[str, object]]:
    """`train`'s result, and the model and optimizer themselves."""
    model = strategy.wrap(make_block(seed=ctx.rank), ctx)  # ranks start apart: wrap must agree
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    seen = []
    batches = strategy.shard(_per_rank_loader(loader(), ctx), ctx)
    for batch in batches:
        seen.append(float(batch[0].sum()))
        loss = strategy.step(model, batch, ctx, forward=mse)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    state = whole_state(model, optimizer)
    mesh = ctx.mesh
    result = {
        "state": state,
        "seen": seen,
        "data_parallel": ctx.data_parallel,
        "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
        "loss": float(loss),
    }
    return result, {"model": model, "optim": optimizer}


def _per_rank_loader(batches: DataLoader, ctx) -> DataLoader:
    # The global batch of the reference, dealt: each data-parallel rank takes BATCH / dp rows.
    _, size = ctx.data_parallel
    return DataLoader(batches.dataset, batch_size=BATCH // size)


def reference() -> dict[str, torch.Tensor]:
    return trained_alone(make_block(seed=0), loader())


@pytest.mark.slow
def test_fsdp_x_tensor_parallel_on_a_2x2_mesh_equals_one_process():
    strategy = sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan(), size=2)
    assert strategy.name == "fsdp_spawn+tp2"
    assert isinstance(strategy.wrap, TensorParallelWrap)
    results = sg.launch(train, strategy, devices=4)
    assert [r["mesh"] for r in results] == [(("shard", "tp"), (2, 2))] * 4
    assert [r["data_parallel"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # The two ranks of a tensor-parallel group take the same batches; the groups differ.
    assert results[0]["seen"] == results[1]["seen"] != results[2]["seen"] == results[3]["seen"]
    assert_equal_to_reference(results, reference())


@pytest.mark.slow
def test_tensor_parallel_alone_on_two_ranks_equals_one_process():
    results = sg.launch(
        train, sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan()), devices=2
    )
    assert [r["data_parallel"] for r in results] == [(0, 1), (0, 1)]
    assert results[0]["seen"] == results[1]["seen"]
    assert_equal_to_reference(results, reference())


def grouped_wrap(module, ctx):
    """A wrap of the user's own (torchtitan style): each child with parameters a group."""
    from torch.distributed.fsdp import fully_shard

    for index, child in enumerate(module.children()):
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=ctx.data_mesh, reshard_after_forward=index % 2 == 0)
    fully_shard(module, mesh=ctx.data_mesh)
    return module


@pytest.mark.slow
def test_tensor_parallel_composes_with_a_users_own_fsdp_wrap():
    # issue 36: tensor_parallel refused any wrap but fsdp()'s own (a CombinatorError).
    own = attrs.evolve(sg.fsdp_spawn(device="cpu"), wrap=grouped_wrap)
    results = sg.launch(train, sg.tensor_parallel(own, block_plan()), devices=2)
    assert results[0]["seen"] == results[1]["seen"]
    assert_equal_to_reference(results, reference())


# ------------------------------------------------------------------------------- checkpoints


def train_and_save(strategy, ctx, path: str) -> dict[str, object]:
    result, objects = trained(strategy, ctx)
    sg.checkpoint.save(path, objects, ctx)
    return result


def load_into(strategy, ctx, path: str) -> dict[str, torch.Tensor]:
    """Load the FSDP x TP checkpoint under another strategy; return the state, whole."""
    model = strategy.wrap(make_block(seed=5), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # An optimizer has state only after a step: take one with zero gradients, then load over it.
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    optimizer.zero_grad()
    sg.checkpoint.load(path, {"model": model, "optim": optimizer}, ctx)
    return whole_state(model, optimizer)


def _single(fn, path):
    strategy = sg.single_device("cpu")
    return [fn(strategy, strategy.setup(sg.Env()), path)]


LOADERS = {
    "single_device": lambda path: _single(load_into, path),
    "ddp on 2": lambda path: sg.launch(
        load_into, sg.ddp_spawn(device="cpu"), devices=2, args=(path,)
    ),
    "fsdp on 3": lambda path: sg.launch(
        load_into, sg.fsdp_spawn(device="cpu"), devices=3, args=(path,)
    ),
    "fsdp x tp on 2": lambda path: sg.launch(
        load_into,
        sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan()),
        devices=2,
        args=(path,),
    ),
}


SOURCES = {
    "fsdp x tp on 2x2": lambda: sg.tensor_parallel(
        sg.fsdp_spawn(device="cpu"), block_plan(), size=2
    ),
    "hsdp on 2x2": lambda: sg.spawned(sg.hsdp(replicate=2, shard=2, device="cpu")),
}


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES)
def test_a_mesh_checkpoint_loads_under_other_strategies_and_world_sizes(tmp_path, source):
    path = str(tmp_path / "ckpt")
    saved = sg.launch(train_and_save, SOURCES[source](), devices=4, args=(path,))[0]["state"]
    for name, load in LOADERS.items():
        for rank, state in enumerate(load(path)):
            assert sorted(state) == sorted(saved), (name, rank)
            for key, value in saved.items():
                assert torch.equal(state[key], value), f"{name}, rank {rank}: {key} differs"


def parallelize_by_hand(module, tp_mesh):
    """A plan given as a function: what a user's own parallelising code does."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(module, tp_mesh, block_plan())


@pytest.mark.slow
def test_a_plan_given_as_a_function_trains_as_one_process():
    strategy = sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), parallelize_by_hand)
    assert_equal_to_reference(sg.launch(train, strategy, devices=2), reference())


@pytest.mark.slow
@pytest.mark.parametrize("combinator", ["compiled", "traced"])
def test_compiled_and_traced_fsdp_x_tp_train_as_one_process(combinator, tmp_path):
    base = sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan(), size=2)
    trace = tmp_path / "trace.jsonl"
    strategy = (
        sg.compiled(base)
        if combinator == "compiled"
        else sg.traced(base, sg.combinators.JsonLinesSink(str(trace)))
    )
    assert_equal_to_reference(sg.launch(train, strategy, devices=4), reference())
    if combinator == "traced":
        assert '"field": "wrap"' in trace.read_text()


def test_a_mesh_that_does_not_fit_the_world_is_refused_before_joining():
    strategy = sg.tensor_parallel(sg.fsdp(device="cpu"), block_plan(), size=3)
    env = sg.Env(rank=0, world_size=4, local_world_size=4, master_port=1)  # nothing listens there
    with pytest.raises(sg.UsageError, match=r"size=3 does not divide the world of 4 ranks"):
        strategy.setup(env)
    hybrid = sg.tensor_parallel(sg.fsdp(shard_size=3, device="cpu"), block_plan(), size=2)
    with pytest.raises(sg.UsageError, match=r"shard_size=3 .* world of 4 data-parallel ranks"):
        hybrid.setup(sg.Env(rank=0, world_size=8, local_world_size=8, master_port=1))
    assert mesh_dims(sg.Env(world_size=8, local_world_size=8), 2, tensor_parallel=2) == (
        ("replicate", 2),
        ("shard", 2),
        ("tp", 2),
    )


def _wrap_error(strategy, ctx) -> str:
    try:
        strategy.wrap(make_block(), ctx)
    except sg.UsageError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_async_tensor_parallel_is_refused_off_cuda_on_every_rank():
    strategy = sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan(), async_tp=True)
    assert strategy.wrap.async_tp is True
    for error in sg.launch(_wrap_error, strategy, devices=2):
        assert "tensor_parallel(async_tp=True) overlaps the 'tp' collectives" in error
        assert "this rank trains on cpu; drop async_tp, or train on CUDA devices" in error


def _training_stack(strategy):
    """Precision, accumulation and clipping: the combinators that change training."""
    mixed = sg.with_precision(strategy, "bf16-mixed")
    return sg.with_clipping(sg.accumulate(mixed, 2), max_norm=0.05)


@pytest.mark.slow
def test_tensor_parallel_goes_on_either_side_of_the_other_combinators():
    # Its wrap is the outermost either way, so the plan splits the layers before any other
    # layer's wrap: both orders are the same training, bit for bit.
    inside = _training_stack(sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan()))
    outside = sg.tensor_parallel(_training_stack(sg.fsdp_spawn(device="cpu")), block_plan())
    assert outside.name == "fsdp_spawn+bf16-mixed+accumulate2+clip+tp2"
    ours, theirs = (sg.launch(train, s, devices=2) for s in (inside, outside))
    for mine, other in zip(ours, theirs, strict=True):
        assert mine["mesh"] == other["mesh"] == (("shard", "tp"), (1, 2))
        assert sorted(mine["state"]) == sorted(other["state"])
        for key, value in mine["state"].items():
            assert torch.equal(value, other["state"][key]), key
    # A test of the test: the stack changed training (clipping at 0.05 bites).
    plain = sg.launch(
        train, sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan()), devices=2
    )
    assert not torch.equal(
        plain[0]["state"]["model.up.weight"], ours[0]["state"]["model.up.weight"]
    )


def test_tensor_parallel_under_other_layers_is_still_applied_once():
    twice = sg.with_precision(sg.tensor_parallel(sg.fsdp(device="cpu"), block_plan()), "bf16-mixed")
    with pytest.raises(
        sg.CombinatorError, match=r"'fsdp\+tp2\+bf16-mixed' is already tensor parallel"
    ):
        sg.tensor_parallel(twice, block_plan())
    with pytest.raises(sg.CombinatorError, match=r"'ddp\+clip' does not build a device mesh"):
        sg.tensor_parallel(sg.with_clipping(sg.ddp(device="cpu"), max_norm=1.0), block_plan())
