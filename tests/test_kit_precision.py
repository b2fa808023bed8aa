"""check_all on precision stacks with no contract written by the user (issue 33, item 4).

The kit reads the precision a stack applied (``with_precision``'s setup, or fsdp's
``mp_policy``) and derives each law's tolerance from it; a precision stack still
fails on a planted precision bug (a step that skips autocast, an update that never
unscales, a loss scaled twice).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import stratagem as sg
from stratagem.combinators.precision import ScaledBackward
from stratagem.testing import Contract, LawViolation, World, check_all, laws
from stratagem.testing.laws import sgd_momentum
from stratagem.testing.laws._core import squares_mean
from stratagem.testing.modules import batchnorm_mlp, mlp
from stratagem.testing.tolerances import compute_dtype, law_tolerances

EVERY = ["bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true", "32-true"]
MIXED = ["bf16-mixed", "16-mixed"]
# The cross product runs on one module and one optimizer, to keep the file's time modest;
# the defaults (three modules, two optimizers) run on the two mixed precisions.
SMALL = {"modules": {"mlp": mlp()}, "optimizers": (sgd_momentum,)}


# --- derivation, without a world ----------------------------------------------------------


def test_the_kit_reads_the_dtype_a_stack_computes_in():
    assert compute_dtype(sg.ddp(device="cpu")) == torch.float32
    assert compute_dtype(sg.with_precision(sg.ddp(device="cpu"), "bf16-mixed")) == torch.bfloat16
    clipped = sg.with_clipping(sg.with_precision(sg.fsdp(device="cpu"), "16-true"), max_norm=1.0)
    assert compute_dtype(clipped) == torch.float16
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert compute_dtype(sg.fsdp(device="cpu", mp_policy=policy)) == torch.bfloat16


def test_tolerances_widen_with_the_precision_and_stay_tight_in_float32():
    plain = law_tolerances(sg.ddp(device="cpu"), "data-parallel-step")
    assert plain == (1e-4, 1e-5)
    assert (
        law_tolerances(sg.with_precision(sg.ddp(device="cpu"), "64-true"), "data-parallel-step")
        == plain
    )
    bf16 = law_tolerances(sg.with_precision(sg.ddp(device="cpu"), "bf16-mixed"), "wrap-preserves")
    fp16 = law_tolerances(sg.with_precision(sg.ddp(device="cpu"), "16-mixed"), "wrap-preserves")
    assert bf16 > fp16 > law_tolerances(sg.ddp(device="cpu"), "wrap-preserves")


def test_a_contract_that_names_tolerances_overrides_the_derived_ones():
    contract = Contract(rtol=0.5)
    assert contract.tolerances((1e-2, 1e-3)) == (0.5, 1e-3)
    assert Contract(exact=True).tolerances((1e-2, 1e-3)) == (0.0, 0.0)
    assert Contract().tolerances() == (1e-4, 1e-5)


# --- check_all with no contract -------------------------------------------------------------


@pytest.fixture(scope="module")
def world_of_one():
    with World(1) as world:
        yield world


@pytest.mark.slow
@pytest.mark.parametrize("precision", EVERY)
@pytest.mark.parametrize("base", ["single_device", "dp"])
def test_one_process_built_ins_pass_with_every_precision(world_of_one, tmp_path, base, precision):
    factory = {"single_device": lambda: sg.single_device("cpu"), "dp": sg.dp}[base]
    extra = {} if precision in MIXED and base == "single_device" else SMALL
    report = check_all(
        sg.with_precision(factory(), precision), world=world_of_one, directory=tmp_path, **extra
    )
    assert "wrap-preserves" in report.passed
    if precision not in ("32-true",):
        assert "precision-close-to-float32" in report.passed


@pytest.mark.slow
@pytest.mark.parametrize("precision", EVERY)
def test_allreduce_grads_passes_with_every_precision_on_two_ranks(
    stratagem_world, tmp_path, precision
):
    strategy = sg.with_precision(sg.allreduce_grads(device="cpu"), precision)
    report = check_all(strategy, world=stratagem_world, directory=tmp_path, **SMALL)
    assert {"wrap-preserves", "data-parallel-step", "ranks-in-sync"} <= set(report.passed)


@pytest.mark.slow
@pytest.mark.parametrize("precision", EVERY)
@pytest.mark.parametrize("base", ["ddp", "fsdp"])
def test_ddp_and_fsdp_pass_with_every_precision_on_four_ranks(
    stratagem_world_of, tmp_path, base, precision
):
    factory = {"ddp": lambda: sg.ddp(device="cpu"), "fsdp": lambda: sg.fsdp(device="cpu")}[base]
    extra = {} if precision in MIXED and base == "ddp" else SMALL
    strategy = sg.with_precision(factory(), precision)
    report = check_all(strategy, world=stratagem_world_of(4), directory=tmp_path, **extra)
    assert {"wrap-preserves", "data-parallel-step", "accumulation"} <= set(report.passed)


@pytest.mark.slow
@pytest.mark.parametrize("precision", [*MIXED, "bf16-true"])
def test_hsdp_passes_with_mixed_precisions_on_four_ranks(stratagem_world_of, tmp_path, precision):
    strategy = sg.with_precision(sg.hsdp(replicate=2, shard=2, device="cpu"), precision)
    report = check_all(strategy, world=stratagem_world_of(4), directory=tmp_path, **SMALL)
    assert "data-parallel-step" in report.passed


# --- planted precision bugs are still caught -------------------------------------------------


def _planted(name: str) -> sg.Strategy:
    if name == "step-skips-autocast":
        return attrs.evolve(
            sg.with_precision(sg.ddp(device="cpu"), "bf16-mixed"), step=sg.ddp(device="cpu").step
        )
    if name == "update-never-unscales":
        return attrs.evolve(
            sg.with_precision(sg.ddp(device="cpu"), "16-mixed"), update=sg.ddp(device="cpu").update
        )
    if name == "loss-scaled-twice":
        scaled = sg.with_precision(sg.ddp(device="cpu"), "16-mixed")
        return attrs.evolve(scaled, backward=ScaledBackward(scaled.backward))
    raise AssertionError(name)


PLANTED = {
    "step-skips-autocast": "step-autocast",
    "update-never-unscales": "precision-close-to-float32",
    "loss-scaled-twice": "precision-close-to-float32",
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_a_planted_precision_bug_is_still_caught(stratagem_world, tmp_path, bug):
    with pytest.raises(LawViolation) as caught:
        check_all(_planted(bug), world=stratagem_world, directory=tmp_path, **SMALL)
    assert caught.value.law == PLANTED[bug]


@pytest.mark.slow
def test_a_backward_that_never_scales_cannot_even_run_under_16_mixed(stratagem_world, tmp_path):
    # GradScaler refuses to unscale what it never scaled: the kit reports the rank's error.
    planted = attrs.evolve(
        sg.with_precision(sg.ddp(device="cpu"), "16-mixed"), backward=sg.ddp(device="cpu").backward
    )
    with pytest.raises(sg.RankError, match="Attempted unscale_ but _scale is None"):
        check_all(planted, world=stratagem_world, directory=tmp_path, **SMALL)


# --- steps skipped by loss scaling -------------------------------------------------------------


def overflowing_on_the_ranks(module, batch):
    """The laws' loss, infinite on the ranks of a world (not in the reference's process)."""
    loss = squares_mean(module, batch)
    return loss * float("inf") if torch.distributed.is_initialized() else loss


@pytest.mark.slow
def test_the_reference_skips_the_updates_that_every_rank_skipped(stratagem_world):
    # Every rank's loss overflows, so "16-mixed" skips every update there; the reference's
    # does not, and the law makes it skip the same updates instead of reporting a difference.
    strategy = sg.with_precision(sg.ddp(device="cpu"), "16-mixed")
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    laws.check_data_parallel_step(
        strategy, mlp(), batch, world=stratagem_world, forward=overflowing_on_the_ranks
    )


@pytest.mark.slow
def test_fsdp_16_mixed_passes_with_the_batchnorm_module(stratagem_world, tmp_path):
    strategy = sg.with_precision(sg.fsdp(device="cpu"), "16-mixed")
    # Found by the kit: "rank 0 skipped updates [2, 3] and rank 1 [] ...: the ranks must
    # agree on skipping a step" (data-parallel-step). ScaledUpdate decided an overflow on
    # each rank's gradient shard alone; the ranks now agree on it, as ShardedGradScaler does.
    check_all(strategy, world=stratagem_world, directory=tmp_path,
              modules={"batchnorm": batchnorm_mlp()}, optimizers=(sgd_momentum,))  # fmt: skip


def test_a_reference_law_lets_one_percent_of_a_tensor_flip_in_a_low_precision_only():
    from stratagem.testing.laws.state import first_difference
    from stratagem.testing.tolerances import law_outliers

    theirs = {"w": torch.zeros(200)}
    one_off, three_off = torch.zeros(200), torch.zeros(200)
    one_off[7] = three_off[:3] = 0.02  # an AdamW update's sign flipped: 2 x lr
    mixed = sg.with_precision(sg.fsdp(device="cpu"), "bf16-mixed")
    outliers = law_outliers(mixed, "data-parallel-step")
    assert outliers == 0.01
    assert first_difference({"w": one_off}, theirs, rtol=0, atol=1e-3, outliers=outliers) is None
    assert first_difference({"w": three_off}, theirs, rtol=0, atol=1e-3, outliers=outliers)
    assert law_outliers(sg.fsdp(device="cpu"), "data-parallel-step") == 0.0  # float32: none
    assert law_outliers(mixed, "wrap-preserves") == 0.0  # one forward: none
