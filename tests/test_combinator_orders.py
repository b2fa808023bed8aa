"""Every stack of two combinators trains alike in either order (issue 36).

Combinators do not look into each other's layers: where two cooperate
(precision and FSDP's policy, clipping and loss scaling) they meet through the
context, and the built-ins' ``no_sync`` see through the compiler. So for every
pair, both orders construct and train to the same weights, bit for bit, under
a real DDP wrap in a world of one (its ``no_sync`` is DDP's own).
"""

from __future__ import annotations

import itertools

import pytest
import torch

import stratagem as sg

COMBINATORS = {
    "accumulate": lambda s: sg.accumulate(s, 2),
    "clipping": lambda s: sg.with_clipping(s, max_norm=0.05),
    "precision": lambda s: sg.with_precision(s, "bf16-mixed"),
    "traced": lambda s: sg.traced(s, sg.ListSink()),
    "checked": sg.checked,
    "checkpointing": lambda s: sg.with_activation_checkpointing(
        s, sg.every_module_of(torch.nn.Linear)
    ),
    "compiled": lambda s: sg.compiled(s, backend="eager"),
}
CHANGE_TRAINING = {"accumulate", "clipping", "precision"}  # the others keep the arithmetic
SLOW = {"compiled"}  # dynamo traces each new module: seconds per run


def train(strategy) -> list[torch.Tensor]:
    ctx = strategy.setup(sg.Env())
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        model = strategy.wrap(model, ctx)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        targets = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
        for x, y in zip(inputs.chunk(4), targets.chunk(4), strict=True):
            loss = strategy.step(
                model, (x, y), ctx, forward=lambda m, b: (m(b[0]).float() - b[1]).pow(2).mean()
            )
            strategy.backward(loss, model, ctx)
            strategy.update(optimizer, model, ctx)
        return [p.detach().clone() for p in sg.unwrap(model).parameters()]
    finally:
        strategy.teardown(ctx)


PAIRS = [
    pytest.param(a, b, marks=[pytest.mark.slow] if {a, b} & SLOW else [], id=f"{a}-{b}")
    for a, b in itertools.combinations(COMBINATORS, 2)
]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_two_combinators_train_alike_in_either_order(first, second):
    base = sg.ddp(device="cpu")
    one = COMBINATORS[second](COMBINATORS[first](base))
    other = COMBINATORS[first](COMBINATORS[second](base))
    alone = train(base)
    ours, theirs = train(one), train(other)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    if {first, second} & CHANGE_TRAINING:  # a test of the test: not trivially equal
        assert not all(torch.equal(a, b) for a, b in zip(ours, alone, strict=True))
