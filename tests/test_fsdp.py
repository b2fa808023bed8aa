"""fsdp(): K steps on 2 gloo ranks equal K steps of single_device() on the whole batches.

Every distributed check runs in one launch of two ranks (a module-scoped
fixture); the tests then read its results. Option errors and the policies
are checked in this process.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from typing import Any, NamedTuple

import attrs
import pytest
import torch

import stratagem as sg
from helpers import make_batches, make_model
from stratagem.meshes import device_mesh, mesh_shape
from stratagem.strategies.fsdp import OPTIMIZER_BEFORE_WRAP

STEPS = 4
BATCH = 8
MAX_NORM = 0.05  # small enough that every step of the clipped case clips
TOLERANCE = {"rtol": 0, "atol": 1e-6}


# Linear(6, 16) of 112 elements, a nested block (Linear(16, 16), Tanh) of 272, Linear(16, 2) of
# 34: above_parameters must skip what a sharded child holds.
nested_model = functools.partial(make_model, nested=True)
batches = functools.partial(make_batches, steps=STEPS, size=BATCH)


def mean_loss(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def split(batch, sizes):
    return [tuple(part) for part in zip(*(t.split(sizes) for t in batch), strict=True)]


def half(batch, ctx):
    return split(batch, [BATCH // ctx.world_size] * ctx.world_size)[ctx.rank]


def uneven(batch, ctx):
    return split(batch, [5, 3])[ctx.rank]


def whole(batch, ctx):
    return batch


def mean_loss_for(ctx):
    return mean_loss


def global_mean_loss_for(ctx):
    """Sum over this rank's samples, scaled so that FSDP's gradient average is the global mean."""

    def forward(model, batch):
        inputs, targets = batch
        squared = (model(inputs) - targets).pow(2).mean(dim=1)
        return squared.sum() * ctx.world_size / BATCH

    return forward


class Case(NamedTuple):
    options: dict[str, Any]
    piece: Any = half
    loss: Any = mean_loss_for
    micro: int = 1  # micro-batches per optimizer step, all but the last under no_sync
    clip: float | None = None
    shard_size: int | str = "world"


LINEAR = sg.every_module_of(torch.nn.Linear)
CASES = {
    "every_linear": Case({"shard_when": LINEAR}),
    "above_200": Case({"shard_when": sg.above_parameters(200), "reshard_after_forward": False}),
    "root_only": Case({}),
    "uneven": Case({"shard_when": LINEAR}, piece=uneven, loss=global_mean_loss_for),
    "accumulated": Case({"shard_when": LINEAR}, micro=2),
    "accumulated_above": Case({"shard_when": sg.above_parameters(200)}, micro=2),
    "clipped": Case({"shard_when": LINEAR}, clip=MAX_NORM),
    "hybrid": Case({"shard_when": LINEAR}, shard_size=1),  # 2 replicas of 1-rank shards
}


def full(parameter: torch.Tensor) -> torch.Tensor:
    gather = getattr(parameter, "full_tensor", None)  # a DTensor: every rank gathers the whole
    return (gather() if gather else parameter).detach().clone()


def train(strategy, ctx, case: Case, *, reference: bool = False):
    model = strategy.wrap(nested_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    piece_of, micro = (whole, 1) if reference else (case.piece, case.micro)
    forward = mean_loss if reference else case.loss(ctx)
    norms = []
    for batch in batches():
        mine = piece_of(batch, ctx)
        pieces = split(mine, [len(mine[0]) // micro] * micro)
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1  # only the last micro-batch synchronises
            with contextlib.nullcontext() if last else strategy.no_sync(model, ctx):
                loss = strategy.step(model, piece, ctx, forward=forward)
                strategy.backward(loss / micro, model, ctx)
        if case.clip is not None:
            norms.append(sg.clip_grad_norm(model, case.clip))
        strategy.update(optimizer, model, ctx)
    return model, [full(p) for p in sg.unwrap(model).parameters()], norms


def sharded_names(model: torch.nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    return sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))


def error_of(action) -> str:
    try:
        action()
    except sg.UsageError as error:
        return str(error)
    return "no error"


def other_checks(strategy, ctx) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    out: dict[str, Any] = {"plain_keys": list(nested_model().state_dict())}
    model = strategy.wrap(nested_model(), ctx)
    out["fsdp_keys"] = list(model.state_dict())
    out["unwrap_is_identity"] = sg.unwrap(model) is model
    out["local_shape"] = tuple(model[0].weight.to_local().shape)
    ddp_model = sg.ddp(device="cpu").wrap(nested_model(), ctx)
    out["ddp_keys"], out["ddp_raw_keys"] = (
        list(sg.unwrap(ddp_model).state_dict()),
        list(ddp_model.state_dict()),
    )
    del ddp_model

    model, batch = strategy.wrap(nested_model(), ctx), batches()[0]
    with strategy.no_sync(model, ctx):
        strategy.backward(strategy.step(model, batch, ctx, forward=mean_loss), model, ctx)
    out["grads_inside_no_sync"] = {p.grad is None for p in model.parameters()}
    strategy.backward(strategy.step(model, batch, ctx, forward=mean_loss), model, ctx)
    out["grads_after_no_sync"] = {type(p.grad).__name__ for p in model.parameters()}

    plain = nested_model()
    early = torch.optim.SGD(plain.parameters(), lr=0.1)  # built before wrap: the mistake
    model = strategy.wrap(plain, ctx)
    strategy.backward(strategy.step(model, batches()[0], ctx, forward=mean_loss), model, ctx)
    out["optimizer_before_wrap"] = error_of(lambda: strategy.update(early, model, ctx))

    out["bad_policy"] = error_of(
        lambda: sg.fsdp(shard_when=lambda m: 1, device="cpu").wrap(nested_model(), ctx)
    )
    out["wrap_twice"] = error_of(lambda: strategy.wrap(model, ctx))

    mixed = sg.fsdp(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64), device="cpu").wrap(
        nested_model(), ctx
    )
    out["mixed_params"] = {p.dtype for p in mixed.parameters()}
    out["mixed_output"] = mixed(torch.ones(2, 6)).dtype
    return out


def distributed_runs(strategy, ctx):
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        case_ctx = ctx
        if case.shard_size != "world":
            mesh = device_mesh(ctx, case.shard_size)
            case_ctx = attrs.evolve(ctx, extras={**ctx.extras, "mesh": mesh})
            results[f"{name}/mesh"] = (mesh.mesh_dim_names, tuple(mesh.shape))
        case_strategy = attrs.evolve(strategy, wrap=sg.fsdp(**case.options).wrap)
        model, results[name], results[f"{name}/norms"] = train(case_strategy, case_ctx, case)
        results[f"{name}/sharded"] = sharded_names(model)
    results["mesh"] = (ctx.extras["mesh"].mesh_dim_names, tuple(ctx.extras["mesh"].shape))
    results["checks"] = other_checks(strategy, ctx)
    return results


@pytest.fixture(scope="module")
def ranks():
    return sg.launch(distributed_runs, sg.fsdp_spawn(device="cpu"), devices=2)


@pytest.fixture(scope="module")
def reference():
    def run(strategy, ctx):
        return {
            name: train(strategy, ctx, case, reference=True)[1:] for name, case in CASES.items()
        }

    [result] = sg.launch(run, sg.single_device("cpu"))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_two_ranks_equal_one_rank_on_the_whole_batch(ranks, reference, name):
    expected, expected_norms = reference[name]
    initial = list(nested_model().parameters())
    for rank, result in enumerate(ranks):
        for ours, theirs, start in zip(result[name], expected, initial, strict=True):
            torch.testing.assert_close(
                ours, theirs, **TOLERANCE, msg=lambda m, r=rank: f"{name}, rank {r}: {m}"
            )
            assert not torch.allclose(ours, start.detach())  # training moved the parameters
        torch.testing.assert_close(result[f"{name}/norms"], expected_norms, rtol=1e-5, atol=0)


@pytest.mark.slow
def test_policies_choose_the_groups(ranks):
    expected = {
        "every_linear": ["", "0", "2.0", "3"],
        "above_200": ["", "2.0"],  # "2" holds only what its sharded child holds: not counted
        "root_only": [""],
    }
    for result in ranks:
        for name, names in expected.items():
            assert result[f"{name}/sharded"] == names, name


@pytest.mark.slow
def test_meshes_are_one_dimensional_or_hybrid(ranks):
    for result in ranks:
        assert result["mesh"] == (("shard",), (2,))
        assert result["hybrid/mesh"] == (("replicate", "shard"), (2, 1))


@pytest.mark.slow
def test_parameters_are_sharded_across_the_ranks(ranks):
    for result in ranks:
        assert result["checks"]["local_shape"] == (8, 6)  # half of the (16, 6) weight


@pytest.mark.slow
def test_clipping_acts_on_the_norm_of_all_shards(ranks):
    for result in ranks:
        assert all(norm > MAX_NORM for norm in result["clipped/norms"])


@pytest.mark.slow
def test_state_dict_keys_are_the_plain_modules(ranks):
    for result in ranks:
        checks = result["checks"]
        assert checks["fsdp_keys"] == checks["plain_keys"]
        assert checks["unwrap_is_identity"]  # fully_shard works in place: nothing to unwrap
        assert checks["ddp_keys"] == checks["plain_keys"]
        assert checks["ddp_raw_keys"] == [f"module.{k}" for k in checks["plain_keys"]]


@pytest.mark.slow
def test_no_sync_defers_the_reduce_scatter_to_the_next_backward_outside(ranks):
    for result in ranks:
        assert result["checks"]["grads_inside_no_sync"] == {True}  # no sharded grads yet
        assert result["checks"]["grads_after_no_sync"] == {"DTensor"}


@pytest.mark.slow
def test_an_optimizer_built_before_wrap_is_a_clear_error(ranks):
    for result in ranks:
        message = result["checks"]["optimizer_before_wrap"]
        assert message == OPTIMIZER_BEFORE_WRAP.format(what="a Parameter of shape (16, 6)")


@pytest.mark.slow
def test_wrap_errors_on_ranks(ranks):
    for result in ranks:
        checks = result["checks"]
        assert (
            "must return True or False, but returned 1, an int for a Linear" in checks["bad_policy"]
        )
        assert "already sharded" in checks["wrap_twice"]


@pytest.mark.slow
def test_mixed_precision_policy_reaches_fully_shard(ranks):
    for result in ranks:
        assert result["checks"]["mixed_output"] == torch.float64  # computed in param_dtype
        assert result["checks"]["mixed_params"] == {torch.float32}  # stored as given


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (
            {"shard_when": 3},
            "fsdp(shard_when=...) must be None (shard the root only) or a function",
        ),
        (
            {"reshard_after_forward": "yes"},
            "fsdp(reshard_after_forward=...) must be None, True, False",
        ),
        ({"reshard_after_forward": 1}, "a shard group size of at least 2 (got 1, an int)"),
        ({"mp_policy": "bf16"}, "fsdp(mp_policy=...) must be None or a torch.distributed.fsdp"),
        ({"shard_size": 0}, "'shard_size' must be 'world', 'node' or a positive int (got 0"),
        ({"shard_size": "rack"}, "(got 'rack', a str)"),
        ({"shard_size": True}, "(got True, a bool)"),
        ({"device": 3}, "'device' must be 'auto'"),
        ({"backend": "tcp"}, "'backend' must be None"),
    ],
)
def test_bad_options_are_clear_errors(options, fragment):
    with pytest.raises(sg.UsageError) as caught:
        sg.fsdp(**options)
    assert fragment in str(caught.value)
    with pytest.raises(sg.UsageError):
        sg.fsdp_spawn(**options)


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: sg.every_module_of(), "pass one or more torch.nn.Module subclasses (got nothing)"),
        (lambda: sg.every_module_of("Linear"), "(got 'Linear', a str)"),
        (lambda: sg.every_module_of(int), "(got <class 'int'>, a type)"),
        (lambda: sg.above_parameters(-1), "'count' must be a non-negative int (got -1, an int)"),
        (lambda: sg.above_parameters(1.5), "(got 1.5, a float)"),
    ],
)
def test_bad_policies_are_clear_errors(make, fragment):
    with pytest.raises(sg.UsageError) as caught:
        make()
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("world", "local", "shard_size", "shape"),
    [
        (2, 2, "world", (2,)),
        (8, 4, "world", (8,)),
        (8, 4, "node", (2, 4)),
        (8, 8, "node", (8,)),
        (8, 4, 2, (4, 2)),
        (8, 4, 8, (8,)),
        (2, 2, 1, (2, 1)),
    ],
)
def test_mesh_shapes(world, local, shard_size, shape):
    assert mesh_shape(sg.Env(world_size=world, local_world_size=local), shard_size) == shape


@pytest.mark.parametrize(
    ("world", "local", "shard_size", "fragment"),
    [
        (
            2,
            2,
            3,
            "shard_size=3 (3 ranks) does not divide the world of 2 ranks into equal shard "
            "groups; use one of [1, 2], or shard_size='world'.",
        ),
        (6, 4, "node", "shard_size='node' (4 ranks per node) does not divide the world of 6"),
    ],
)
def test_a_world_that_does_not_factor_fails_before_joining(world, local, shard_size, fragment):
    strategy = sg.fsdp(shard_size=shard_size, device="cpu")
    with pytest.raises(sg.UsageError) as caught:
        strategy.setup(sg.Env(world_size=world, local_world_size=local))
    assert fragment in str(caught.value)
    assert not torch.distributed.is_initialized()


def test_wrap_needs_the_mesh_of_fsdp_setup():
    ctx = sg.single_device("cpu").setup(sg.Env())
    with pytest.raises(sg.UsageError, match=r"ctx.extras has no 'mesh'; pass the Context"):
        sg.fsdp(device="cpu").wrap(nested_model(), ctx)


@pytest.mark.parametrize("value", [2, 3, 10**30])
def test_a_reshard_size_that_does_not_divide_the_shard_group_is_named_at_wrap(value):
    # Reported (issue 40's round): torch's raw ValueError from inside fully_shard.
    strategy = sg.fsdp(device="cpu", reshard_after_forward=value)
    ctx = strategy.setup(sg.Env())  # a world of one: a shard group of 1
    try:
        model = nested_model()
        with pytest.raises(sg.UsageError) as caught:
            strategy.wrap(model, ctx)
        assert str(caught.value) == (
            f"wrap: fsdp(reshard_after_forward={value}) must divide the shard group's size, 1 "
            "rank(s) here; pass a factor of it, True or False."
        )
        assert not sg.strategies.fsdp_units.is_sharded(model)  # nothing was done
    finally:
        strategy.teardown(ctx)


def test_no_sync_needs_the_wrapped_module():
    ctx = sg.single_device("cpu").setup(sg.Env())
    with pytest.raises(
        sg.UsageError, match=r"must be the module wrap returned \(an FSDPModule\), got Sequential"
    ):
        sg.fsdp(device="cpu").no_sync(nested_model(), ctx)


def test_policies_on_plain_modules():
    assert LINEAR(torch.nn.Linear(2, 2)) and not LINEAR(torch.nn.Tanh())
    assert sg.above_parameters(111)(nested_model()[0]) and not sg.above_parameters(112)(
        nested_model()[0]
    )
    assert sg.above_parameters(417)(nested_model()) and not sg.above_parameters(418)(nested_model())
    assert (
        repr(sg.every_module_of(torch.nn.Linear, torch.nn.Conv2d))
        == "every_module_of(Linear, Conv2d)"
    )
    assert repr(sg.above_parameters(10)) == "above_parameters(10)"


def test_records_are_picklable_and_compare_by_value():
    strategy = sg.fsdp_spawn(
        shard_when=LINEAR, reshard_after_forward=False, shard_size="node", device="cpu"
    )
    assert pickle.loads(pickle.dumps(strategy)) == strategy
    assert sg.fsdp(shard_when=sg.above_parameters(5), device="cpu") == sg.fsdp(
        shard_when=sg.above_parameters(5), device="cpu"
    )
    differing = [
        field.name
        for field in attrs.fields(sg.Strategy)
        if getattr(sg.fsdp(device="cpu"), field.name)
        != getattr(sg.fsdp_spawn(device="cpu"), field.name)
    ]
    assert differing == ["name", "launch"]


def test_fsdp_reuses_the_ddp_fields_it_does_not_change():
    fsdp, ddp = sg.fsdp(device="cpu"), sg.ddp(device="cpu")
    same = [
        f.name for f in attrs.fields(sg.Strategy) if getattr(fsdp, f.name) == getattr(ddp, f.name)
    ]
    assert same == [
        "launch",
        "step",
        "backward",
        "reduce",
        "gather",
        "broadcast",
        "barrier",
        "shard",
        "save",
        "load",
        "teardown",
    ]
    assert fsdp.setup.join == ddp.setup


def test_clip_grad_norm_equals_torch_on_plain_gradients():
    ours, theirs = nested_model(), nested_model()
    for model in (ours, theirs):
        mean_loss(model, batches()[0]).backward()
    norm = sg.clip_grad_norm(ours, MAX_NORM)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM))
    assert norm > MAX_NORM
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    with pytest.raises(
        sg.UsageError, match=r"'max_norm' must be a positive number \(got 0, an int\)"
    ):
        sg.clip_grad_norm(ours, 0)
