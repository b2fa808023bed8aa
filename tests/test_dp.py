"""dp(): DataParallel in one process; on a CPU-only machine it equals single_device() bit for bit.

What runs here without a GPU: construction, setup, wrapping, the fallback to
the plain module, and training. Scattering over several GPUs is not exercised.
"""

from __future__ import annotations

import contextlib
import pickle

import attrs
import pytest
import torch
from torch.nn.parallel import DataParallel

import stratagem as sg
from helpers import make_batches, make_model

STEPS = 4
BATCH = 8
MICRO = 2

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")


def mean_loss(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def train(strategy, ctx, micro=1):
    model = strategy.wrap(make_model(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    for batch in make_batches(steps=STEPS, size=BATCH):
        pieces = list(zip(*(t.chunk(micro) for t in batch), strict=True))
        for index, piece in enumerate(pieces):
            last = index == len(pieces) - 1
            with contextlib.nullcontext() if last else strategy.no_sync(model, ctx):
                loss = strategy.step(model, piece, ctx, forward=mean_loss)
                strategy.backward(loss / micro, model, ctx)
        strategy.update(optimizer, model, ctx)
    losses = strategy.reduce(loss.detach(), "mean", ctx)
    return type(model), [p.detach().clone() for p in sg.unwrap(model).parameters()], losses


@no_cuda
@pytest.mark.parametrize("micro", [1, MICRO])
def test_dp_on_the_cpu_equals_single_device_bit_for_bit(micro):
    [(wrapper, ours, our_loss)] = sg.launch(train, sg.dp(), args=(micro,))
    [(_, theirs, their_loss)] = sg.launch(train, sg.single_device("cpu"), args=(micro,))
    assert wrapper is DataParallel
    initial = list(make_model().parameters())
    for a, b, start in zip(ours, theirs, initial, strict=True):
        assert torch.equal(a, b)
        assert not torch.equal(a, start.detach())
    assert torch.equal(our_loss, their_loss)


def test_state_dict_keys_are_the_plain_modules():
    strategy = sg.dp()
    model = strategy.wrap(make_model(), strategy.setup(sg.Env()))
    plain = list(make_model().state_dict())
    assert list(model.state_dict()) == [f"module.{k}" for k in plain]  # DataParallel's own
    assert list(sg.unwrap(model).state_dict()) == plain


@no_cuda
def test_setup_uses_the_cpu_without_cuda():
    ctx = sg.dp().setup(sg.Env())
    assert ctx.device == torch.device("cpu")
    assert ctx.group is None


@no_cuda
def test_device_ids_without_cuda_are_a_clear_error():
    with pytest.raises(sg.UsageError) as caught:
        sg.dp(device_ids=[0, 1]).setup(sg.Env())
    assert str(caught.value) == (
        "dp(device_ids=[0, 1]) asks for GPU 0, but this machine has 0 CUDA device(s); "
        "pass device_ids=None to use what there is."
    )


@pytest.mark.parametrize("device_ids", [[], "0", [0, 0], [-1], [True], [0.0], 0])
def test_bad_device_ids_are_clear_errors(device_ids):
    with pytest.raises(
        sg.UsageError, match=r"'device_ids' must be None \(every GPU\) or a non-empty"
    ):
        sg.dp(device_ids=device_ids)


def test_a_world_of_many_is_refused():
    with pytest.raises(sg.LaunchError, match=r"dp\(\) drives every GPU from one process"):
        sg.dp().setup(sg.Env(rank=0, world_size=2, local_world_size=2, source="torchrun"))
    with pytest.raises(sg.LaunchError, match="devices=2"):
        sg.launch(train, sg.dp(), devices=2)


def test_dp_is_single_device_with_setup_and_wrap_substituted():
    dp, single = sg.dp(), sg.single_device(device="cpu")
    differing = [
        f.name for f in attrs.fields(sg.Strategy) if getattr(dp, f.name) != getattr(single, f.name)
    ]
    assert differing == ["name", "setup", "wrap"]


def test_record_is_picklable_and_readable():
    strategy = sg.dp(device_ids=(1, 0))
    assert pickle.loads(pickle.dumps(strategy)) == strategy
    assert repr(strategy.wrap) == "WrapDataParallel(device_ids=(1, 0))"
    assert sg.dp(device_ids=[1, 0]) == strategy  # a list is kept as a tuple
