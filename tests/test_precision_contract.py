"""Precision meets FSDP through the context, not the record (issue 36).

``with_precision`` puts its `PrecisionState` in the context at setup; FSDP's
wrap, the built-in one or a user's own, takes its mixed-precision policy from
``precision_of(ctx)``. So a substituted wrap gets the policy (or a clear error,
never a silent float32 gather), and the order of combinators does not matter.
"""

from __future__ import annotations

import attrs
import pytest
import torch

import stratagem as sg
from stratagem.precisions import precision_of


def grouped_fsdp_wrap(module, ctx):
    """A torchtitan-style wrap: each Linear its own group, resharding chosen per group."""
    from torch.distributed.fsdp import fully_shard

    state = precision_of(ctx)
    policy = (
        {} if state is None or state.fsdp_policy() is None else {"mp_policy": state.fsdp_policy()}
    )
    mesh = ctx.extras["mesh"]
    module = module.to(ctx.device)
    for index, layer in enumerate(module):
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=index == 0, **policy)
    fully_shard(module, mesh=mesh, **policy)
    return module


def careless_fsdp_wrap(module, ctx):
    """The same grouping without the precision's policy: FSDP would gather in float32."""
    from torch.distributed.fsdp import fully_shard

    mesh = ctx.extras["mesh"]
    for layer in module:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def gathered_dtypes(strategy):
    """Train one step in a world of one; return the dtype each Linear's weight had in forward."""
    ctx = strategy.setup(sg.Env())
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        model = strategy.wrap(model, ctx)
        seen = []
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                layer.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = strategy.step(
            model, torch.ones(2, 4), ctx, forward=lambda m, b: m(b).float().pow(2).mean()
        )
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
        return seen
    finally:
        strategy.teardown(ctx)


FSDP = sg.fsdp(device="cpu")
OWN_WRAP = attrs.evolve(FSDP, name="fsdp-grouped", wrap=grouped_fsdp_wrap)


@pytest.mark.parametrize(
    "stack",
    [
        lambda s: sg.with_precision(s, "bf16-mixed"),
        lambda s: sg.with_precision(sg.traced(s, sg.ListSink()), "bf16-mixed"),
        lambda s: sg.traced(sg.with_precision(s, "bf16-mixed"), sg.ListSink()),
        lambda s: sg.with_clipping(sg.with_precision(s, "bf16-mixed"), max_norm=1.0),
        lambda s: sg.with_precision(sg.with_clipping(s, max_norm=1.0), "bf16-mixed"),
    ],
    ids=["precision", "precision-over-traced", "traced-over-precision", "clip-over", "clip-under"],
)
@pytest.mark.parametrize("base", [FSDP, OWN_WRAP], ids=["builtin-wrap", "own-wrap"])
def test_the_precision_policy_reaches_fsdp_in_any_order_and_through_a_users_own_wrap(base, stack):
    assert gathered_dtypes(stack(base)) == [torch.bfloat16, torch.bfloat16]


def test_without_a_precision_fsdp_gathers_in_float32():
    assert gathered_dtypes(OWN_WRAP) == [torch.float32, torch.float32]


def test_a_users_wrap_that_ignores_the_policy_is_refused_at_wrap_naming_the_fix():
    careless = sg.with_precision(attrs.evolve(FSDP, wrap=careless_fsdp_wrap), "bf16-mixed")
    with pytest.raises(
        sg.CombinatorError,
        match=r"gather parameters in torch.bfloat16.*mp_policy=precision_of\(ctx\).fsdp_policy\(\)",
    ):
        gathered_dtypes(careless)


def test_an_mp_policy_beside_a_mixed_precision_is_refused_at_wrap():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    both = sg.with_precision(
        sg.fsdp(device="cpu", mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)),
        "bf16-mixed",
    )
    with pytest.raises(
        sg.CombinatorError, match=r"pass either fsdp\(mp_policy=...\) or with_precision"
    ):
        gathered_dtypes(both)


def test_a_true_precision_gives_fsdp_no_policy_but_the_module_in_its_dtype():
    assert gathered_dtypes(sg.with_precision(OWN_WRAP, "bf16-true")) == [
        torch.bfloat16,
        torch.bfloat16,
    ]
