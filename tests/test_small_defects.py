"""Small defects a user reported (issue 15, item 6), each pinned by the behaviour it lacked.

Batches of every shape go through one tree walk (precision casts NamedTuples and
dataclasses, tracing sees their tensors); clipping sums the norm in the module's
parameter order; ``stratagem checkpoint`` prints summaries with sorted keys;
``accumulate`` takes a function of the world size; ``dp()``'s ``module.`` keys
are documented.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import stratagem as sg
from stratagem.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


class Pair(NamedTuple):
    inputs: torch.Tensor
    targets: torch.Tensor
    labels: torch.Tensor


@dataclasses.dataclass
class Record:
    inputs: torch.Tensor
    targets: torch.Tensor
    labels: torch.Tensor
    note: str = "record"
    size: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.inputs)


def regression(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    assert batch.labels.dtype == torch.int64  # integer leaves keep their dtype
    return (model(batch.inputs) - batch.targets).pow(2).mean()


def pair(dtype: torch.dtype = torch.float32) -> Pair:
    generator = torch.Generator().manual_seed(4)
    return Pair(
        torch.randn(6, 3, generator=generator).to(dtype),
        torch.randn(6, 1, generator=generator).to(dtype),
        torch.arange(6),
    )


def record(dtype: torch.dtype = torch.float32) -> Record:
    return Record(*pair(dtype))


def one_step(precision: str, batch: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    strategy = sg.with_precision(sg.single_device("cpu"), precision)
    ctx = strategy.setup(sg.Env())
    torch.manual_seed(0)
    model = strategy.wrap(torch.nn.Linear(3, 1), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = strategy.step(model, batch, ctx, forward=regression)
    strategy.backward(loss, model, ctx)
    strategy.update(optimizer, model, ctx)
    return loss.detach(), [p.detach().clone() for p in model.parameters()]


# --- 1. one tree walk: precision and tracing see NamedTuples and dataclasses -----------------


@pytest.mark.parametrize(
    ("precision", "dtype"), [("64-true", torch.float64), ("bf16-true", torch.bfloat16)]
)
@pytest.mark.parametrize("build", [pair, record], ids=["namedtuple", "dataclass"])
def test_a_true_precision_step_casts_namedtuple_and_dataclass_batches_as_by_hand(
    precision, dtype, build
):
    loss, params = one_step(precision, build())
    loss_by_hand, params_by_hand = one_step(precision, build(dtype))
    assert loss.dtype == dtype
    assert torch.equal(loss, loss_by_hand)
    assert all(torch.equal(a, b) for a, b in zip(params, params_by_hand, strict=True))


def test_a_true_precision_step_keeps_the_batch_type_and_its_other_fields():
    strategy = sg.with_precision(sg.single_device("cpu"), "64-true")
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(3, 1), ctx)
    seen = strategy.step(model, record(), ctx, forward=lambda module, batch: batch)
    assert type(seen) is Record and seen.note == "record" and seen.size == 6
    assert seen.inputs.dtype == torch.float64 and seen.labels.dtype == torch.int64
    seen = strategy.step(model, {"pair": pair()}, ctx, forward=lambda module, batch: batch)
    assert type(seen["pair"]) is Pair and seen["pair"].targets.dtype == torch.float64


@pytest.mark.parametrize("build", [pair, record], ids=["namedtuple", "dataclass"])
def test_traced_step_records_the_tensors_of_namedtuple_and_dataclass_batches(build):
    sink = sg.ListSink()
    strategy = sg.traced(sg.single_device("cpu"), sink)
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(3, 1), ctx)
    strategy.step(model, build(), ctx, forward=regression)
    [event] = [e for e in sink.events if e.field == "step"]
    assert event.shapes == ((6, 3), (6, 1), (6,))
    assert event.dtypes == ("torch.float32", "torch.float32", "torch.int64")


def test_move_to_device_keeps_mapping_types_and_refuses_meta_tensors():
    ordered = OrderedDict(b=torch.ones(1), a=[torch.zeros(2), "x"])
    moved = sg.move_to_device(ordered, "cpu")
    assert type(moved) is OrderedDict and list(moved) == ["b", "a"] and moved["a"][1] == "x"
    with pytest.raises(sg.UsageError, match="a meta tensor holds no data"):
        sg.move_to_device(Pair(torch.ones(1), torch.empty(2, device="meta"), torch.ones(1)), "cpu")


# --- 2. clipping sums the norm in the module's parameter order -------------------------------


def deep_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(7, 5) for _ in range(12)])


def set_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed + 100)
    for index, parameter in enumerate(model.parameters()):
        # Magnitudes from 1e-2 to 1e2: the order of the sum of squares shows in the last bits.
        scale = 10.0 ** ((index * 7) % 5 - 2)
        parameter.grad = torch.randn(parameter.shape, generator=generator) * scale


def reversed_sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    groups = [{"params": [p]} for p in reversed(list(model.parameters()))]
    return torch.optim.SGD(groups, lr=1.0)


SEED = 5  # one where the reversed order rounds the norm differently (checked before the fix)


def test_clipping_by_norm_equals_clip_grad_norm_of_the_module_parameters_bit_for_bit():
    strategy = sg.with_clipping(sg.single_device("cpu"), max_norm=0.5)
    ctx = strategy.setup(sg.Env())
    ours = strategy.wrap(deep_model(SEED), ctx)
    optimizer = reversed_sgd(ours)
    set_gradients(ours, SEED)
    strategy.update(optimizer, ours, ctx)

    theirs = deep_model(SEED)
    by_hand = reversed_sgd(theirs)
    set_gradients(theirs, SEED)
    norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    by_hand.step()

    assert ctx.extras["clipping"].last_norm == float(norm)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b)


def test_clipping_also_clips_optimizer_parameters_the_module_does_not_have():
    strategy = sg.with_clipping(sg.single_device("cpu"), max_norm=1.0)
    ctx = strategy.setup(sg.Env())
    model = strategy.wrap(torch.nn.Linear(2, 1), ctx)
    extra = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([extra, *model.parameters()], lr=1.0)
    for parameter in (*model.parameters(), extra):
        parameter.grad = torch.full_like(parameter, 10.0)
    strategy.update(optimizer, model, ctx)
    total = torch.tensor(10.0) * (2 + 1 + 3) ** 0.5
    assert ctx.extras["clipping"].last_norm == pytest.approx(float(total))
    assert torch.allclose(extra, torch.full((3,), -10.0 / float(total)), atol=1e-6)


# --- 3. `stratagem checkpoint` prints summaries, sorted ---------------------------------------


def test_checkpoint_command_prints_sorted_keys_and_a_summary_instead_of_tensor_values(
    tmp_path, capsys
):
    ctx = sg.single_device("cpu").setup(sg.Env())
    layers: OrderedDict[str, torch.nn.Module] = OrderedDict(
        (name, torch.nn.Linear(1, 1)) for name in ("z", "a", "10", "2")
    )
    big = torch.arange(1000, dtype=torch.float32) * 0.5 + 3.0
    state = {
        "zeta": 1,
        "model": torch.nn.Sequential(layers),
        "big": big,
        "extra": {"weights": big.clone(), "note": "n" * 200, "b": 2},
    }
    sg.checkpoint.save(tmp_path / "c", state, ctx)
    assert main(["checkpoint", str(tmp_path / "c")]) == 0
    shown = capsys.readouterr().out
    lines = shown.splitlines()
    assert max(map(len, lines)) <= 100 and len(lines) < 30
    assert "tensor(" not in shown and "3.5" not in shown and "250.0" not in shown
    assert "    = float32[1000] min=3 max=502.5 mean=252.8" in lines
    assert "    weights = float32[1000] min=3 max=502.5 mean=252.8" in lines
    assert f"    note = '{'n' * 56}..." in lines
    entries = [line.split(" (")[0].strip() for line in lines if re.match(r"  \w+ \(", line)]
    assert entries == ["big", "extra", "model", "zeta"]
    model_keys = lines[lines.index("  model (module)") + 1 : lines.index("  zeta (value)")]
    assert [line.split(":")[0].strip() for line in model_keys] == [
        "2.bias",
        "2.weight",
        "10.bias",
        "10.weight",
        "a.bias",
        "a.weight",
        "z.bias",
        "z.weight",
    ]
    extra_keys = lines[lines.index("  extra (value)") + 1 : lines.index("  model (module)")]
    assert [line.split(" = ")[0].strip() for line in extra_keys] == ["b", "note", "weights"]


# --- 4. accumulate takes a function of the world size ------------------------------------------


def per_world(world_size: int) -> int:
    return 8 // (4 * world_size)


def accumulated_training(every: Any) -> tuple[int, list[torch.Tensor]]:
    strategy = sg.accumulate(sg.single_device("cpu"), every)
    ctx = strategy.setup(sg.Env())
    torch.manual_seed(1)
    model = strategy.wrap(torch.nn.Linear(4, 1), ctx)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(2)
    for _ in range(6):
        loss = strategy.step(model, torch.randn(4, 4, generator=generator), ctx).pow(2).mean()
        strategy.backward(loss, model, ctx)
        strategy.update(optimizer, model, ctx)
    return ctx.extras["accumulation"].every, [p.detach().clone() for p in model.parameters()]


def test_accumulate_with_a_function_of_the_world_size_trains_as_the_int_it_returns():
    resolved, by_function = accumulated_training(per_world)
    _, by_int = accumulated_training(2)
    assert resolved == 2
    assert all(torch.equal(a, b) for a, b in zip(by_function, by_int, strict=True))
    assert not torch.equal(by_int[0], accumulated_training(1)[1][0])  # every matters here


@pytest.mark.parametrize("returned", [0, -1, 2.0, True, None, "2"])
def test_accumulate_refuses_at_setup_a_function_that_returns_no_positive_int(returned):
    strategy = sg.accumulate(sg.single_device("cpu"), lambda world_size: returned)
    with pytest.raises(sg.UsageError) as caught:
        strategy.setup(sg.Env())
    message = str(caught.value)
    assert f"returned {returned!r}" in message and "world size 1" in message
    assert "positive int" in message


def test_accumulate_refuses_a_function_that_cannot_take_the_world_size():
    with pytest.raises(sg.UsageError, match="'every' must be a positive int or a function"):
        sg.accumulate(sg.single_device("cpu"), lambda: 2)


# --- 5. dp(): torch's state dict of a DataParallel has `module.` keys --------------------------


def test_get_model_state_dict_of_the_unwrapped_dp_model_has_the_plain_keys():
    strategy = sg.dp()
    ctx = strategy.setup(sg.Env())
    plain = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    wrapped = strategy.wrap(plain, ctx)
    assert isinstance(wrapped, torch.nn.DataParallel)
    keys = set(plain.state_dict())
    assert set(get_model_state_dict(wrapped)) == {f"module.{key}" for key in keys}  # torch's
    assert set(get_model_state_dict(sg.unwrap(wrapped))) == keys


def test_the_dp_docs_point_to_unwrap_for_plain_keys():
    text = (ROOT / "docs" / "fsdp.md").read_text()
    section = text.split("## `dp()`", 1)[1].split("\n## ", 1)[0]
    assert "sg.unwrap(model)" in section and "module." in section
    assert "get_model_state_dict" in section
    doc = sg.dp.__doc__ or ""
    assert "sg.unwrap(model)" in doc and "module." in doc
