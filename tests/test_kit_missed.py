"""The kit's third edition (issue 35): bugs the second edition missed, and the trackers' four.

Each planted bug sits beside its correct version: the bug is caught by the law that names
it, and the correct version passes `check_all` with the contract docs/testing.md tells a
user to write.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from kit_strategies import background_checkpoints, local_sgd, thread_checkpoints
from stratagem.testing import Contract, LawViolation, check_all, laws
from stratagem.testing.modules import batchnorm_mlp, mlp

pytestmark = pytest.mark.slow

BATCH = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
AVERAGED = Contract(sync_every=4, buffers="averaged")
LOCAL_SKIP = {"no-sync": "ranks agree every 4 updates, not after each"}


# --- local SGD that averages BatchNorm's buffers with its parameters ---------------------------


def test_local_sgd_that_averages_buffers_passes_check_all_with_its_contract(stratagem_world):
    report = check_all(
        local_sgd(4, buffers=True), world=stratagem_world, contract=AVERAGED, skip=LOCAL_SKIP
    )
    assert {"data-parallel-step", "accumulation", "checkpoint-round-trip"} <= set(report.passed)


def test_local_sgd_that_never_averages_buffers_is_caught(stratagem_world):
    with pytest.raises(LawViolation) as caught:
        laws.check_data_parallel_step(
            local_sgd(4), batchnorm_mlp(), BATCH, world=stratagem_world, contract=AVERAGED
        )
    assert caught.value.law == "data-parallel-step"
    assert "after update 4" in str(caught.value) and "running_" in str(caught.value)


def test_buffers_averaged_after_every_update_at_k1(stratagem_world):
    # k=1 local SGD with plain SGD, averaging its buffers: the shares' mean after each update.
    laws.check_data_parallel_step(
        local_sgd(1, buffers=True), batchnorm_mlp(), BATCH, world=stratagem_world,
        optimizer=laws.sgd, contract=Contract(buffers="averaged"),
    )  # fmt: skip
    with pytest.raises(LawViolation, match="running_"):
        laws.check_data_parallel_step(
            local_sgd(1), batchnorm_mlp(), BATCH, world=stratagem_world, optimizer=laws.sgd,
            contract=Contract(buffers="averaged"),
        )  # fmt: skip


# --- oracles independent of the combinator they check ---------------------------------------


def test_a_sum_normalised_accumulation_of_a_mean_loss_is_caught(stratagem_world):
    summed = sg.accumulate(sg.ddp(), 2, normalize="sum")
    laws.check_data_parallel_step(summed, mlp(), BATCH, world=stratagem_world)  # agrees with itself
    with pytest.raises(LawViolation) as caught:
        check_all(summed, world=stratagem_world)
    assert caught.value.law == "combinator-arithmetic", str(caught.value)
    assert "after update 1" in str(caught.value)


@pytest.mark.parametrize(
    "stack",
    [
        sg.accumulate(sg.ddp(), 2),
        sg.with_clipping(sg.accumulate(sg.ddp(), 2), max_norm=0.05),
        sg.with_clipping(sg.fsdp(), max_value=0.01),
        sg.with_precision(sg.ddp(), "bf16-mixed"),
        sg.with_precision(sg.accumulate(sg.ddp(), 2), "16-mixed"),
        sg.compiled(sg.ddp(), backend="eager"),
        sg.with_activation_checkpointing(sg.ddp(), sg.every_module_of(torch.nn.Linear)),
    ],
    ids=lambda s: s.name,
)
def test_built_in_combinators_match_plain_torch_by_hand(stratagem_world, stack):
    laws.check_combinator_arithmetic(stack, mlp(), BATCH, world=stratagem_world)
    laws.check_combinator_arithmetic(stack, batchnorm_mlp(), BATCH, world=stratagem_world)


# --- checkpoints: training between save and load, background saves, settings -----------------


def test_honest_background_and_thread_saves_pass_the_resume_law(stratagem_world, tmp_path):
    for name, strategy in (("thread", thread_checkpoints()), ("dcp", background_checkpoints())):
        for module in (mlp, batchnorm_mlp):
            laws.check_checkpoint_resume(
                strategy, module(), BATCH, world=stratagem_world,
                directory=tmp_path / name / module.__name__,
            )  # fmt: skip


@pytest.mark.parametrize(
    ("strategy", "fragment"),
    [
        (thread_checkpoints(copy=False), "wrote live tensors"),
        (thread_checkpoints(keep_settings=True), "keeps the live hyperparameters"),
        (thread_checkpoints(wait=False), "still in flight"),
        (background_checkpoints(wait=False), "still in flight"),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_a_planted_checkpoint_bug_is_caught_by_the_resume_law(stratagem_world, tmp_path, strategy,
                                                              fragment):  # fmt: skip
    for attempt in range(3):  # every time, not by race
        with pytest.raises(LawViolation) as caught:
            laws.check_checkpoint_resume(
                strategy, mlp(), BATCH, world=stratagem_world, directory=tmp_path / str(attempt)
            )
        assert caught.value.law == "checkpoint-resume"
        assert fragment in str(caught.value), str(caught.value)
