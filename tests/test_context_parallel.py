"""context_parallel on real gloo ranks: each sequence split over "cp", training equal to one process.

A small causal transformer block trains for several steps; every parameter
and AdamW slot, gathered whole, must equal ``single_device()`` training on the
whole batch: FSDP x CP on 2x2 ranks, CP alone on 2, CP x TP on 2x2, HSDP x CP
on 2x2x2 is left out (8 ranks on 2 cores). The kit's laws pass on CP, and
three planted bugs are caught: gradients averaged without the "cp" ranks,
attention over this rank's share of the keys only, batches dealt to each rank
of a sequence apart.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from helpers import (
    Block,
    assert_equal_to_reference,
    block_plan,
    make_block,
    mse,
    trained_alone,
    whole_state,
)
from kit_strategies import shard_by_global_rank
from stratagem.combinators.context_parallel import ContextParallelStep, sequence_positions
from stratagem.meshes import mesh_dims
from stratagem.testing import LawViolation, check_all
from stratagem.testing.tolerances import FLOAT32, law_tolerances

STEPS, BATCH, SEQ = 3, 8, 8


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(STEPS * BATCH, SEQ, 16, generator=generator),
        torch.randn(STEPS * BATCH, SEQ, 16, generator=generator),
    )
    return DataLoader(data, batch_size=BATCH)


def train(strategy, ctx) -> dict[str, object]:
    model = strategy.wrap(make_block(seed=ctx.rank), ctx)  # ranks start apart: wrap must agree
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _, size = ctx.data_parallel
    batches = DataLoader(loader().dataset, batch_size=BATCH // size)  # the global batch, dealt
    seen, losses = [], []
    for batch in strategy.shard(batches, ctx):
        seen.append(float(batch[0].sum()))
        loss = strategy.step(model, batch, ctx, forward=mse)
        losses.append(float(loss))
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    mesh = ctx.mesh
    return {
        "state": whole_state(model, optimizer),
        "seen": seen,
        "losses": losses,
        "data_parallel": ctx.data_parallel,
        "mesh": (mesh.mesh_dim_names, tuple(mesh.shape)),
        "data_mesh": ctx.data_mesh.mesh_dim_names,
    }


def reference() -> dict[str, torch.Tensor]:
    return trained_alone(make_block(seed=0), loader())


# ------------------------------------------------------------------------------ the record


def test_context_parallel_substitutes_setup_and_step_only():
    base = sg.fsdp(device="cpu")
    strategy = sg.context_parallel(base, size=2, buffers={"rope": 0})
    assert strategy.name == "fsdp+cp2"
    assert strategy.setup == attrs.evolve(base.setup, context_parallel=2)
    assert strategy.step == ContextParallelStep(base.step, 1, (("rope", 0),), True)
    same = {"setup", "step", "name"}
    assert all(
        getattr(strategy, f) == getattr(base, f)
        for f in {f.name for f in attrs.fields(sg.Strategy)} - same
    )


def test_context_and_tensor_parallel_compose_in_either_order():
    base, plan = sg.fsdp(device="cpu"), block_plan()
    one = sg.tensor_parallel(sg.context_parallel(base), plan)
    other = sg.context_parallel(sg.tensor_parallel(base, plan))
    assert (
        one.setup == other.setup == attrs.evolve(base.setup, tensor_parallel=2, context_parallel=2)
    )
    assert attrs.evolve(one, name="x") == attrs.evolve(other, name="x")


def test_the_mesh_puts_cp_between_the_data_dimensions_and_tp():
    env = sg.Env(world_size=16, local_world_size=8)
    assert mesh_dims(env, 2, tensor_parallel=2, context_parallel=2) == (
        ("replicate", 2), ("shard", 2), ("cp", 2), ("tp", 2),
    )  # fmt: skip
    assert mesh_dims(env, "node", context_parallel=4) == (("replicate", 2), ("shard", 2), ("cp", 4))
    with pytest.raises(sg.UsageError, match=r"size=3 does not divide the 8 ranks that "
                       r"tensor_parallel=2 leaves into equal context-parallel groups"):  # fmt: skip
        mesh_dims(env, tensor_parallel=2, context_parallel=3)


def test_sequence_positions_cover_every_position_once_head_and_tail_together():
    for load_balance in (True, False):
        held = [sequence_positions(16, r, 4, load_balance).tolist() for r in range(4)]
        assert sorted(p for positions in held for p in positions) == list(range(16))
    assert sequence_positions(16, 1, 4, load_balance=True).tolist() == [2, 3, 12, 13]
    assert sequence_positions(16, 1, 4, load_balance=False).tolist() == [4, 5, 6, 7]


def test_combinators_apply_on_either_side_and_the_kit_widens_low_precision_margins_for_cp():
    base = sg.fsdp(device="cpu")
    inside = sg.with_precision(sg.context_parallel(base), "bf16-mixed")
    outside = sg.context_parallel(sg.with_precision(base, "bf16-mixed"))
    assert inside.setup == outside.setup  # the mesh under precision's setup layer gains "cp"
    assert outside.setup.inner == attrs.evolve(base.setup, context_parallel=2)
    eps = torch.finfo(torch.bfloat16).eps
    assert law_tolerances(sg.with_precision(base, "bf16-mixed"), "ranks-in-sync") == (eps, eps)
    assert law_tolerances(inside, "ranks-in-sync") == law_tolerances(outside, "accumulation")
    assert law_tolerances(inside, "data-parallel-step") == (4 * eps, 4 * eps)
    assert law_tolerances(sg.context_parallel(base), "data-parallel-step") == (4e-4, 4e-5)
    assert law_tolerances(base, "data-parallel-step") == FLOAT32


# ------------------------------------------------------------------------- training, by key


@pytest.mark.slow
def test_fsdp_x_context_parallel_on_a_2x2_mesh_equals_one_process():
    results = sg.launch(train, sg.context_parallel(sg.fsdp_spawn(device="cpu")), devices=4)
    assert [r["mesh"] for r in results] == [(("shard", "cp"), (2, 2))] * 4
    assert [r["data_mesh"] for r in results] == [("shard_cp",)] * 4  # gradients over both
    assert [r["data_parallel"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    # The ranks of a sequence take the same batches and report one loss, the whole batch's.
    assert results[0]["seen"] == results[1]["seen"] != results[2]["seen"] == results[3]["seen"]
    assert results[0]["losses"] == results[1]["losses"] != results[2]["losses"]
    assert_equal_to_reference(results, reference())


@pytest.mark.slow
def test_context_parallel_alone_on_two_ranks_equals_one_process_in_contiguous_chunks():
    strategy = sg.context_parallel(sg.fsdp_spawn(device="cpu"), load_balance=False)
    results = sg.launch(train, strategy, devices=2)
    assert [r["data_parallel"] for r in results] == [(0, 1), (0, 1)]
    assert results[0]["seen"] == results[1]["seen"]
    assert_equal_to_reference(results, reference())


@pytest.mark.slow
def test_context_parallel_x_tensor_parallel_on_a_2x2_mesh_equals_one_process():
    strategy = sg.context_parallel(sg.tensor_parallel(sg.fsdp_spawn(device="cpu"), block_plan()))
    results = sg.launch(train, strategy, devices=4)
    assert [r["mesh"] for r in results] == [(("shard", "cp", "tp"), (1, 2, 2))] * 4
    assert len({tuple(r["seen"]) for r in results}) == 1  # one data-parallel rank
    assert_equal_to_reference(results, reference())


# ----------------------------------------------------------------- what step gives and takes


class Positional(torch.nn.Module):
    """A block whose positions come from a buffer (as rotary tables do): CP must split it too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.register_buffer(
            "positions", torch.linspace(0, 1, SEQ)[:, None].expand(SEQ, 16).clone()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x + self.positions)


class ByHand(torch.nn.Module):
    """Attention written out (softmax(q @ k.T)): CP cannot reach it, and must say so."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ x.transpose(1, 2), dim=-1) @ x


def _error(fn) -> str:
    try:
        fn()
    except sg.UsageError as error:
        return str(error)
    return "no error"


def step_cases(strategy, ctx) -> dict[str, Any]:
    data = torch.randn(2, SEQ, 16, generator=torch.Generator().manual_seed(3))
    targets = torch.randn(2, SEQ, 16, generator=torch.Generator().manual_seed(4))
    plain = Positional()
    model = strategy.wrap(Positional(), ctx)
    with torch.no_grad():
        output = strategy.step(model, data, ctx)
        whole = plain(data)
    loss = strategy.step(model, (data, targets), ctx, forward=mse)
    step = strategy.step
    return {
        "output": float((output - whole).abs().max()),
        "loss": float(loss.detach() - mse(plain, (data, targets)).detach()),
        "buffer restored": model.positions.shape,
        "odd length": _error(lambda: step(model, data[:, :6], ctx)),
        "by hand": _error(lambda: attrs.evolve(step, buffers=())(ByHand(), data, ctx)),
        "a mask": _error(lambda: step(model, data, ctx, forward=lambda m, b: _masked(b))),
        "wrong dim": _error(
            lambda: attrs.evolve(step, seq_dim=2, buffers=())(
                model, data[..., :4], ctx, forward=lambda m, b: _attend(b)
            )
        ),
        "buffer dim": _error(lambda: attrs.evolve(step, seq_dim=2)(model, data, ctx)),
        "no buffer": _error(lambda: attrs.evolve(step, buffers=(("rope", 0),))(model, data, ctx)),
    }


def _attend(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])


def _masked(x: torch.Tensor) -> torch.Tensor:
    q = x[:, None]
    mask = torch.ones(x.size(1), x.size(1), dtype=torch.bool)
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


@pytest.mark.slow
def test_step_returns_what_one_process_would_and_refuses_what_it_cannot_split():
    strategy = sg.context_parallel(sg.fsdp_spawn(device="cpu"), buffers={"positions": 0})
    for result in sg.launch(step_cases, strategy, devices=2):
        assert float(result["output"]) < 1e-5  # the whole sequence's output, in order
        assert abs(result["loss"]) < 1e-6  # the whole batch's loss
        assert result["buffer restored"] == (SEQ, 16)
        assert "cuts a sequence of 6 into 4 equal chunks" in result["odd length"]
        assert "divisible by 4 or load_balance=False" in result["odd length"]  # 6 = 2 x 3
        assert "called no torch.nn.functional.scaled_dot_product_attention" in result["by hand"]
        assert "an attention mask of the local shape (4, 4)" in result["a mask"]
        assert "attention over 8 positions, but this rank holds 2" in result["wrong dim"]
        assert (
            "buffer 'positions' of shape (8, 16) along dim 0, which must hold the batch's 16"
            in result["buffer dim"]
        )
        assert (
            "names 'rope', which is no buffer of the model (its buffers: ['positions'])"
            in result["no buffer"]
        )


# ---------------------------------------------------------------------------- the kit's laws


def batch(rows: int) -> torch.Tensor:
    return torch.randn(rows, SEQ, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_context_parallel_passes_every_law_on_2x2():
    report = check_all(
        sg.context_parallel(sg.fsdp(device="cpu")),
        world_size=4,
        module=make_block(),
        batch=batch(16),
    )
    assert {"wrap-preserves", "data-parallel-step", "accumulation", "ranks-in-sync",
            "checkpoint-round-trip", "checkpoint-resume", "shard-partition"} <= set(report.passed)  # fmt: skip


def shard_without_cp(module, ctx):
    """The planted bug: FSDP over "shard" alone, so a sequence's ranks never average gradients."""
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=ctx.mesh[ctx.mesh_names.shard])


@attrs.frozen
class LocalAttentionStep:
    """The planted bug: split each sequence, but attend only to this rank's share of it."""

    inner: Any
    in_reference: ClassVar[bool] = False

    def __call__(self, module, batch, ctx, /, *, forward=None):
        cp = ctx.mesh[ctx.mesh_names.cp]
        mine = sequence_positions(batch.size(1), cp.get_local_rank(), cp.size(), True)
        return self.inner(module, batch.index_select(1, mine), ctx, forward=forward)


@pytest.mark.slow
def test_planted_context_parallel_bugs_are_caught():
    strategy = sg.context_parallel(sg.fsdp(device="cpu"))
    module, data = make_block(), batch(16)
    unaveraged = attrs.evolve(strategy, name="grads-without-cp", wrap=shard_without_cp)
    with pytest.raises(LawViolation, match=r"ranks-in-sync|data-parallel-step"):
        check_all(unaveraged, world_size=2, module=module, batch=data)
    local = attrs.evolve(
        strategy, name="local-attention", step=LocalAttentionStep(strategy.step.inner)
    )
    with pytest.raises(LawViolation, match=r"wrap-preserves"):
        check_all(local, world_size=2, module=module, batch=data)
    dealt = attrs.evolve(strategy, name="deals-globally", shard=shard_by_global_rank)
    with pytest.raises(LawViolation, match=r"(?s)shard-partition.*one data-parallel rank"):
        check_all(dealt, world_size=2, module=module, batch=data)


def _stack(strategy):
    mixed = sg.with_precision(strategy, "bf16-mixed")
    return sg.with_clipping(sg.accumulate(mixed, 2), max_norm=1.0)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["cp innermost", "cp outermost"])
def test_combinators_on_either_side_of_context_parallel_pass_every_law(order):
    base = sg.fsdp(device="cpu")
    if order == "cp innermost":
        strategy = _stack(sg.context_parallel(base))
    else:
        strategy = sg.context_parallel(_stack(base))
    report = check_all(strategy, world_size=2, module=make_block(), batch=batch(8))
    assert {"wrap-preserves", "data-parallel-step", "accumulation", "ranks-in-sync"} <= set(
        report.passed
    )
