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


# --- selective by op (issue 37): keep the outputs of the ops named, recompute the rest ---------


class MatmulsCounted(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matrix multiplies run inside it, by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in ("aten.mm.default", "aten.bmm.default"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def deep_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *(torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.GELU()) for _ in range(3))
    )


def backward_ops_and_trained_weights(strategy) -> tuple[dict[str, int], list[torch.Tensor]]:
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(deep_mlp(), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counted = MatmulsCounted()
    for step in range(3):
        loss = strategy.step(
            model, torch.randn(4, 8), ctx, forward=lambda m, b: m(b).square().mean()
        )
        if step == 0:
            with counted:
                strategy.backward(loss, model, ctx)
        else:
            strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return counted.counts, [p.detach().clone() for p in model.parameters()]


BLOCKS = sg.every_module_of(torch.nn.Sequential)  # each Linear + GELU pair, not the root


def test_saving_the_matrix_multiplies_recomputes_only_the_rest_and_trains_bit_for_bit():
    torch.manual_seed(5)
    plain, trained = backward_ops_and_trained_weights(sg.single_device("cpu"))
    torch.manual_seed(5)
    whole, whole_trained = backward_ops_and_trained_weights(
        sg.with_activation_checkpointing(sg.single_device("cpu"), BLOCKS)
    )
    torch.manual_seed(5)
    selective, selective_trained = backward_ops_and_trained_weights(
        sg.with_activation_checkpointing(
            sg.single_device("cpu"), BLOCKS, save=[torch.ops.aten.mm.default]
        )
    )
    # Backward alone: dW for three layers and dX for the two above the input (mm), no GELU.
    assert plain == {"aten.mm.default": 5}
    # Whole-module checkpointing runs each block's forward again, as far as backward needs:
    # three more mm (GELU's backward needs only its input, the mm's output).
    assert whole == {"aten.mm.default": 8}
    # Saving mm keeps its outputs from the forward: nothing is run again.
    assert selective == {"aten.mm.default": 5}
    for ours, theirs in zip((*whole_trained, *selective_trained), trained * 2, strict=True):
        assert torch.equal(ours, theirs)


def test_the_save_list_is_held_by_name_and_pickles():
    import pickle

    strategy = sg.with_activation_checkpointing(
        sg.ddp(device="cpu"), BLOCKS, save=[torch.ops.aten.mm.default, "aten.bmm.default"]
    )
    assert strategy.wrap.save == ("aten.mm.default", "aten.bmm.default")
    assert pickle.loads(pickle.dumps(strategy)) == strategy


@pytest.mark.parametrize(
    ("save", "match"),
    [
        ("aten.mm.default", r"'save' must be a list of ops \(got 'aten.mm.default', a str\)"),
        ([torch.ops.aten.mm], r"save names aten.mm, every overload of an op; .* aten.mm.default"),
        (["aten.nothing.default"], r"'aten.nothing.default', which is not an op overload"),
    ],
)
def test_a_save_list_that_names_no_op_is_refused(save, match):
    with pytest.raises(sg.UsageError, match=match):
        sg.with_activation_checkpointing(sg.single_device("cpu"), BLOCKS, save=save)
