"""FSDP groups as data (issue 37): torchtitan's layout is one ``fsdp(groups=...)`` call.

Each block is a group, the last one kept gathered after forward, and the final
norm and the output layer are one group together. The call must train bit for
bit as the same layout written by hand in a substituted ``wrap``, build the same
groups, and compose with ``with_precision`` and per-group precision policies.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import stratagem as sg
from helpers import make_block

LAYERS = 3
STEPS = 3


class Tiny(torch.nn.Module):
    """torchtitan's Llama in miniature: embeddings, blocks, a final norm, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.layers = torch.nn.ModuleList(make_block(seed=i) for i in range(LAYERS))
        self.norm = torch.nn.LayerNorm(16)
        self.output = torch.nn.Linear(16, 32, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def titan_groups() -> list[sg.ShardGroup]:
    last = LAYERS - 1
    return [
        *(sg.shard_group(f"layers.{i}") for i in range(last)),
        sg.shard_group(f"layers.{last}", reshard_after_forward=False),
        sg.shard_group("norm", "output", reshard_after_forward=False),
    ]


def by_hand(module: torch.nn.Module, ctx: sg.Context) -> torch.nn.Module:
    """The same layout as torchtitan writes it (rank 0's weights: fsdp() copies them too)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        torch.distributed.broadcast(tensor.data, src=0)
    mesh = ctx.data_mesh
    for index, layer in enumerate(module.layers):
        fully_shard(layer, mesh=mesh, reshard_after_forward=index < LAYERS - 1)
    fully_shard([module.norm, module.output], mesh=mesh, reshard_after_forward=False)
    fully_shard(module, mesh=mesh)
    return module


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))


def train(strategy, ctx) -> dict[str, object]:
    torch.manual_seed(ctx.rank)  # ranks start apart: the wrap must agree them
    model = strategy.wrap(Tiny(), ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(100 + ctx.rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, 32, (2, 9), generator=generator)
        loss = strategy.step(model, tokens, ctx, forward=loss_of)
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    plain = sg.unwrap(model)
    gathered_after_forward = {}
    with torch.no_grad():
        plain(torch.zeros(1, 4, dtype=torch.long))
        for name in ("layers.0", f"layers.{LAYERS - 1}", "norm"):
            weight = next(plain.get_submodule(name).parameters())
            gathered_after_forward[name] = not hasattr(weight, "full_tensor")
    plain.reshard()
    state = {k: v.full_tensor().clone() for k, v in plain.state_dict().items()}
    return {
        "state": state,
        "one group": plain.norm._get_fsdp_state() is plain.output._get_fsdp_state(),
        "gathered after forward": gathered_after_forward,
    }


@pytest.mark.slow
def test_torchtitans_layout_as_one_fsdp_call_equals_the_substituted_wrap_bit_for_bit():
    ours = sg.launch(train, sg.fsdp_spawn(device="cpu", groups=titan_groups()), devices=2)
    theirs = sg.launch(train, attrs.evolve(sg.fsdp_spawn(device="cpu"), wrap=by_hand), devices=2)
    for rank in range(2):
        assert ours[rank]["state"].keys() == theirs[rank]["state"].keys()
        for key, value in theirs[rank]["state"].items():
            assert torch.equal(ours[rank]["state"][key], value), (rank, key)
        for result in (ours[rank], theirs[rank]):
            assert result["one group"]  # norm and output gathered together
            assert result["gathered after forward"] == {
                "layers.0": False,  # resharded after its forward
                f"layers.{LAYERS - 1}": True,  # kept gathered for the backward
                "norm": True,
            }


def dtypes_in_forward(strategy, ctx) -> dict[str, str]:
    model = strategy.wrap(Tiny(), ctx)
    plain = sg.unwrap(model)
    seen: dict[str, str] = {}

    def record(name: str):
        def hook(module, args, out) -> None:  # a hook returning a value would replace the output
            seen.setdefault(name, str(next(module.parameters()).dtype))

        return hook

    for name in ("layers.0.q", "layers.1.q", "output"):  # linear layers: norms may stay float32
        plain.get_submodule(name).register_forward_hook(record(name))
    loss = strategy.step(model, torch.randint(0, 32, (2, 9)), ctx, forward=loss_of)
    strategy.backward(loss, model, ctx)
    return seen


@pytest.mark.slow
def test_groups_compose_with_with_precision_and_with_a_groups_own_policy():
    mixed = sg.with_precision(sg.fsdp_spawn(device="cpu", groups=titan_groups()), "bf16-mixed")
    half = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    own = sg.fsdp_spawn(
        device="cpu", groups=[sg.shard_group("layers.1", mp_policy=half), sg.shard_group("output")]
    )
    (under_precision, _), (per_group, _) = (
        sg.launch(dtypes_in_forward, mixed, devices=2),
        sg.launch(dtypes_in_forward, own, devices=2),
    )
    # The gathered parameters a group's forward computes with are the policy's dtype.
    assert under_precision == dict.fromkeys(
        ("layers.0.q", "layers.1.q", "output"), "torch.bfloat16"
    )
    assert per_group == {
        "layers.0.q": "torch.float32",
        "layers.1.q": "torch.bfloat16",
        "output": "torch.float32",
    }


# Refusals: in a world of one, before anything is sharded.


@pytest.fixture
def world_of_one():
    strategies = []

    def setup(**options):
        strategy = sg.fsdp(device="cpu", **options)
        strategies.append((strategy, strategy.setup(sg.Env())))
        return strategies[-1]

    yield setup
    for strategy, ctx in strategies:
        strategy.teardown(ctx)


def test_a_name_the_model_does_not_hold_is_named_before_anything_is_sharded(world_of_one):
    strategy, ctx = world_of_one(groups=[sg.shard_group("layers.0"), sg.shard_group("head")])
    model = Tiny()
    with pytest.raises(sg.UsageError) as caught:
        strategy.wrap(model, ctx)
    assert str(caught.value) == (
        "wrap: fsdp(groups=...) names 'head', which Tiny does not hold; its children are "
        "'embed', 'layers', 'norm', 'output' (name a submodule by its dotted path)."
    )
    assert not any(sg.strategies.fsdp_units.is_sharded(m) for m in model.modules())


def test_a_group_holding_a_module_of_a_later_group_is_refused(world_of_one):
    strategy, ctx = world_of_one(
        groups=[sg.shard_group("layers", "norm.weight_holder"), sg.shard_group("layers.1")]
    )
    with pytest.raises(sg.UsageError, match=r"shards 'layers' .* before 'layers\.1', which it"):
        strategy.wrap(Tiny(), ctx)


def test_a_groups_reshard_size_must_divide_the_shard_group(world_of_one):
    strategy, ctx = world_of_one(groups=[sg.shard_group("norm", reshard_after_forward=2)])
    with pytest.raises(sg.UsageError, match=r"shard_group\(reshard_after_forward=2\) must divide"):
        strategy.wrap(Tiny(), ctx)


def test_a_groups_policy_beside_with_precision_is_refused(world_of_one):
    strategy = sg.with_precision(
        sg.fsdp(
            device="cpu",
            groups=[sg.shard_group("norm", mp_policy=MixedPrecisionPolicy(torch.bfloat16))],
        ),
        "bf16-mixed",
    )
    ctx = strategy.setup(sg.Env())
    try:
        with pytest.raises(sg.CombinatorError, match=r"sets mp_policy, but with_precision"):
            strategy.wrap(Tiny(), ctx)
    finally:
        strategy.teardown(ctx)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: sg.shard_group(), r"name one or more submodules, each once"),
        (lambda: sg.shard_group("a", "a"), r"name one or more submodules, each once"),
        (lambda: sg.shard_group("a", reshard_after_forward=1), r"reshard_after_forward"),
        (lambda: sg.shard_group("a", shard_placement_fn=3), r"shard_placement_fn"),
        (
            lambda: sg.fsdp(device="cpu", groups=["norm"]),
            r"must be a list of shard_group\(\.\.\.\) records",
        ),
        (
            lambda: sg.fsdp(device="cpu", groups=[sg.shard_group("a"), sg.shard_group("b", "a")]),
            r"'a' is in group 0 and group 1",
        ),
    ],
)
def test_bad_groups_are_refused_at_construction(call, match):
    with pytest.raises(sg.UsageError, match=match):
        call()


def test_groups_print_and_pickle_as_data():
    import pickle

    strategy = sg.fsdp(device="cpu", groups=titan_groups())
    assert pickle.loads(pickle.dumps(strategy)) == strategy
    assert "ShardGroup(modules=('norm', 'output'), reshard_after_forward=False" in repr(
        strategy.wrap
    )
