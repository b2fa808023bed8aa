"""Four silent bugs from other projects' trackers, planted beside their correct versions.

torchtitan #1733 (pipeline parallelism with gradient accumulation averages where it should
sum), accelerate #3979 (an FSDP2 float32 upcast that did nothing), torchtitan PR #4245 (a
tensor-parallel bias multiplied by the TP degree), cosmos PR #162 (a "skip sync" helper that
never skipped under FSDP2). Each bug is caught by the law that names it; each correct version
passes `check_all` with no contract.
"""

from __future__ import annotations

import pytest
import torch

import stratagem as sg
from kit_strategies import (
    averaging_pipeline,
    bf16_fsdp,
    five_layers,
    fsdp_with_skip_sync_helper,
    hand_tensor_parallel,
    mse,
    pairs,
)
from stratagem.testing import LawViolation, check_all, laws
from stratagem.testing.modules import mlp

pytestmark = pytest.mark.slow

BATCH = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
STAGES = (("0", "1", "2"), ("3", "4"))


def two_linears():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def test_pipeline_accumulation_that_averages_is_caught(stratagem_world):
    # torchtitan #1733: the correct pipeline is tests/test_kit_third_edition.py's, passing check_all.
    with pytest.raises(LawViolation) as caught:
        laws.check_accumulation(
            averaging_pipeline(STAGES), five_layers(), pairs(), world=stratagem_world, forward=mse
        )
    assert caught.value.law == "accumulation" and "after update 1" in str(caught.value)


def test_fsdp2_upcast_of_a_bf16_module_passes_and_one_that_does_nothing_is_caught(
    stratagem_world,
):
    # accelerate #3979.
    report = check_all(bf16_fsdp(), world=stratagem_world)
    assert {"float32-master-weights", "combinator-arithmetic"} <= set(report.passed)
    laws.check_master_weights(bf16_fsdp(), mlp().bfloat16(), BATCH, world=stratagem_world)
    with pytest.raises(LawViolation) as caught:
        laws.check_master_weights(
            bf16_fsdp(works=False), mlp().bfloat16(), BATCH, world=stratagem_world
        )
    assert caught.value.law == "float32-master-weights"
    assert "model.0.weight is torch.bfloat16" in str(caught.value)


def test_a_tensor_parallel_bias_added_on_every_rank_is_caught(stratagem_world):
    # torchtitan PR #4245.
    report = check_all(hand_tensor_parallel(), world=stratagem_world, module=two_linears())
    assert {"wrap-preserves", "data-parallel-step"} <= set(report.passed)
    with pytest.raises(LawViolation) as caught:
        check_all(hand_tensor_parallel(bias_on_every_rank=True), world=stratagem_world,
                  module=two_linears())  # fmt: skip
    assert caught.value.law == "wrap-preserves"


def test_a_skip_sync_helper_that_never_skips_under_fsdp2_is_caught(stratagem_world):
    # cosmos PR #162: FSDP2 has no no_sync(); the helper fell back to doing nothing.
    laws.check_no_sync(sg.fsdp(), mlp(), BATCH, world=stratagem_world)
    with pytest.raises(LawViolation) as caught:
        check_all(fsdp_with_skip_sync_helper(), world=stratagem_world)
    assert caught.value.law == "no-sync"
    assert "synchronised" in str(caught.value)
