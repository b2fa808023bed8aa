"""allreduce_grads(): ddp() with wrap/step/no_sync/update substituted, checked on 2 gloo ranks.

One launch (a module-scoped fixture) runs every multi-rank check; the tests
then compare its results with single_device() and ddp() runs on the same data.
"""

from __future__ import annotations

import contextlib
import math
import pickle

import attrs
import pytest
import torch

import stratagem as sg
from helpers import local_ctx, make_batches, make_model
from stratagem import training
from stratagem.combinators.accumulation import AccumulationState
from stratagem.replicas import buckets as _buckets
from stratagem.strategies.allreduce import AllreduceThenStep, broadcast_module
from stratagem.strategies.allreduce_buckets import (
    FIRST_BUCKET_MB,
    average_gradients,
    backward_buckets,
)
from stratagem.strategies.allreduce_hooks import _HOOKS, average_gradients_overlapped, pause_hooks

STEPS = 5
BATCH = 8
MICRO = 2  # micro-batches per optimizer step in the accumulation run
EXACT = {"rtol": 0, "atol": 1e-6}
# Parameters after STEPS steps of SGD with momentum, 16-bit wire against float32 wire. Measured
# differences: 1.1e-3 (bf16), 2.2e-4 (fp16). The per-element gradient bound is below.
TRAINED_WITH_COMPRESSION = {"bf16": {"rtol": 0, "atol": 1e-2}, "fp16": {"rtol": 0, "atol": 2e-3}}
# Unit roundoff of each wire dtype: an averaged gradient element is within
# (world_size + 1) * u * mean_r |g_r| of the exact average (see docs/strategies.md).
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
FP16_SUBNORMAL = 2.0**-24


# ----------------------------------------------------------------- models, data, training loop


class Branchy(torch.nn.Module):
    """`rare` runs only for flagged samples (none on rank 1); `unused` never runs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(6, 2)
        self.rare = torch.nn.Linear(6, 2)
        self.unused = torch.nn.Linear(6, 2)


def batches(flags: bool = False) -> list[tuple[torch.Tensor, ...]]:
    """With `flags`, a third column flags samples 0 and 2 (both in rank 0's half)."""
    plain = make_batches(steps=STEPS, size=BATCH, seed_targets=False)
    if not flags:
        return plain
    return [
        (inputs, targets, torch.tensor([True, False, True, False] + [False] * (BATCH - 4)))
        for inputs, targets in plain
    ]


def mean_loss(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def branchy_loss(model, batch):
    inputs, targets, flags = batch
    loss = (model.body(inputs) - targets).pow(2).mean()
    if flags.any():  # on a rank without flagged samples `rare` gets no gradient at all
        loss = loss + model.rare(inputs[flags]).pow(2).sum() / len(inputs)
    return loss


def global_mean_loss(global_size: int, world_size: int):
    def forward(model, batch):
        inputs, targets = batch
        squared = (model(inputs) - targets).pow(2).mean(dim=1)
        return squared.sum() * world_size / global_size

    return forward


def split(batch, sizes):
    return [tuple(part) for part in zip(*(t.split(sizes) for t in batch), strict=True)]


def half(batch, ctx):
    return split(batch, [BATCH // ctx.world_size] * ctx.world_size)[ctx.rank]


def uneven(batch, ctx):
    return split(batch, [5, 3])[ctx.rank]


def whole(batch, ctx):
    return batch


def train(strategy, ctx, piece_of, forward, *, micro=1, build=make_model, flags=False):
    model = strategy.wrap(build(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    for batch in batches(flags):
        mine = piece_of(batch, ctx)
        pieces = split(mine, [len(mine[0]) // micro] * micro)
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last else strategy.no_sync(model, ctx):
                loss = strategy.step(model, piece, ctx, forward=forward)
                strategy.backward(loss / micro, model, ctx)
        strategy.update(optimizer, model, ctx)
    return [p.detach().clone() for p in sg.unwrap(model).parameters()]


def with_update(strategy, **options):
    return attrs.evolve(strategy, update=AllreduceThenStep(**options))


# ------------------------------------------------------------------- what the ranks check


def different_starts(strategy, ctx):
    """Each rank builds its module from its own seed, buffers of every kind included."""
    torch.manual_seed(100 + ctx.rank)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    module[1].running_mean.normal_()
    module[1].num_batches_tracked.fill_(3 + ctx.rank)
    module.register_buffer("mask", torch.rand(5) > 0.5)  # bool: gloo cannot reduce it
    module.register_buffer("counts", torch.randint(-99, 99, (3,), dtype=torch.int16))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    wrapped = strategy.wrap(module, ctx)
    return {"before": before, "after": wrapped.state_dict(), "same_object": wrapped is module}


def compression_grads(ctx):
    """Average the same rank-specific gradients, spread over six decades, with each wire."""
    generator = torch.Generator().manual_seed(200 + ctx.rank)
    module = torch.nn.Linear(64, 64)
    local = [
        torch.randn(p.shape, generator=generator)
        * 10 ** (torch.rand(p.shape, generator=generator) * 6 - 3)
        for p in module.parameters()
    ]
    out = {"local": local}
    for compression in (None, "bf16", "fp16"):
        for p, g in zip(module.parameters(), local, strict=True):
            p.grad = g.clone()
        average_gradients(module, ctx, compression=compression)
        out[str(compression)] = [p.grad.clone() for p in module.parameters()]
    return out


def optimizer_states(strategy, ctx):
    """Only rank `src` has stepped its Adam; after the broadcast every rank holds its state."""
    out = {}
    for src in (0, 1):
        model = strategy.wrap(make_model(), ctx)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        if ctx.rank == src:
            for batch in batches()[:2]:
                mean_loss(model, batch).backward()
                optimizer.step()
        sg.broadcast_optimizer_state(optimizer, ctx, src=src)
        out[src] = optimizer.state_dict()
    return out


def errors(strategy, ctx):
    out = {}
    try:  # rank 1 builds a wider first layer: an error on both ranks, not a hang
        strategy.wrap(torch.nn.Linear(4 + ctx.rank, 2), ctx)
    except sg.UsageError as error:
        out["layout"] = str(error)
    model = strategy.wrap(torch.nn.Embedding(10, 3, sparse=True), ctx)
    model(torch.tensor([1, 2])).sum().backward()
    try:
        strategy.update(torch.optim.SGD(model.parameters(), lr=0.1), model, ctx)
    except sg.UsageError as error:
        out["sparse"] = str(error)
    return out


# --------------------------------------------------- overlap: the hooks against the old path


def by_hand(ctx, *, compression=None, bucket_mb=25.0, **options):
    """The update before overlap: backward(s), then `average_gradients` after backward, step."""

    def average(model):
        average_gradients(model, ctx, bucket_mb=bucket_mb, compression=compression)

    return overlap_loop(broadcast_module, average, ctx, **options)


def through_strategy(strategy, ctx, *, compression=None, bucket_mb=25.0, **options):
    """The same loop through the strategy's wrap and (overlapped) averaging, without no_sync."""
    update = AllreduceThenStep(bucket_mb=bucket_mb, compression=compression)

    def average(model):
        average_gradients_overlapped(model, ctx, bucket_mb=bucket_mb, compression=compression)

    if not options.get("keep"):  # the update field itself
        return overlap_loop(strategy.wrap, None, ctx, update=update, **options)
    return overlap_loop(strategy.wrap, average, ctx, **options)


def overlap_loop(
    wrap,
    average,
    ctx,
    *,
    update=None,
    scale=None,
    micro=1,
    lopsided=False,
    branchy=False,
    keep=False,
):
    """Train on ``half`` the batches; ``average`` then step, or the ``update`` field.

    ``scale`` multiplies the gradients in place between backward and update;
    ``micro`` backward passes per step accumulate without any no_sync; with
    ``lopsided``, rank 0 takes its half in two backward passes, rank 1 in one;
    ``branchy`` trains `Branchy` (parameters without gradients on one rank or on
    all); ``keep`` zeroes the gradients after the step instead of dropping them.
    """
    model = wrap(Branchy() if branchy else make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    for batch in batches(flags=branchy):
        count = 2 if lopsided and ctx.rank == 0 else micro
        mine = half(batch, ctx)
        for piece in split(mine, [len(mine[0]) // count] * count):
            ((branchy_loss if branchy else mean_loss)(model, piece) / count).backward()
        if scale is not None:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if update is not None:
            update(optimizer, model, ctx)
            continue
        average(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not keep)
    return [p.detach().clone() for p in model.parameters()]


def overlap_probe(strategy, ctx):
    """How many buckets the hooks have sent after each backward, paused and not."""
    strategy = with_update(strategy, bucket_mb=1e-6)  # one bucket per parameter
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"paused": [], "last": [], "after-update": []}
    for step, batch in enumerate(batches()):
        first, second = split(half(batch, ctx), [2, 2])
        with strategy.no_sync(model, ctx):
            strategy.backward(mean_loss(model, first), model, ctx)
        if step == 0:
            out["hooked-before-first-update"] = model in _HOOKS
        else:
            out["paused"].append(_HOOKS[model].sent)
        strategy.backward(mean_loss(model, second), model, ctx)
        if step:
            out["last"].append(_HOOKS[model].sent)
        strategy.update(optimizer, model, ctx)
        out["after-update"].append(_HOOKS[model].sent)
    out["plan"] = _HOOKS[model].plan
    return out


def buffer_probe(strategy, ctx):
    """Where the averaged gradients live, step by step: the same buffers every step."""
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"pointers": [], "views": []}
    for batch in batches():
        mean_loss(model, half(batch, ctx)).backward()
        average_gradients_overlapped(model, ctx)
        flats = [bucket.flat for bucket in _HOOKS[model].buckets]
        out["pointers"].append([p.grad.data_ptr() for p in model.parameters()])
        out["views"].append([any(p.grad._base is f for f in flats) for p in model.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return out


def released_probe(strategy, ctx):
    """Whether a trained model's parameters and hooks go when the user drops model and optimizer."""
    import gc
    import weakref

    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches()[:2]:  # the first update hooks the module, the second sends from them
        strategy.backward(mean_loss(model, half(batch, ctx)), model, ctx)
        strategy.update(optimizer, model, ctx)
    watched = [weakref.ref(p) for p in model.parameters()] + [weakref.ref(_HOOKS[model])]
    del model, optimizer
    gc.collect()
    return [ref() is not None for ref in watched]


def unfrozen_probe(strategy, ctx):
    """A parameter frozen for the first updates (the hooks are made without it), then trained."""
    model = strategy.wrap(make_model(), ctx)
    first = next(model.parameters())
    first.requires_grad_(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, batch in enumerate(batches()):
        if step == 2:
            first.requires_grad_(True)
        strategy.backward(mean_loss(model, half(batch, ctx)), model, ctx)
        strategy.update(optimizer, model, ctx)
    return [p.detach().clone() for p in model.parameters()]


def accumulate_probe(strategy, ctx):
    """sg.accumulate over allreduce_grads(): its no_sync holds the hooks back on all but the last."""
    strategy = sg.accumulate(with_update(strategy, bucket_mb=1e-6), MICRO)  # one per parameter
    ctx = ctx.with_extras(accumulation=AccumulationState(MICRO))  # what its setup adds
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.01)
    sent = []
    for batch in batches():
        for piece in split(half(batch, ctx), [BATCH // 2 // MICRO] * MICRO):
            loss = strategy.step(model, piece, ctx, forward=mean_loss)
            strategy.backward(loss, model, ctx)
            hooks = _HOOKS.get(model)
            sent.append(None if hooks is None else hooks.sent)
            strategy.update(optimizer, model, ctx)
    return {"params": [p.detach().clone() for p in model.parameters()], "sent": sent}


OVERLAP_CASES = {
    "plain": {},
    "bf16": {"compression": "bf16"},
    "fp16": {"compression": "fp16"},
    "tiny": {"bucket_mb": 1e-6},
    "scaled-in-place": {"scale": 0.5},
    "tiny-scaled-in-place": {"bucket_mb": 1e-6, "scale": 0.5},
    "two-backwards": {"micro": 2},
    "tiny-two-backwards": {"bucket_mb": 1e-6, "micro": 2},
    "lopsided": {"lopsided": True},
    "unused": {"branchy": True},
    "unused-bf16": {"branchy": True, "compression": "bf16"},
    "unused-tiny-scaled": {"branchy": True, "bucket_mb": 1e-6, "scale": 0.5},
    "kept": {"keep": True},
    "kept-unused-tiny": {"keep": True, "branchy": True, "bucket_mb": 1e-6},
    "kept-tiny-two-backwards": {"keep": True, "bucket_mb": 1e-6, "micro": 2},
    "kept-tiny-scaled-in-place": {"keep": True, "bucket_mb": 1e-6, "scale": 0.5},
    "kept-tiny-lopsided": {"keep": True, "bucket_mb": 1e-6, "lopsided": True},
    "kept-fp16": {"keep": True, "compression": "fp16"},
}


def overlap_runs(strategy, ctx):
    return {
        name: (through_strategy(strategy, ctx, **options), by_hand(ctx, **options))
        for name, options in OVERLAP_CASES.items()
    }


def on_ranks(strategy, ctx):
    ddp = sg.ddp(device="cpu")
    global_mean = global_mean_loss(BATCH, ctx.world_size)
    return {
        "even": train(strategy, ctx, half, mean_loss),
        "uneven": train(strategy, ctx, uneven, global_mean),
        "accumulated": train(strategy, ctx, half, mean_loss, micro=MICRO),
        "tiny-buckets": train(with_update(strategy, bucket_mb=1e-6), ctx, half, mean_loss),
        "huge-buckets": train(with_update(strategy, bucket_mb=1e6), ctx, half, mean_loss),
        "bf16": train(with_update(strategy, compression="bf16"), ctx, half, mean_loss),
        "fp16": train(with_update(strategy, compression="fp16"), ctx, half, mean_loss),
        "branchy": train(strategy, ctx, half, branchy_loss, build=Branchy, flags=True),
        "ddp-even": train(ddp, ctx, half, mean_loss),
        "ddp-accumulated": train(ddp, ctx, half, mean_loss, micro=MICRO),
        "different-starts": different_starts(strategy, ctx),
        "compression-grads": compression_grads(ctx),
        "optimizer-states": optimizer_states(strategy, ctx),
        "errors": errors(strategy, ctx),
        "overlap-probe": overlap_probe(strategy, ctx),
        "accumulate-probe": accumulate_probe(strategy, ctx),
        "buffer-probe": buffer_probe(strategy, ctx),
        "released": released_probe(strategy, ctx),
        "unfrozen": unfrozen_probe(strategy, ctx),
        "overlap-runs": overlap_runs(strategy, ctx),
    }


@pytest.fixture(scope="module")
def ranks():
    return sg.launch(on_ranks, sg.allreduce_grads_spawn(device="cpu"), devices=2)


@pytest.fixture(scope="module")
def single():
    ctx = local_ctx()
    strategy = sg.single_device("cpu")
    return {
        "whole": train(strategy, ctx, whole, mean_loss),
        "branchy": train(strategy, ctx, whole, branchy_loss, build=Branchy, flags=True),
    }


def assert_params_close(ours, theirs, what, **tolerance):
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        torch.testing.assert_close(a, b, **tolerance, msg=lambda m, i=index: f"{what}[{i}]: {m}")


# ------------------------------------------------------------------------ the record itself


def test_substituted_fields_relative_to_ddp_are_wrap_step_no_sync_update():
    options = {"device": "cpu", "backend": "gloo", "timeout": 60}
    ours = sg.allreduce_grads(bucket_mb=4, compression="fp16", **options)
    theirs = sg.ddp(**options)
    update = AllreduceThenStep(bucket_mb=4, compression="fp16")
    assert ours == attrs.evolve(
        theirs,
        name="allreduce_grads",
        wrap=broadcast_module,
        step=training.step,
        no_sync=pause_hooks,
        update=update,
    )
    differing = [
        f.name
        for f in attrs.fields(sg.Strategy)
        if getattr(ours, f.name) != getattr(theirs, f.name)
    ]
    # `step` is substituted by the same plain function DDP already uses: neither has its own.
    assert differing == ["name", "wrap", "update", "no_sync"]
    assert ours.step is theirs.step is training.step
    assert ours.no_sync is pause_hooks  # holds back the gradient hooks that update attaches


def test_spawn_variant_differs_only_in_launch():
    ours, spawned = (
        sg.allreduce_grads(bucket_mb=8, device="cpu"),
        sg.allreduce_grads_spawn(bucket_mb=8, device="cpu"),
    )
    differing = [
        f.name
        for f in attrs.fields(sg.Strategy)
        if getattr(ours, f.name) != getattr(spawned, f.name)
    ]
    assert differing == ["name", "launch"]
    assert spawned.launch == sg.Spawn()
    assert sg.allreduce_grads_spawn(start=sg.Spawn(stop_grace=1), device="cpu").launch == sg.Spawn(
        stop_grace=1
    )


def test_update_field_is_a_readable_picklable_value():
    update = sg.allreduce_grads(bucket_mb=2, compression="bf16", device="cpu").update
    assert repr(update) == "AllreduceThenStep(bucket_mb=2, compression='bf16')"
    assert pickle.loads(
        pickle.dumps(sg.allreduce_grads_spawn(compression="fp16", device="cpu"))
    ) == (sg.allreduce_grads_spawn(compression="fp16", device="cpu"))


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, "25", True, None])
def test_bad_bucket_mb_is_a_clear_error(bad):
    for make in (sg.allreduce_grads, sg.allreduce_grads_spawn, AllreduceThenStep):
        with pytest.raises(
            sg.UsageError,
            match=r"allreduce_grads\(bucket_mb=\.\.\.\) must be a positive number of MiB \(got",
        ):
            make(bucket_mb=bad)
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        sg.allreduce_grads(bucket_mb=bad, device="cpu")


@pytest.mark.parametrize("bad", ["int8", "BF16", "bfloat16", 16, True])
def test_bad_compression_is_a_clear_error(bad):
    for make in (sg.allreduce_grads, sg.allreduce_grads_spawn, AllreduceThenStep):
        with pytest.raises(
            sg.UsageError,
            match=r"\(compression=\.\.\.\) must be None \(full precision\) or one of 'bf16', 'fp16' \(got",
        ):
            make(compression=bad)


def test_other_bad_options_are_ddps_errors():
    with pytest.raises(sg.UsageError, match="'backend' must be"):
        sg.allreduce_grads(backend="tcp", device="cpu")
    with pytest.raises(sg.UsageError, match="'device' must be"):
        sg.allreduce_grads(device=3)
    with pytest.raises(sg.UsageError, match="'timeout' must be positive"):
        sg.allreduce_grads_spawn(timeout=0, device="cpu")


def test_broadcast_optimizer_state_checks_src_and_is_a_no_op_on_one_process():
    ctx = local_ctx()
    optimizer = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(sg.UsageError, match=r"'src' must be a rank in \[0, 1\) \(got 1, an int\)"):
        sg.broadcast_optimizer_state(optimizer, ctx, src=1)
    before = optimizer.state_dict()
    sg.broadcast_optimizer_state(optimizer, ctx)
    assert optimizer.state_dict() == before


def test_buckets_split_by_dtype_and_cap_in_order():
    f32, f64 = torch.zeros(4), torch.zeros(4, dtype=torch.float64)  # 16 and 32 bytes
    big = torch.zeros(100)
    tensors = [f32, f32, f64, f32, big, f32, f64]
    # A full bucket closes when the next tensor of its dtype does not fit; a big one goes alone.
    assert _buckets(tensors, 32) == [[0, 1], [3], [4], [2], [5], [6]]
    assert sorted(len(b) for b in _buckets(tensors, 1e-6)) == [1] * 7
    assert _buckets(tensors, math.inf) == [[0, 1, 3, 4, 5], [2, 6]]


def test_world_of_one_trains_like_single_device(single):
    ctx = local_ctx()  # no process group: nothing to reduce
    ours = train(sg.allreduce_grads(device="cpu"), ctx, whole, mean_loss)
    assert_params_close(ours, single["whole"], "world of one", rtol=0, atol=0)


# ---------------------------------------------------------------------------- on two ranks


@pytest.mark.slow
@pytest.mark.parametrize("case", ["even", "uneven", "accumulated"])
def test_two_ranks_equal_single_device_on_the_whole_batch(ranks, single, case):
    initial = [p.detach() for p in make_model().parameters()]
    for rank, result in enumerate(ranks):
        assert_params_close(result[case], single["whole"], f"{case}, rank {rank}", **EXACT)
        assert not any(torch.allclose(a, b) for a, b in zip(result[case], initial, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["even", "accumulated"])
def test_two_ranks_equal_ddp_on_the_same_data(ranks, case):
    for rank, result in enumerate(ranks):
        assert_params_close(result[case], result[f"ddp-{case}"], f"{case}, rank {rank}", **EXACT)


@pytest.mark.slow
def test_tiny_and_huge_buckets_give_identical_results(ranks):
    for result in ranks:
        for tiny, huge, default in zip(
            result["tiny-buckets"], result["huge-buckets"], result["even"], strict=True
        ):
            assert torch.equal(tiny, huge)
            assert torch.equal(tiny, default)


@pytest.mark.slow
def test_ranks_that_start_different_end_identical_after_wrap(ranks):
    rank0, rank1 = (result["different-starts"] for result in ranks)
    assert rank0["same_object"] and rank1["same_object"]  # no wrapper
    assert any(not torch.equal(rank0["before"][k], rank1["before"][k]) for k in rank0["before"])
    for key, value in rank0["before"].items():
        assert value.dtype == rank1["after"][key].dtype
        assert torch.equal(rank0["after"][key], value), key
        assert torch.equal(rank1["after"][key], value), key


@pytest.mark.slow
def test_parameters_without_gradients_match_single_device(ranks, single):
    # rank 1 never runs `rare`; nobody runs `unused`, which weight decay must leave untouched.
    initial = [p.detach() for p in Branchy().parameters()]
    for rank, result in enumerate(ranks):
        assert_params_close(result["branchy"], single["branchy"], f"rank {rank}", **EXACT)
        rare_weight, unused = result["branchy"][2], result["branchy"][4:]
        assert all(torch.equal(p, start) for p, start in zip(unused, initial[4:], strict=True))
        assert not torch.allclose(rare_weight, initial[2])


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_gradients_are_within_the_stated_bound(ranks, compression):
    local0, local1 = (result["compression-grads"]["local"] for result in ranks)
    for result in ranks:
        grads = result["compression-grads"]
        for g0, g1, exact, lossy in zip(
            local0, local1, grads["None"], grads[compression], strict=True
        ):
            mean = (g0.double() + g1.double()) / 2
            torch.testing.assert_close(exact.double(), mean, rtol=2.0**-23, atol=0)
            scale = (g0.double().abs() + g1.double().abs()) / 2
            bound = 3 * UNIT_ROUNDOFF[compression] * scale + 2 * FP16_SUBNORMAL
            assert ((lossy.double() - mean).abs() <= bound).all()
            assert not torch.equal(lossy, exact)  # the wire really was 16-bit


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_training_with_compression_stays_within_tolerance(ranks, compression):
    for rank, result in enumerate(ranks):
        assert_params_close(
            result[compression],
            result["even"],
            f"{compression}, rank {rank}",
            **TRAINED_WITH_COMPRESSION[compression],
        )
    assert all(
        torch.equal(a, b) for a, b in zip(ranks[0][compression], ranks[1][compression], strict=True)
    )


def assert_same_state(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.device == b.device, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize("src", [0, 1])
def test_optimizer_state_is_broadcast_from_src(ranks, src):
    theirs, ours = ranks[src]["optimizer-states"][src], ranks[1 - src]["optimizer-states"][src]
    assert len(theirs["state"]) == 4  # Adam stepped: exp_avg, exp_avg_sq, step per parameter
    assert_same_state(ours, theirs)


@pytest.mark.slow
def test_mismatched_modules_and_sparse_gradients_fail_on_every_rank(ranks):
    for rank, result in enumerate(ranks):
        layout = result["errors"]["layout"]
        assert "rank(s) [1] hold a module whose parameters and buffers differ" in layout
        assert f"first difference on rank {rank}:" in layout
        assert "build the same model on every rank" in layout
        assert "has a sparse gradient" in result["errors"]["sparse"]


# ------------------------------------------------------------- overlap with backward (hooks)


def test_backward_buckets_run_last_parameter_first_with_a_small_first_bucket():
    mib = 2**20
    # Sizes of an MLP's parameters in module order: weight 1, bias 1, weight 2, bias 2.
    params = [torch.zeros(mib), torch.zeros(512), torch.zeros(mib), torch.zeros(128)]
    # The first bucket closes once it holds FIRST_BUCKET_MB (bias 2 + weight 2: 4 MiB + 512 B).
    assert FIRST_BUCKET_MB == 1.0
    assert backward_buckets(params, 25.0) == [[3, 2], [1, 0]]
    assert backward_buckets(params, 1e-6) == [[3], [2], [1], [0]]
    assert backward_buckets(params, math.inf) == [[3, 2], [1, 0]]
    # Never over the cap: in 3 MiB buckets, each 4 MiB weight travels alone.
    assert backward_buckets(params, 3.0) == [[3], [2], [1], [0]]
    small = [torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(4)]
    assert backward_buckets(small, 25.0) == [[2, 0], [1]]  # per dtype, by first member


@pytest.mark.slow
def test_hooks_send_every_bucket_during_the_last_backward_and_none_under_no_sync(ranks):
    for result in ranks:
        probe = result["overlap-probe"]
        assert probe["plan"] == [[3], [2], [1], [0]]  # one bucket per parameter, last first
        assert probe["hooked-before-first-update"] is False  # the first update attaches them
        assert probe["paused"] == [0] * (STEPS - 1)  # no_sync: nothing sent
        # All but the last sent before update ran; update sends the last, with the flags.
        assert probe["last"] == [3] * (STEPS - 1)
        assert probe["after-update"] == [0] * STEPS


@pytest.mark.slow
def test_averaged_gradients_are_views_of_buffers_allocated_once(ranks):
    for result in ranks:
        probe = result["buffer-probe"]
        assert probe["views"] == [[True] * 4] * STEPS  # no copy back into fresh gradients
        assert all(pointers == probe["pointers"][0] for pointers in probe["pointers"])


@pytest.mark.slow
def test_dropping_model_and_optimizer_frees_parameters_buffers_and_hooks(ranks):
    # The hooks once held the parameters in a cycle through autograd's own storage, which the
    # garbage collector cannot see: every wrapped model stayed alive (250 MB over 15 wraps).
    for rank, result in enumerate(ranks):
        assert result["released"] == [False] * 5, f"rank {rank}: still alive {result['released']}"


@pytest.mark.slow
def test_a_parameter_unfrozen_after_the_hooks_were_made_is_averaged_too(ranks):
    # The hooks were once kept when the count of parameters requiring grad changed: the unfrozen
    # one was never averaged, and the ranks' weights drifted apart on different halves.
    assert_params_close(ranks[0]["unfrozen"], ranks[1]["unfrozen"], "unfrozen", **EXACT)


@pytest.mark.slow
def test_accumulate_combinator_sends_only_after_the_last_micro_batch(ranks):
    for rank, result in enumerate(ranks):
        probe = result["accumulate-probe"]
        # The first window runs before the hooks exist; after it, MICRO - 1 paused backwards
        # send nothing and the last one sends all buckets but the last (update sends that).
        assert probe["sent"][:MICRO] == [None] * MICRO
        assert probe["sent"][MICRO:] == [0, 3] * (STEPS - 1)
        assert_params_close(
            probe["params"], result["accumulated"], f"accumulate, rank {rank}", rtol=0, atol=0
        )


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_overlap_is_bitwise_the_update_after_backward(ranks, case):
    """The hooks' result equals average_gradients after backward, bit for bit, in every case:
    16-bit wires, a bucket per parameter, gradients changed in place after backward, two
    backward passes without no_sync, ranks that ran different numbers of them, parameters
    without a gradient on one rank or on all, and gradients zeroed instead of dropped (so that
    last step's average, a view of a bucket, is where backward accumulates)."""
    for rank, result in enumerate(ranks):
        ours, theirs = result["overlap-runs"][case]
        assert_params_close(ours, theirs, f"{case}, rank {rank}", rtol=0, atol=0)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            ranks[0]["overlap-runs"][case][0], ranks[1]["overlap-runs"][case][0], strict=True
        )
    )


def test_no_sync_is_a_checked_context_that_holds_nothing_back_before_the_first_update():
    ctx = local_ctx()
    model = make_model()
    with pause_hooks(model, ctx):
        pass
    assert model not in _HOOKS
    with pytest.raises(sg.UsageError):
        pause_hooks("model", ctx)  # type: ignore[arg-type]
