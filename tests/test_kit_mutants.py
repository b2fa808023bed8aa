"""The kit against strategies researchers write: honest ones pass, planted bugs are caught.

tests/kit_strategies.py holds the strategies; each mutant here names the law that must
catch it and a fragment of the report (the likely cause the law reads off the pattern).
"""

from __future__ import annotations

import random

import attrs
import pytest
import torch

import stratagem as sg
from kit_strategies import (
    CLIPPED,
    CORRECT,
    SHARDED,
    by_hand,
    custom_shard,
    hooked,
    last_rank_wrap,
    local_sgd,
    no_broadcast_wrap,
    params_only_wrap,
    torch_checkpoints,
    unnormalised_backward,
    zero1,
    zero_redundancy_sgd,
)
from stratagem.testing import Contract, LawViolation, check_all, laws
from stratagem.testing.modules import batchnorm_mlp, mlp

pytestmark = pytest.mark.slow

BATCH = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", sorted(CORRECT))
def test_an_honest_custom_strategy_passes_check_all_with_its_contract(
    stratagem_world, tmp_path, name
):
    strategy, contract, reference = CORRECT[name]
    skip = {}
    if contract.sync_every > 1:
        skip["no-sync"] = "ranks agree every 4 updates, not after each"
    report = check_all(
        strategy,
        world=stratagem_world,
        contract=contract,
        reference=reference,
        skip=skip,
        directory=tmp_path,
    )
    assert "data-parallel-step" in report.passed and "checkpoint-round-trip" in report.passed
    assert report.skipped == skip
    if skip:
        assert "skipped: no-sync (ranks agree every 4 updates, not after each)" in str(report)


LOCAL = Contract(sync_every=4, buffers="per-rank")

# (strategy, module, contract, law, fragment of the report)
MUTANTS = {
    "local SGD that sums instead of averaging": (
        local_sgd(4, divide=False), mlp, LOCAL, "data-parallel-step", "after update 4"),
    "local SGD averaged on rank 0 only": (
        local_sgd(4, all_ranks=False), mlp, LOCAL, "data-parallel-step", "after update 4, rank 1"),
    "local SGD that forgets the initial broadcast": (
        attrs.evolve(local_sgd(4), wrap=no_broadcast_wrap), mlp, LOCAL, "data-parallel-step",
        "after wrap, rank 1"),
    "comm hook that sums": (
        hooked("sum"), mlp, Contract(), "data-parallel-step", "a sum where a mean belongs"),
    "comm hook that divides twice": (
        hooked("twice"), mlp, Contract(), "data-parallel-step", "divided by the world size twice"),
    "parameters never broadcast at wrap": (
        by_hand(wrap=no_broadcast_wrap), mlp, Contract(), "data-parallel-step",
        "does not broadcast rank 0's weights"),
    "buffers never synchronised": (
        by_hand(wrap=params_only_wrap), batchnorm_mlp, Contract(), "data-parallel-step",
        "different buffers"),
    "clipping on the local norm before averaging": (
        by_hand(clip=0.05, clip_first=True), mlp, Contract(), "data-parallel-step",
        "after update 1"),
    "accumulation whose loss is not divided by k": (
        attrs.evolve(sg.ddp(), name="undivided", backward=unnormalised_backward), mlp, Contract(),
        "data-parallel-step", "a sum where a mean belongs"),
    "all-reduce by hand that sums": (
        by_hand(divide=False), mlp, Contract(), "data-parallel-step", "a sum where a mean belongs"),
    "all-reduce by hand that divides twice": (
        by_hand(divide_twice=True), mlp, Contract(), "data-parallel-step",
        "divided by the world size twice"),
    "only the first parameter synchronised": (
        by_hand(first_only=True), mlp, Contract(), "data-parallel-step",
        "the ranks hold different values"),
    "step before synchronising": (
        by_hand(step_first=True), mlp, Contract(), "data-parallel-step", "after update 1"),
    "gradients never cleared": (
        by_hand(zero=False), mlp, Contract(), "data-parallel-step", "after update 2"),
    "broadcast from the last rank": (
        by_hand(wrap=last_rank_wrap), mlp, Contract(), "data-parallel-step", "after wrap, rank 0"),
    "comm hook that never all-reduces": (
        hooked("local"), mlp, Contract(), "data-parallel-step", "the ranks hold different values"),
    "local SGD that never averages": (
        local_sgd(4, never=True), mlp, LOCAL, "data-parallel-step", "after update 4"),
    "local SGD that averages after every update": (
        local_sgd(1), mlp, LOCAL, "data-parallel-step", "after update 1"),
    "all-reduce of a copy of the gradient": (
        by_hand(in_place=False), mlp, Contract(), "data-parallel-step",
        "the ranks hold different values"),
    "ZeRO-1 owners that never broadcast": (
        zero1(broadcast=False), mlp, SHARDED, "data-parallel-step", "after update 1"),
    "ZeRO-1 broadcast from the wrong owner": (
        zero1(owner_shift=1), mlp, SHARDED, "data-parallel-step", "after update 1"),
}  # fmt: skip
# Mutants of a custom update that clips: the honest version's reference (the kit cannot know).
REFERENCES = {"clipping on the local norm before averaging": CLIPPED}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_planted_bug_is_caught_by_the_law_that_names_it(stratagem_world, name):
    strategy, module, contract, law, fragment = MUTANTS[name]
    with pytest.raises(LawViolation) as caught:
        laws.check_data_parallel_step(
            strategy, module(), BATCH, world=stratagem_world, contract=contract,
            reference=REFERENCES.get(name),
        )  # fmt: skip
    assert caught.value.law == law
    assert fragment in str(caught.value), str(caught.value)


def verdicts(world, order):
    found = {}
    for name in order:
        strategy, module, contract, _, _ = MUTANTS[name]
        try:
            laws.check_data_parallel_step(
                strategy, module(), BATCH, world=world, contract=contract,
                reference=REFERENCES.get(name),
            )  # fmt: skip
            found[name] = "passed"
        except LawViolation as error:
            found[name] = f"{error.law}: {error.difference}"
    for _ in range(2):  # and honest strategies after, which must not be disturbed
        strategy, contract, _ = CORRECT["allreduce-by-hand"]
        laws.check_data_parallel_step(strategy, mlp(), BATCH, world=world, contract=contract)
        laws.check_data_parallel_step(sg.accumulate(sg.ddp(), 2), mlp(), BATCH, world=world)
    return found


def test_a_law_suite_gives_the_same_verdicts_in_any_order(stratagem_world):
    names = sorted(MUTANTS)
    first = verdicts(stratagem_world, names)
    shuffled = names[:]
    random.Random(7).shuffle(shuffled)
    assert verdicts(stratagem_world, shuffled) == first
    assert all(verdict != "passed" for verdict in first.values())


# --- shard ---------------------------------------------------------------------------------


def test_an_honest_custom_shard_and_every_built_in_shard_keep_the_partition(stratagem_world):
    for strategy in (custom_shard(), custom_shard(sampler="slices"), sg.ddp(), sg.fsdp()):
        laws.check_shard_partition(strategy, world=stratagem_world)
        laws.check_shard_partition(strategy, world=stratagem_world, shuffle=False, size=24)


SHARD_MUTANTS = {
    "neighbouring ranks overlap": (custom_shard(sampler="slices", overlap=True), "went to rank"),
    "every rank reads rank 0's share": (
        custom_shard(sampler="slices", everyone_reads_rank_zero=True),
        "read exactly rank 0's samples"),
    "set_epoch never called": (custom_shard(advance=False), "never advances"),
    "rank 0 gets more batches": (
        custom_shard(sampler="slices", extra_on_rank_zero=True), "different numbers of batches"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SHARD_MUTANTS))
def test_a_planted_shard_bug_is_caught(stratagem_world, name):
    strategy, fragment = SHARD_MUTANTS[name]
    with pytest.raises(LawViolation) as caught:
        laws.check_shard_partition(strategy, world=stratagem_world)
    assert caught.value.law == "shard-partition"
    assert fragment in str(caught.value), str(caught.value)


# --- save and load -----------------------------------------------------------------------------


def test_an_honest_custom_save_and_load_keep_the_checkpoint_laws(stratagem_world, tmp_path):
    for name, module in (("mlp", mlp), ("batchnorm", batchnorm_mlp)):
        laws.check_checkpoint_round_trip(
            torch_checkpoints(), module(), BATCH, world=stratagem_world, directory=tmp_path / name
        )
    laws.check_checkpoint_strict(torch_checkpoints(), mlp(), world=stratagem_world,
                                 directory=tmp_path)  # fmt: skip


def test_a_save_that_loses_buffers_is_caught(stratagem_world, tmp_path):
    # With a strict load the loss is loud (load raises); with a lenient one it is silent.
    with pytest.raises(LawViolation, match=r"model\.1\.running_mean"):
        laws.check_checkpoint_round_trip(
            torch_checkpoints(buffers=False, strict=False), batchnorm_mlp(), BATCH, world=stratagem_world,
            directory=tmp_path,
        )  # fmt: skip


def test_a_load_that_ignores_missing_keys_is_caught(stratagem_world, tmp_path):
    with pytest.raises(LawViolation, match=r"(?s)'checkpoint-strict'.*lacks a key of the target"):
        laws.check_checkpoint_strict(
            torch_checkpoints(strict=False), mlp(), world=stratagem_world, directory=tmp_path
        )


def test_ranks_in_sync_catches_ranks_that_drift_apart(stratagem_world):
    laws.check_ranks_in_sync(by_hand(), mlp(), BATCH, world=stratagem_world)
    laws.check_ranks_in_sync(local_sgd(4), mlp(), BATCH, world=stratagem_world, contract=LOCAL)
    with pytest.raises(LawViolation, match=r"(?s)'ranks-in-sync'.*after update 4, rank 1"):
        laws.check_ranks_in_sync(
            local_sgd(4, all_ranks=False), mlp(), BATCH, world=stratagem_world, contract=LOCAL
        )


# --- batches the user's loss reads, and preconditions --------------------------------------


def pair_loss(module, batch):
    inputs, targets = batch
    return (module(inputs) - targets).pow(2).mean()


def dict_loss(module, batch):
    return (module(batch["x"]) - batch["y"]).pow(2).mean()


def test_tuple_and_dict_batches_with_a_user_loss_work_in_the_training_laws(stratagem_world):
    inputs, targets = BATCH, torch.randn(8, 2, generator=torch.Generator().manual_seed(4))
    for strategy in (sg.ddp(), sg.accumulate(sg.fsdp(), 2)):
        laws.check_data_parallel_step(
            strategy, batchnorm_mlp(), (inputs, targets), world=stratagem_world, forward=pair_loss
        )
        laws.check_accumulation(
            strategy, mlp(), {"x": inputs, "y": targets}, world=stratagem_world, forward=dict_loss
        )


def test_inputs_that_cannot_test_a_law_are_usage_errors_not_violations(stratagem_world):
    with pytest.raises(sg.UsageError, match=r"the batch has 7 samples, which 2 ranks cannot"):
        laws.check_data_parallel_step(sg.ddp(), mlp(), BATCH[:7], world=stratagem_world)
    with pytest.raises(sg.UsageError, match=r"'module' must be a torch.nn.Module with trainable"):
        laws.check_data_parallel_step(sg.ddp(), torch.nn.ReLU(), BATCH, world=stratagem_world)
    with pytest.raises(sg.UsageError, match=r"the default forward .* takes a tensor batch"):
        laws.check_data_parallel_step(sg.ddp(), mlp(), (BATCH, BATCH), world=stratagem_world)
    with pytest.raises(sg.UsageError, match=r"'skip' names \['no-such-law'\], which are not laws"):
        check_all(sg.ddp(), world=stratagem_world, skip={"no-such-law": "why"})


def test_the_accumulation_law_holds_for_any_window_of_accumulate(stratagem_world):
    # The law's own micro-batches (2) differ from accumulate's window (4): the reference
    # must still accumulate over 4, as the ranks do.
    batch = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))
    laws.check_accumulation(sg.accumulate(sg.ddp(), 4), mlp(), batch, world=stratagem_world)


def test_ranks_in_sync_starts_from_one_module_when_the_contract_says_so(stratagem_world):
    unbroadcast = by_hand(wrap=no_broadcast_wrap)
    laws.check_ranks_in_sync(
        unbroadcast, mlp(), BATCH, world=stratagem_world, contract=Contract(synced_init=True)
    )
    with pytest.raises(LawViolation, match="'ranks-in-sync'"):
        laws.check_ranks_in_sync(unbroadcast, mlp(), BATCH, world=stratagem_world)


def test_a_save_that_drops_plain_values_is_caught(stratagem_world, tmp_path):
    with pytest.raises(LawViolation, match=r"(?s)'checkpoint-round-trip'.*plain values \{\}"):
        laws.check_checkpoint_round_trip(
            torch_checkpoints(values=False), mlp(), BATCH, world=stratagem_world,
            directory=tmp_path,
        )  # fmt: skip


def test_per_rank_values_saved_as_rank_zeros_are_caught(stratagem_world, tmp_path):
    with pytest.raises(LawViolation, match=r"(?s)'checkpoint-strict'.*rank 1: the per-rank value"):
        laws.check_checkpoint_strict(
            torch_checkpoints(own_ranks=False), mlp(), world=stratagem_world, directory=tmp_path
        )


def test_torch_zero_redundancy_optimizer_passes_with_a_sharded_contract(stratagem_world):
    laws.check_data_parallel_step(
        sg.ddp(), mlp(), BATCH, world=stratagem_world, optimizer=zero_redundancy_sgd,
        contract=SHARDED,
    )  # fmt: skip
    with pytest.raises(LawViolation, match=r"optimizer\.\S+ is missing"):  # without the contract
        laws.check_data_parallel_step(
            sg.ddp(), mlp(), BATCH, world=stratagem_world, optimizer=zero_redundancy_sgd
        )
