"""with_activation_checkpointing recomputes what its policy picks, and trains as before; FSDP's
CPU offload trains as one process. The laws run on real gloo ranks (FSDP x TP on 2x2)."""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from helpers import block_plan, make_block
from stratagem.testing import check_all

LINEARS = sg.every_module_of(torch.nn.Linear)


def forwards_per_step(strategy) -> dict[str, int]:
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(make_block(), ctx)
    counts = dict.fromkeys(("norm", "q", "up", "down"), 0)
    for name in counts:

        def count(module, args, name=name):
            counts[name] += 1

        getattr(model, name).register_forward_pre_hook(count)
    batch = torch.randn(2, 6, 16)
    loss = strategy.step(model, batch, ctx, forward=lambda m, b: m(b).pow(2).mean())
    strategy.backward(loss, model, ctx)
    return counts


def test_the_picked_submodules_run_again_in_backward_and_no_others():
    plain = forwards_per_step(sg.single_device("cpu"))
    assert plain == {"norm": 1, "q": 1, "up": 1, "down": 1}
    policy = sg.every_module_of(torch.nn.Linear)
    checkpointed = forwards_per_step(
        sg.with_activation_checkpointing(sg.single_device("cpu"), policy)
    )
    assert checkpointed == {"norm": 1, "q": 2, "up": 2, "down": 2}


def test_checkpointing_keeps_the_parameter_names_and_refuses_bad_policies():
    strategy = sg.with_activation_checkpointing(sg.single_device("cpu"), LINEARS)
    ctx = strategy.setup(sg.Env())
    assert list(strategy.wrap(make_block(), ctx).state_dict()) == list(make_block().state_dict())
    odd = sg.with_activation_checkpointing(sg.single_device("cpu"), lambda m: 1)
    with pytest.raises(sg.UsageError, match=r"must return True or False, but returned 1, an int"):
        odd.wrap(make_block(), odd.setup(sg.Env()))
    with pytest.raises(sg.CombinatorError, match=r"already checkpoints activations"):
        sg.with_activation_checkpointing(strategy, LINEARS)
    with pytest.raises(sg.UsageError, match=r"'policy' must be a function module -> bool"):
        sg.with_activation_checkpointing(sg.single_device("cpu"), "linear")


@pytest.mark.slow
def test_checkpointed_fsdp_x_tp_passes_every_law_on_2x2():
    strategy = sg.with_activation_checkpointing(
        sg.tensor_parallel(sg.fsdp(device="cpu"), block_plan(), size=2), LINEARS
    )
    batch = torch.randn(16, 6, 16, generator=torch.Generator().manual_seed(0))
    report = check_all(strategy, world_size=4, module=make_block(), batch=batch)
    assert {"data-parallel-step", "accumulation", "checkpoint-round-trip"} <= set(report.passed)
    assert not report.skipped, report


@pytest.mark.slow
def test_fsdp_with_cpu_offload_passes_the_training_laws():
    report = check_all(sg.fsdp(offload=True, device="cpu"), world_size=2)
    assert {"data-parallel-step", "accumulation", "checkpoint-round-trip"} <= set(report.passed)
    assert sg.fsdp(offload=True, device="cpu").wrap.offload is True
