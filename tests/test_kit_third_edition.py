"""The kit's third edition (issue 35): no false alarm on a correct strategy.

Each test here is a correct strategy that the second edition rejected:
``optimizers=`` reached one law only, and no `Contract` could say "k=1 local
SGD, each rank keeps its own optimizer state"; torch's default
``DistributedSampler(drop_last=False)`` pads with repeated samples; a run
that raised with a background save in flight killed a rank, and the next
strategy was blamed for it; and a pipeline could not be checked at all.
"""

from __future__ import annotations

import time

import attrs
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

import kit_strategies
import stratagem as sg
from kit_strategies import EpochLoader, five_layers, mse, pairs
from stratagem import training
from stratagem.checkpoint import directory
from stratagem.testing import Contract, LawViolation, World, check_all, laws
from stratagem.testing.modules import mlp

pytestmark = pytest.mark.slow


# --- optimizers= reaches every training law; per-rank optimizer state -------------------------


def local_sgd(every, **bugs):
    """The researchers' local SGD, stepping its plain module (ddp()'s step wants the wrapper)."""
    return attrs.evolve(kit_strategies.local_sgd(every, **bugs), step=training.step)


def test_optimizers_reach_every_training_law(stratagem_world):
    # k=1 local SGD with plain SGD is data parallelism: the average of the ranks' steps is the
    # step on the average gradient. Before: the accumulation and ranks-in-sync laws used SGD
    # with momentum anyway, whose per-rank momentum this strategy never averages.
    report = check_all(
        local_sgd(1),
        world=stratagem_world,
        module=mlp(),
        optimizers=(laws.sgd,),
        contract=Contract(buffers="per-rank"),
    )
    assert {"data-parallel-step", "accumulation", "ranks-in-sync"} <= set(report.passed)


def test_k1_local_sgd_keeps_per_rank_optimizer_state_by_contract(stratagem_world):
    # With momentum and AdamW each rank's optimizer state is its own; the contract says so and
    # each rank's state must equal that of a replica trained on its own share.
    contract = Contract(buffers="per-rank", optimizer_state="per-rank")
    report = check_all(local_sgd(1), world=stratagem_world, contract=contract)
    assert {"data-parallel-step", "accumulation", "ranks-in-sync"} <= set(report.passed)


def test_per_rank_optimizer_state_is_checked_not_waived(stratagem_world):
    contract = Contract(buffers="per-rank", optimizer_state="per-rank")
    with pytest.raises(LawViolation) as caught:
        laws.check_data_parallel_step(
            local_sgd(1, never=True), mlp(), torch.randn(8, 4), world=stratagem_world,
            contract=contract,
        )  # fmt: skip
    assert caught.value.law == "data-parallel-step"


def test_a_per_rank_optimizer_state_is_a_contract_choice():
    with pytest.raises(ValueError, match="optimizer_state"):
        Contract(optimizer_state="each")  # type: ignore[arg-type]


# --- torch's padded DistributedSampler ----------------------------------------------------------


@attrs.frozen
class TorchSamplerShard:
    """Shard: torch's DistributedSampler as its docs show it (drop_last=False: it pads)."""

    repeats: int = 0  # bug switch: repeat this many more samples than torch's padding

    def __call__(self, loader, ctx):
        if isinstance(loader.dataset, IterableDataset):
            raise sg.UsageError("torch-sampler shard: split streams inside the dataset")
        sampler = DistributedSampler(loader.dataset, num_replicas=ctx.world_size, rank=ctx.rank)
        if self.repeats:
            sampler.num_samples += self.repeats
            sampler.total_size += self.repeats * ctx.world_size
        rebuilt = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler)
        return EpochLoader(rebuilt, sampler)


def torch_sampler(**options):
    return attrs.evolve(
        sg.ddp(device="cpu"), name="torch-sampler", shard=TorchSamplerShard(**options)
    )


def test_torch_default_distributed_sampler_passes_shard_partition(stratagem_world):
    laws.check_shard_partition(torch_sampler(), world=stratagem_world)  # 23 samples: 1 repeat


def test_the_padding_is_bounded_by_what_torch_pads(stratagem_world):
    # 23 samples on 2 ranks: torch repeats one; a sampler that repeats 3 more overlaps.
    with pytest.raises(LawViolation, match="but for torch.s padding"):
        laws.check_shard_partition(torch_sampler(repeats=3), world=stratagem_world)


# --- a World after a run that raised with a background save in flight -------------------------


def _fail_at_commit(stage):
    if stage == "manifest":
        raise OSError(5, "Input/output error (planted)")


def _save_that_fails_then_raise(strategy, ctx, root):
    model = strategy.wrap(torch.nn.Linear(4, 2), ctx)
    directory.stage_hook = _fail_at_commit
    try:
        handle = sg.checkpoint.save(f"{root}/c", {"model": model}, ctx, blocking=False)
        deadline = time.monotonic() + 30
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        directory.stage_hook = directory._ignore
    raise RuntimeError("the run failed while its save was in flight")


def test_a_failed_run_with_a_save_in_flight_does_not_fail_the_next_check(tmp_path):
    strategy = sg.ddp(device="cpu")
    with World(2) as world:
        with pytest.raises(sg.RankError, match="in flight"):
            world.run(_save_that_fails_then_raise, strategy, str(tmp_path))
        report = check_all(strategy, world=world, directory=tmp_path)
        assert "data-parallel-step" in report.passed


# --- (inputs, targets) batches, forward=, and pipelines -----------------------------------------


def test_purity_takes_an_inputs_targets_batch(stratagem_world):
    laws.check_purity(
        sg.ddp(device="cpu"), five_layers(), pairs(), world=stratagem_world, forward=mse
    )


def test_check_all_takes_forward_for_inputs_targets_batches(stratagem_world, tmp_path):
    report = check_all(
        sg.ddp(device="cpu"), world=stratagem_world, module=five_layers(), batch=pairs(),
        forward=mse, directory=tmp_path,
    )  # fmt: skip
    assert {"data-parallel-step", "accumulation", "purity", "checkpoint-round-trip"} <= set(
        report.passed
    )


STAGES = (("0", "1", "2"), ("3", "4"))


def test_a_correct_pipeline_passes_check_all(stratagem_world, tmp_path):
    strategy = sg.pipeline(stages=STAGES, schedule="1f1b", microbatches=2, timeout=60, device="cpu")
    report = check_all(
        strategy, world=stratagem_world, module=five_layers(), batch=pairs(), forward=mse,
        directory=tmp_path,
    )  # fmt: skip
    assert {
        "wrap-preserves", "data-parallel-step", "accumulation", "no-sync", "ranks-in-sync",
        "purity", "checkpoint-round-trip", "shard-partition",
    } <= set(report.passed)  # fmt: skip


def test_two_pipeline_replicas_pass_check_all(stratagem_world_of, tmp_path):
    # ("dp", "pp") on 4 ranks: the same stage of each replica holds the same keys and must agree.
    strategy = sg.pipeline(
        stages=STAGES, schedule="1f1b", microbatches=2, size=2, timeout=60, device="cpu"
    )
    report = check_all(
        strategy, world=stratagem_world_of(4), module=five_layers(), batch=pairs(16), forward=mse,
        directory=tmp_path,
    )  # fmt: skip
    assert {"data-parallel-step", "accumulation", "no-sync", "ranks-in-sync"} <= set(report.passed)


def test_a_stage_list_that_loses_a_parameter_free_module_is_caught(stratagem_world):
    # Module "3" (a Tanh) is in no stage: every key is still held, but the model computes
    # something else.
    strategy = sg.pipeline(
        stages=(("0", "1", "2"), ("4",)), schedule="1f1b", microbatches=2, timeout=60,
        device="cpu",
    )  # fmt: skip
    with pytest.raises(LawViolation) as caught:
        check_all(strategy, world=stratagem_world, module=five_layers(), batch=pairs(), forward=mse)
    assert caught.value.law == "wrap-preserves"


def test_pipeline_replicas_that_are_never_averaged_are_caught(stratagem_world_of):
    strategy = attrs.evolve(
        sg.pipeline(stages=STAGES, schedule="1f1b", microbatches=2, size=2, timeout=60,
                    device="cpu"),
        name="pipeline-unaveraged",
        update=training.update,
    )  # fmt: skip
    with pytest.raises(LawViolation) as caught:
        laws.check_data_parallel_step(
            strategy, five_layers(), pairs(16), world=stratagem_world_of(4), forward=mse
        )
    assert "after update 1" in caught.value.difference
